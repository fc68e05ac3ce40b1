"""RoPE (and Qwen3's per-head qk-norm) with the paged KV write.

`rope_and_cache_` rotates q in place and writes the rotated keys and the values in one launch
(torch reference: `rope_and_cache_ref`, ops.rope_ then the KV write). The `_rope_tile` helpers
below do the same arithmetic on [rows, head_dim] tiles inside the attention kernel, which takes
this step's RoPE, qk-norm and KV write itself for decode and verification batches
(paged_attention.py, `new_kv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.kv_quant import check_kv_scales, kv_quant_args
from specserve.attention.kv_write import fp8_quantize
from specserve.attention.torch_ref import reshape_and_cache_ref
from specserve.ops import pdl
from specserve.ops.fused import rope_ref
from specserve.ops.triton_kernels import _rope_rows


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_mapping_ptr"])  # per-step views
def _rope_and_cache_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_q_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    PDL: tl.constexpr,
    kv_scales_ptr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
):
    """One token: rotate q in place, write rotated k and v to the cache. The arithmetic and
    roundings of the RoPE kernel followed by _reshape_and_cache_kernel (fp32, rounded to k's
    dtype, then to the cache's), so the cache holds the same bits. Position, slot and cos/sin
    are metadata: loaded before the wait for the previous kernel (ops/pdl.py)."""
    pdl.trigger(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=dm, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + d, mask=dm, other=0.0)[None, :]
    slot = tl.load(slot_mapping_ptr + t)
    pdl.wait(PDL)
    # q of padding tokens too: whoever reads their outputs expects the unfused behaviour.
    _rope_rows(q_ptr + t * stride_qt, stride_qh, num_q_heads, c, s, d, dm, HALF, BLOCK_HQ)
    if slot >= 0:  # padding tokens write nothing
        h = tl.arange(0, BLOCK_HK)
        hm = (h < num_kv_heads)[:, None]
        m = hm & dm[None, :]
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        dst = dst + h[:, None] * stride_ch
        src = k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :]
        k1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        k2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        r1 = (k1 * c - k2 * s).to(k_ptr.dtype.element_ty)
        r2 = (k2 * c + k1 * s).to(k_ptr.dtype.element_ty)
        dv = tl.arange(0, HEAD_DIM)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + dv[None, :], mask=hm)
        if KV_FP8:  # the rounded k, divided by the scale, as kv_quant.quantize_kv_ref
            k_scale = tl.load(kv_scales_ptr)
            v_scale = tl.load(kv_scales_ptr + 1)
            r1 = fp8_quantize(r1, k_scale, FP8_MAX, FP8_MANT, FP8_MIN_EXP)
            r2 = fp8_quantize(r2, k_scale, FP8_MAX, FP8_MANT, FP8_MIN_EXP)
            v = fp8_quantize(v, v_scale, FP8_MAX, FP8_MANT, FP8_MIN_EXP)
        tl.store(k_cache_ptr + dst + d[None, :], r1.to(k_cache_ptr.dtype.element_ty), mask=m)
        tl.store(k_cache_ptr + dst + HALF + d[None, :], r2.to(k_cache_ptr.dtype.element_ty), mask=m)
        tl.store(v_cache_ptr + dst + dv[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=hm)


def rope_and_cache_(
    # [num_tokens]
    positions: torch.Tensor,
    # [num_tokens, num_heads, head_dim], last dim contiguous: rotated in place
    q: torch.Tensor,
    # [num_tokens, num_kv_heads, head_dim], last dim contiguous: read, not modified
    k: torch.Tensor,
    # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    # [max_position, head_dim] fp32 as cat(cos, cos) / cat(sin, sin)
    cos: torch.Tensor,
    sin: torch.Tensor,
    # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,
    # [num_tokens] int64, -1 = padding (no write)
    slot_mapping: torch.Tensor,
    # [2] fp32 (key, value scales): an fp8 cache's, else None
    kv_scales: torch.Tensor | None = None,
) -> None:
    """ops.rope_ then reshape_and_cache in one launch (reference: `rope_and_cache_ref`)."""
    num_tokens, num_heads, head_dim = q.shape
    check_kv_scales(kv_cache.dtype, kv_scales)
    if num_tokens == 0:
        return
    v = v if v.stride(-1) == 1 else v.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    half = head_dim // 2
    _rope_and_cache_kernel[(num_tokens,)](
        positions,
        q,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        num_heads,
        k.shape[1],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_D=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
        **pdl.launch_kwargs(q.device),
        kv_scales_ptr=kv_scales if kv_scales is not None else q,
        **kv_quant_args(kv_cache.dtype),
    )


def rope_and_cache_ref(
    # [num_tokens]
    positions: torch.Tensor,
    # [num_tokens, num_heads, head_dim]: rotated in place
    q: torch.Tensor,
    # [num_tokens, num_kv_heads, head_dim]
    k: torch.Tensor,
    v: torch.Tensor,
    # [max_position, head_dim] fp32 as cat(cos, cos) / cat(sin, sin)
    cos: torch.Tensor,
    sin: torch.Tensor,
    # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,
    # [num_tokens] int64, -1 = padding (no write)
    slot_mapping: torch.Tensor,
    # [2] fp32 (key, value scales): an fp8 cache's, else None
    kv_scales: torch.Tensor | None = None,
) -> None:
    """`rope_and_cache_` in torch: q rotated in place, rotated k and v written (padding not)."""
    keep = slot_mapping >= 0
    q.copy_(rope_ref(positions, q, cos, sin))
    k_rot = rope_ref(positions, k, cos, sin)
    reshape_and_cache_ref(k_rot[keep], v[keep], kv_cache, slot_mapping[keep], kv_scales)


# ---- the same work on tiles inside the attention kernel -----------------------------------------
@triton.jit
def _rope_trig(pos, row_ok, cos_ptr, sin_ptr, stride_cos, HEAD_DIM: tl.constexpr):
    """(cos, sin) [rows, HEAD_DIM] fp32 table rows of positions pos [rows] (0 where not
    row_ok)."""
    d = tl.arange(0, HEAD_DIM)
    trig = pos.to(tl.int64)[:, None] * stride_cos + d[None, :]
    ok = row_ok[:, None]
    return tl.load(cos_ptr + trig, mask=ok, other=0.0), tl.load(sin_ptr + trig, mask=ok, other=0.0)


@triton.jit
def _norm_weights(norm_w_ptr, HEAD_DIM: tl.constexpr):
    """(w, w of each element's rotate-half partner) [1, HEAD_DIM] fp32: a per-head RMSNorm
    weight as `_rope_tile` applies it."""
    d = tl.arange(0, HEAD_DIM)
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    w = tl.load(norm_w_ptr + d).to(tl.float32)[None, :]
    return w, tl.load(norm_w_ptr + partner).to(tl.float32)[None, :]


@triton.jit
def _rope_tile(row_ptr, row_ok, HEAD_DIM: tl.constexpr, eps, NORM: tl.constexpr, c, s, nw):
    """[rows, HEAD_DIM] fp32 rotate-half RoPE of the vectors at row_ptr [rows, 1]: x1 * c - x2 *
    s, x2 * c + x1 * s, as the RoPE kernels compute it; each half's partner is a second load of
    the same row (cos/sin rows are cat(c, c), cat(s, s)). c, s: the rows' `_rope_trig`; nw: the
    norm's `_norm_weights` (both loaded by the caller before its PDL wait).
    NORM: each row RMS-normed over HEAD_DIM first (Qwen3's q_norm / k_norm), rounded as the
    qk-norm kernel rounds (to the row dtype after the scale and after the weight), so the
    rotation sees the values that kernel would have stored."""
    d = tl.arange(0, HEAD_DIM)
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    ok = row_ok[:, None]
    x = tl.load(row_ptr + d[None, :], mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(row_ptr + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORM:
        dt = row_ptr.dtype.element_ty
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w, wp = nw
        x = (w * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        xp = (wp * (xp * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    first_half = (d < HEAD_DIM // 2)[None, :]
    return tl.where(first_half, x * c - xp * s, x * c + xp * s)
