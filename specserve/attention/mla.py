"""Multi-head latent attention (MLA) over the paged latent cache: the torch reference.

An MLA layer caches, per token, the normed KV latent c (kv_lora_rank) and the rotated rotary
key k_pe (qk_rope_head_dim) in one row of `kv_cache` [num_blocks, block_size, L + R]: the
same row serves every head. With the key and value up-projections absorbed into the query
and output projections (models/mla.py), attention runs in the latent space:

    score(h, s) = (q_latent[h] . c[s] + q_pe[h] . k_pe[s]) * scale
    out[h]      = sum_s softmax(score)[h, s] * c[s]           (then W_UV, o_proj)

Decode and verification always take this path (the kernel in attention/mla_triton.py for
CUDA); long prefills may expand per-head keys and values instead (attention/mla_expanded.py).

`mla_forward` is everything between the projections: the latent's RMSNorm, RoPE of q_pe and
k_pe, the W_UK absorb, the latent KV write, attention and W_UV. Its torch form here
(`mla_prologue_ref` + attention + a bmm) is the reference; the Triton backend runs small
(decode and verification) batches as three kernels instead (attention/mla_fused.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve import ops
from specserve.attention.backend import CommonAttentionMetadata
from specserve.attention.kv_quant import (
    check_kv_scales,
    compute_kv_scales_,
    dequantize_kv_ref,
    is_fp8,
    store_kv,
)


@dataclass
class MLAWeights:
    """What an MLA layer's attention needs besides activations (models/mla.py builds it)."""

    # [H, nope, L]: views of kv_b_proj's weight (last dim contiguous)
    w_uk: torch.Tensor
    # [H, v, L]
    w_uv: torch.Tensor
    # [L]: kv_a_layernorm's weight
    kv_norm_weight: torch.Tensor
    kv_norm_eps: float
    # [max_position, R] fp32 as cat(cos, cos) / cat(sin, sin)
    cos: torch.Tensor
    sin: torch.Tensor
    # the checkpoint's rotary channels are interleaved pairs (models/mla.py)
    rope_interleave: bool
    scale: float
    # [2] fp32: the layer's KV scales; an fp8 latent cache stores row / kv_scales[0]
    kv_scales: torch.Tensor | None = None
    # calculate_kv_scales: this forward sets kv_scales[0] from its latent rows (torch prologue)
    calc_kv_scale: bool = False

    @property
    def latent_scale(self) -> torch.Tensor | None:
        """[] fp32: the latent cache's scale (vLLM's k_scale), None without kv_scales."""
        return None if self.kv_scales is None else self.kv_scales[0]

    @property
    def nope(self) -> int:
        return self.w_uk.shape[1]


def deinterleave(
    # [..., R] as pairs (x0, x1), (x2, x3), ...
    x: torch.Tensor,
) -> torch.Tensor:
    """[x0, x2, ..., x1, x3, ...]: the rotate-half layout of interleaved rotary pairs."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def mla_prologue_ref(
    # [num_tokens]
    positions: torch.Tensor,
    # [num_tokens, H, nope + R]: q_proj / q_b_proj's output
    q: torch.Tensor,
    # [num_tokens, L + R]: kv_a_proj_with_mqa's output (latent not normed, k_pe not rotated)
    kv_a: torch.Tensor,
    w: MLAWeights,
    # [num_blocks, block_size, L + R]
    kv_cache: torch.Tensor,
    # [num_tokens] int64, -1 = padding
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_latent [T, H, L], rotated q_pe [T, H, R]), this step's latent rows written."""
    q_nope, q_pe = prologue_unabsorbed(positions, q, kv_a, w, kv_cache, slot_mapping)
    # [H, T, nope] @ [H, nope, L] -> [T, H, L]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1)
    return q_latent, q_pe


