"""Reference paged attention in plain torch (any device): the CPU backend and what the Triton
kernels are tested against. Gathers pages, exact causal + window masks, optional per-head sinks
(a learned logit in every softmax denominator, gpt-oss). No Triton import: CPU-only installs run
the engine on this backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.attention.backend import AttentionBackend, CommonAttentionMetadata
from specserve.attention.kv_quant import check_kv_scales, dequantize_kv_ref, is_fp8, store_kv


@dataclass
class TorchAttentionMetadata:
    common: CommonAttentionMetadata
    # [num_tokens] int64: offset of each token inside its request's query
    token_offset: torch.Tensor
    # [num_tokens] int64: first key position each token may see (window bound; 0 without one)
    window_start: torch.Tensor


def reshape_and_cache_ref(
    # [num_tokens, num_kv_heads, head_dim]
    k: torch.Tensor,
    # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,
    # [num_tokens] int64, -1 = padding
    slot_mapping: torch.Tensor,
    # [2] fp32 (key, value scales) for an fp8 cache, else None
    kv_scales: torch.Tensor | None = None,
) -> None:
    """k and v written at their slots (kv_write.reshape_and_cache in torch); an fp8 cache
    stores them quantized by kv_scales (attention/kv_quant.py)."""
    # NOTE: slot -1 indexes the last slot of the flattened cache: that block is reserved as the
    # null block and never handed out, so padded tokens write there harmlessly.
    nb, bs, hk, d = kv_cache.shape[1:]
    ks, vs = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
    kv_cache[0].view(nb * bs, hk, d)[slot_mapping] = store_kv(kv_cache, k, ks)
    kv_cache[1].view(nb * bs, hk, d)[slot_mapping] = store_kv(kv_cache, v, vs)


def paged_attention_ref(
    # [num_tokens, num_heads, head_dim]
    q: torch.Tensor,
    # [2, num_blocks, block_size, num_kv_heads, head_dim]: this step's keys already written
    kv_cache: torch.Tensor,
    meta: TorchAttentionMetadata,
    scale: float,
    # [num_heads] float or None: per-head sink logits
    sinks: torch.Tensor | None = None,
    # [2] fp32 (key, value scales) for an fp8 cache, else None
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (and windowed, by meta.window_start) attention of every token over its request's
    cached keys, in fp32: [num_tokens, num_heads, head_dim] in q's dtype. An fp8 cache is
    dequantized as it is gathered (x * scale)."""
    c = meta.common
    num_tokens, num_heads, head_dim = q.shape
    bs, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    nblk = (c.max_seq_len + bs - 1) // bs
    # [2, B, nblk * bs, Hkv, D]: each request's pages gathered into one contiguous run.
    kv = kv_cache[:, c.block_table[:, :nblk].long()].flatten(2, 3)
    check_kv_scales(kv.dtype, kv_scales)
    if is_fp8(kv.dtype):
        kv = dequantize_kv_ref(kv, kv_scales.view(2, 1, 1, 1, 1))
    kv = kv.float()
    B, S, Q = kv.shape[1], kv.shape[2], c.max_query_len
    qp = q.new_zeros(B, c.max_query_len, num_heads, head_dim, dtype=torch.float32)
    qp[c.token_req, meta.token_offset] = q.float()
    pos = torch.full((B, c.max_query_len), -1, dtype=torch.long, device=q.device)
    pos[c.token_req, meta.token_offset] = c.positions
    wstart = torch.zeros_like(pos)
    wstart[c.token_req, meta.token_offset] = meta.window_start
    # [B, Hkv, G, Q, D] x [B, Hkv, S, D] -> [B, Hkv, G, Q, S]
    qg = qp.view(B, -1, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    keys = kv[0].permute(0, 2, 1, 3)
    vals = kv[1].permute(0, 2, 1, 3)
    scores = torch.einsum("bhgqd,bhsd->bhgqs", qg, keys) * scale
    key_pos = torch.arange(S, device=q.device)
    in_window = key_pos[None, None, :] >= wstart[:, :, None]
    if c.tree_mask is not None:
        # Keys at or past the token's tree start are visible through its ancestor bits only.
        tstart = torch.full_like(pos, 1 << 40)
        tstart[c.token_req, meta.token_offset] = c.tree_start
        tmask = torch.zeros_like(pos)
        tmask[c.token_req, meta.token_offset] = c.tree_mask
        rel = key_pos[None, None, :] - tstart[:, :, None]
        bit = (tmask[:, :, None] >> rel.clamp(0, 63)) & 1
        in_window = torch.where(rel >= 0, bit == 1, in_window)
    visible = (key_pos[None, None, :] <= pos[:, :, None]) & in_window
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if sinks is None:
        # Padded query rows see nothing; keep them finite (their output is dropped).
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    else:
        # exp(s) / (sum exp(s) + exp(sink)): the sink takes probability mass, adds no value.
        sink = sinks.float().view(1, num_kv_heads, group, 1, 1).expand(B, -1, -1, Q, 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1, keepdim=True)
        probs = torch.exp(scores - lse)
    out = torch.einsum("bhgqs,bhsd->bhgqd", probs, vals)
    out = out.permute(0, 3, 1, 2, 4).reshape(B, -1, num_heads, head_dim)
    return out[c.token_req, meta.token_offset].to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_tree = True

    def build(
        self, common: CommonAttentionMetadata, sliding_window: int | None
    ) -> TorchAttentionMetadata:
        qsl = common.query_start_loc.long()
        token_offset = torch.arange(common.num_tokens, device=qsl.device) - qsl[common.token_req]
        if sliding_window is None:
            window_start = torch.zeros_like(common.positions)
        else:
            # A tree node's window is measured from its rotary position (root + depth).
            qpos = common.tree_positions if common.tree_positions is not None else common.positions
            window_start = (qpos - sliding_window + 1).clamp_min(0)
        return TorchAttentionMetadata(common, token_offset, window_start)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        scale: float,
        sliding_window: int | None,
        # [num_heads] float or None: per-head sink logits
        sinks: torch.Tensor | None = None,
        # [2] fp32 (key, value scales): only with an fp8 cache
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        reshape_and_cache_ref(k, v, kv_cache, meta.common.slot_mapping, kv_scales)
        return paged_attention_ref(q, kv_cache, meta, scale, sinks, kv_scales)

    def advance_decode_(self, meta: TorchAttentionMetadata, block_size: int) -> None:
        raise NotImplementedError("torch reference backend rebuilds metadata each step")
