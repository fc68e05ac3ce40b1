"""MLA for decode and verification batches in three Triton kernels (reference: attention/mla.py
`mla_prologue_ref` + `mla_attention_ref` + the W_UV bmm).

At batch 1 the glue around MLA attention was most of the layer's launches: two cats
de-interleaving q_pe / k_pe, the RoPE kernel, the latent RMSNorm, the cat and index_put of the
latent KV write, and two cuBLAS bmm's (W_UK, W_UV) of ~4 us each. Here:

1. `_mla_prologue_kernel`, grid = (num_heads * L_BLOCKS + 1,): program (h, l-block) reads its
   W_UK[h] tile [nope, BLOCK_L] once and absorbs every token's q_nope[t, h] through it
   (q_latent); the l-block 0 program of each head also de-interleaves and rotates q_pe[t, h].
   The last program RMS-normalizes each token's latent, rotates its k_pe and writes the cache
   row (padding slots -1 write nothing).
2. `_mla_attention_kernel` (mla_triton.py), split-KV, partial states to a workspace.
3. `_mla_merge_kernel` (mla_merge.py): merges the splits and applies W_UV: [T, H, v], ready
   for o_proj.

Each program loops over the batch's tokens with its weight tile in registers, so weights are
read once a step; that loop is why only small batches (`tunables().mla_fuse_max_tokens`) take
this path: prefill keeps the torch glue and cuBLAS bmm's.

An fp8 latent cache (KV_FP8, attention/kv_quant.py): the prologue quantizes the rows it writes
with the layer's latent scale as `write_latent` does (the same bits), q_latent and q_pe stay in
q's dtype, and the attention kernel dequantizes its key tiles. The scale must be known before
the step: calculate_kv_scales (which computes it from the step's own rows) runs the torch
prologue instead (`attention.mla.mla_forward`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.backend import CommonAttentionMetadata
from specserve.attention.kv_quant import check_kv_scales, compute_dtype, kv_quant_args
from specserve.attention.kv_write import fp8_quantize
from specserve.attention.mla import MLAWeights, mla_prologue_ref
from specserve.ops import graph_rows, l2, pdl
from specserve.tunables import tunables

__all__ = ["fusable", "mla_forward_fused", "mla_prologue", "mla_prologue_ref"]


@triton.jit
def _rope_row(
    src_ptr, pos, cos_ptr, sin_ptr, stride_cos, R: tl.constexpr, INTERLEAVE: tl.constexpr
):
    """[R] fp32 rotate-half RoPE of the vector at src_ptr (position pos), de-interleaving its
    (x0, x1), (x2, x3) ... pairs first with INTERLEAVE, as ops.fused.rope_ref computes it."""
    d = tl.arange(0, R)
    partner = (d + R // 2) % R
    if INTERLEAVE:  # de-interleaved channel j holds raw channel 2 (j mod R/2) + (j >= R/2)
        src = 2 * (d % (R // 2)) + d // (R // 2)
        src_p = 2 * (partner % (R // 2)) + partner // (R // 2)
    else:
        src, src_p = d, partner
    x = tl.load(src_ptr + src).to(tl.float32)
    xp = tl.load(src_ptr + src_p).to(tl.float32)
    trig = pos.to(tl.int64) * stride_cos + d
    c = tl.load(cos_ptr + trig)
    s = tl.load(sin_ptr + trig)
    return tl.where(d < R // 2, x * c - xp * s, x * c + xp * s)


@triton.jit
def _absorb_store(w, q_row, k, km, dst_ptr, cm):
    """dst[col] = q_nope . W_UK[h][:, col] for one token (w [BLOCK_NOPE, BLOCK_L], the q_nope
    channels k of q_row): fp32 sums rounded once, as the bmm it replaces."""
    qn = tl.load(q_row + k, mask=km, other=0.0).to(tl.float32)
    ql = tl.sum(w.to(tl.float32) * qn[:, None], axis=0)
    tl.store(dst_ptr, ql.to(dst_ptr.dtype.element_ty), mask=cm)


@triton.jit(
    do_not_specialize=["num_tokens"],
    do_not_specialize_on_alignment=["positions_ptr", "slot_mapping_ptr"],  # per-step views
)
def _mla_prologue_kernel(
    q_ptr,
    kv_a_ptr,
    w_uk_ptr,
    norm_w_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    slot_mapping_ptr,
    q_lat_ptr,
    q_pe_ptr,
    kv_ptr,
    num_tokens,
    num_heads,
    eps,
    stride_qt,
    stride_qh,
    stride_kvat,
    stride_wh,
    stride_wn,
    stride_cos,
    stride_kvb,
    stride_kvs,
    NOPE: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_LALL: tl.constexpr,
    L_BLOCKS: tl.constexpr,
    PAGE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    PDL: tl.constexpr,
    kv_scale_ptr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    W_EVICT: tl.constexpr = "",  # ops/l2.py's policy for the W_UK tile
):
    # KV_FP8: the latent rows are written as row / scale in fp8 (kv_write.fp8_quantize);
    # q_latent and q_pe are stored in their buffers' dtype (q's then, the cache's otherwise).
    pid = tl.program_id(0)
    out_ty = kv_ptr.dtype.element_ty
    if pid < num_heads * L_BLOCKS:
        h = pid // L_BLOCKS
        lb = pid % L_BLOCKS
        k = tl.arange(0, BLOCK_NOPE)
        km = k < NOPE
        col = lb * BLOCK_L + tl.arange(0, BLOCK_L)
        cm = col < L
        # Weights never depend on the previous kernel: request the tile before waiting.
        w = tl.load(
            w_uk_ptr + h * stride_wh + k[:, None] * stride_wn + col[None, :],
            mask=km[:, None] & cm[None, :],
            other=0.0,
            eviction_policy=W_EVICT,
        )
        pdl.trigger(PDL)
        pdl.wait(PDL)
        d = tl.arange(0, R)
        for t in range(num_tokens):
            q_row = q_ptr + t * stride_qt + h * stride_qh
            dst = t * num_heads + h
            if lb == 0:
                # q_pe's loads (position, then its rows, cos and sin) issued with q_nope's, not
                # after q_latent's store: the compiler keeps loads behind a store that may
                # alias them, and these programs are the prologue's longest chain (GLM-4.7-Flash
                # batch 1, H100: 3473 -> 3456 us a step, benchmarks/RESULTS.md).
                pos = tl.load(positions_ptr + t)
                rot = _rope_row(q_row + NOPE, pos, cos_ptr, sin_ptr, stride_cos, R, INTERLEAVE)
                _absorb_store(w, q_row, k, km, q_lat_ptr + dst * L + col, cm)
                # Rounded to q's dtype as the RoPE kernel rounds, then to q_pe's (the cache's or,
                # for an fp8 cache, q's).
                q_pe_ty = q_pe_ptr.dtype.element_ty
                tl.store(q_pe_ptr + dst * R + d, rot.to(q_ptr.dtype.element_ty).to(q_pe_ty))
            else:
                _absorb_store(w, q_row, k, km, q_lat_ptr + dst * L + col, cm)
    else:
        pdl.trigger(PDL)
        pdl.wait(PDL)
        dl = tl.arange(0, BLOCK_LALL)
        lm = dl < L
        d = tl.arange(0, R)
        g = tl.load(norm_w_ptr + dl, mask=lm, other=0.0)
        if KV_FP8:
            kv_scale = tl.load(kv_scale_ptr)
        for t in range(num_tokens):
            row = kv_a_ptr + t * stride_kvat
            x = tl.load(row + dl, mask=lm, other=0.0)
            xf = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / L + eps)
            # ops.rms_norm's rounding: normalize in fp32, round, times the weight, round.
            normed = (xf * rstd).to(x.dtype)
            lat = (normed.to(tl.float32) * g.to(tl.float32)).to(g.dtype)
            pos = tl.load(positions_ptr + t)
            k_pe = _rope_row(row + L, pos, cos_ptr, sin_ptr, stride_cos, R, INTERLEAVE)
            k_pe = k_pe.to(x.dtype)
            if KV_FP8:  # the rounded row, divided by the scale, as kv_quant.quantize_kv_ref
                lat = fp8_quantize(lat, kv_scale, FP8_MAX, FP8_MANT, FP8_MIN_EXP)
                k_pe = fp8_quantize(k_pe, kv_scale, FP8_MAX, FP8_MANT, FP8_MIN_EXP)
            slot = tl.load(slot_mapping_ptr + t)
            dst = kv_ptr + (slot // PAGE).to(tl.int64) * stride_kvb + (slot % PAGE) * stride_kvs
            tl.store(dst + dl, lat.to(out_ty), mask=lm & (slot >= 0))
            tl.store(dst + L + d, k_pe.to(out_ty), mask=(d < R) & (slot >= 0))


def mla_prologue(
    # [num_tokens]
    positions: torch.Tensor,
    # [num_tokens, H, nope + R]
    q: torch.Tensor,
    # [num_tokens, L + R]
    kv_a: torch.Tensor,
    w: MLAWeights,
    # [num_blocks, block_size, L + R]
    kv_cache: torch.Tensor,
    # [num_tokens] int64, -1 = padding
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_latent [T, H, L], rotated q_pe [T, H, R]) in kv_cache's dtype (q's for an fp8 cache),
    this step's latent rows written: `mla_prologue_ref` in one launch."""
    T, H, _ = q.shape
    L, R = w.w_uk.shape[2], q.shape[2] - w.nope
    check_kv_scales(kv_cache.dtype, w.latent_scale)
    cdt = compute_dtype(kv_cache.dtype, q.dtype)
    q_lat = torch.empty(T, H, L, dtype=cdt, device=q.device)
    q_pe = torch.empty(T, H, R, dtype=cdt, device=q.device)
    if T == 0:
        return q_lat, q_pe
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv_a = kv_a if kv_a.stride(-1) == 1 else kv_a.contiguous()
    w_uk = w.w_uk if w.w_uk.stride(-1) == 1 else w.w_uk.contiguous()
    block_l = 64
    l_blocks = triton.cdiv(L, block_l)
    _mla_prologue_kernel[(H * l_blocks + 1,)](
        q, kv_a, w_uk, w.kv_norm_weight, w.cos, w.sin, positions, slot_mapping,
        q_lat, q_pe, kv_cache, T, H, w.kv_norm_eps,
        q.stride(0), q.stride(1), kv_a.stride(0), w_uk.stride(0), w_uk.stride(1),
        w.cos.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        NOPE=w.nope, L=L, R=R,
        BLOCK_NOPE=triton.next_power_of_2(w.nope),
        BLOCK_L=block_l,
        BLOCK_LALL=triton.next_power_of_2(L),
        L_BLOCKS=l_blocks,
        PAGE=kv_cache.shape[1],
        INTERLEAVE=w.rope_interleave,
        W_EVICT=l2.weight_eviction(),
        num_warps=8,
        **pdl.launch_kwargs(q.device),
        kv_scale_ptr=w.latent_scale if w.latent_scale is not None else q,
        **kv_quant_args(kv_cache.dtype),
    )  # fmt: skip
    return q_lat, q_pe