def prologue_unabsorbed(
    positions: torch.Tensor,
    q: torch.Tensor,
    kv_a: torch.Tensor,
    w: MLAWeights,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_prologue_ref` up to the absorb: (q_nope [T, H, nope], rotated q_pe [T, H, R]),
    the latent normed and this step's latent rows written."""
    T = q.shape[0]
    L, R = w.w_uk.shape[2], q.shape[2] - w.nope
    q_nope, q_pe = q.split([w.nope, R], -1)
    kv_c, k_pe = kv_a.split([L, R], -1)
    kv_c, _ = ops.rms_norm(kv_c.contiguous(), w.kv_norm_weight, w.kv_norm_eps)
    if w.rope_interleave:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q_pe, k_pe = ops.rope_(positions, q_pe.contiguous(), k_pe.reshape(T, 1, -1), w.cos, w.sin)
    if w.calc_kv_scale:
        assert w.kv_scales is not None
        compute_kv_scales_(w.kv_scales, torch.cat([kv_c, k_pe.view(T, -1)], dim=-1), None)
    write_latent(kv_cache, kv_c, k_pe.view(T, -1), slot_mapping, w.latent_scale)
    return q_nope, q_pe


def gather_requests(
    # [num_tokens, ...]
    x: torch.Tensor,
    c: CommonAttentionMetadata,
    fill: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x padded per request [B, max_query_len, ...], each token's offset in its request)."""
    T = x.shape[0]
    offset = torch.arange(T, device=x.device) - c.query_start_loc.long()[c.token_req]
    out = x.new_full((c.num_reqs, c.max_query_len, *x.shape[1:]), fill)
    out[c.token_req, offset] = x
    return out, offset


def write_latent(
    # [num_blocks, block_size, L + R]
    kv_cache: torch.Tensor,
    # [num_tokens, L]
    kv_c: torch.Tensor,
    # [num_tokens, R]
    k_pe: torch.Tensor,
    # [num_tokens] int64, -1 = padding
    slot_mapping: torch.Tensor,
    # [] fp32: an fp8 cache's scale (MLAWeights.latent_scale), else None
    scale: torch.Tensor | None = None,
) -> None:
    # NOTE: slot -1 is the last slot of the reserved null block (as torch_ref's KV write).
    nb, bs, d = kv_cache.shape
    row = store_kv(kv_cache, torch.cat([kv_c, k_pe], dim=-1), scale)
    kv_cache.view(nb * bs, d)[slot_mapping] = row


def mla_attention_ref(
    # [num_tokens, num_heads, L]: q_nope absorbed through W_UK
    q_latent: torch.Tensor,
    # [num_tokens, num_heads, R]: rotated
    q_pe: torch.Tensor,
    # [num_blocks, block_size, L + R]
    kv_cache: torch.Tensor,
    c: CommonAttentionMetadata,
    scale: float,
    # [] fp32: an fp8 cache's scale, else None
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal latent attention of every token over its request's cached rows (this step's
    rows already written). Returns [num_tokens, num_heads, L] in q_latent's dtype."""
    L = q_latent.shape[2]
    bs = kv_cache.shape[1]
    nblk = (c.max_seq_len + bs - 1) // bs
    # [B, nblk * bs, L + R]: each request's pages gathered into one run.
    kv = gather_latent(kv_cache, c.block_table[:, :nblk], kv_scale).float()
    S = kv.shape[1]
    qp, offset = gather_requests(torch.cat([q_latent, q_pe], dim=-1).float(), c)
    pos, _ = gather_requests(c.positions.long(), c, fill=-1)
    scores = torch.einsum("bqhd,bsd->bhqs", qp, kv) * scale
    visible = torch.arange(S, device=kv.device)[None, None, :] <= pos[:, :, None]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    # Padded query rows see nothing; keep them finite (their output is dropped).
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhqs,bsl->bqhl", probs, kv[..., :L])
    return out[c.token_req, offset].to(q_latent.dtype)


def gather_latent(
    # [num_blocks, block_size, L + R]
    kv_cache: torch.Tensor,
    # [B, nblk] int32
    block_table: torch.Tensor,
    # [] fp32: an fp8 cache's scale, else None
    kv_scale: torch.Tensor | None,
) -> torch.Tensor:
    """[B, nblk * block_size, L + R]: each request's latent rows in one run; an fp8 cache
    dequantized (fp32)."""
    kv = kv_cache[block_table.long()].flatten(1, 2)
    check_kv_scales(kv.dtype, kv_scale)
    if is_fp8(kv.dtype):
        kv = dequantize_kv_ref(kv, kv_scale)
    return kv


def mla_forward(
    # [num_tokens]
    positions: torch.Tensor,
    # [num_tokens, H, nope + R]
    q: torch.Tensor,
    # [num_tokens, L + R]
    kv_a: torch.Tensor,
    w: MLAWeights,
    # [num_blocks, block_size, L + R]
    kv_cache: torch.Tensor,
    c: CommonAttentionMetadata,
    use_triton: bool = False,
    # the key count split-KV assumes (max_model_len; None: the batch's max_seq_len)
    split_len: int | None = None,
) -> torch.Tensor:
    """Norm, RoPE, absorb, write the latent rows, attend, W_UV: [num_tokens, H, v]. Triton
    where asked (fused kernels for small batches, mla_fused.py), else torch."""
    from specserve.attention import mla_expanded

    if c.tree_mask is not None:  # no MLA kernel (torch or Triton) reads the ancestor masks
        raise ValueError("MLA attention has no draft-tree masks: run without a draft tree")
    if use_triton:
        from specserve.attention import mla_fused

        # NOTE: calculate_kv_scales computes an fp8 cache's latent scale from this step's rows
        # before they are written (mla_prologue_ref): the fused prologue writes with the scale
        # it is given, so such a step takes the torch prologue and the Triton attention below.
        if not w.calc_kv_scale and mla_fused.fusable(q, w, c):
            return mla_fused.mla_forward_fused(positions, q, kv_a, w, kv_cache, c, split_len)
    if mla_expanded.expand_fits(c, w, q.shape[2] - w.nope):
        return mla_expanded.mla_prefill_expanded(positions, q, kv_a, w, kv_cache, c)
    q_latent, q_pe = mla_prologue_ref(positions, q, kv_a, w, kv_cache, c.slot_mapping)
    if use_triton:
        from specserve.attention.mla_triton import mla_attention

        out = mla_attention(
            q_latent, q_pe, kv_cache, c, w.scale, split_len=split_len, kv_scale=w.latent_scale
        )
    else:
        out = mla_attention_ref(q_latent, q_pe, kv_cache, c, w.scale, w.latent_scale)
    # [H, T, L] @ [H, L, v] -> [T, H, v]
    return torch.bmm(out.transpose(0, 1), w.w_uv.transpose(1, 2)).transpose(0, 1)