def fusable(
    # [num_tokens, H, nope + R]
    q: torch.Tensor,
    w: MLAWeights,
    c: CommonAttentionMetadata,
) -> bool:
    """Whether `mla_forward_fused` takes this batch: few tokens, a power-of-two rotary dim (the
    RoPE row is one tl.arange), W_UK / W_UV rows contiguous. "Few" is judged on
    `graph_rows.row_bound` of the token count (the rows of the padded graph a uniform batch
    replays), never the count itself: a captured graph's padded batch and the eager step it
    stands for must take the same path (the two paths round differently, so the graph's tokens
    would differ from eager decoding's)."""
    R = q.shape[2] - w.nope
    return (
        graph_rows.row_bound(c.num_tokens) <= tunables().mla_fuse_max_tokens
        and R >= 2
        and R & (R - 1) == 0
        and w.w_uk.stride(-1) == 1
        and w.w_uv.stride(-1) == 1
    )


def mla_forward_fused(
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
    split_len: int | None,
) -> torch.Tensor:
    """`attention.mla.mla_forward` for small batches: [num_tokens, H, v] in kv_cache's dtype
    (q's for an fp8 cache). The latent scale (fp8) is the layer's given one: with
    calc_kv_scale, `mla_forward` takes the torch prologue, which computes it first."""
    from specserve.attention.mla_triton import mla_attention

    q_lat, q_pe = mla_prologue(positions, q, kv_a, w, kv_cache, c.slot_mapping)
    return mla_attention(
        q_lat, q_pe, kv_cache, c, w.scale, split_len=split_len, w_uv=w.w_uv,
        kv_scale=w.latent_scale,
    )  # fmt: skip
