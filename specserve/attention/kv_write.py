"""The paged KV write: each token's key and value to its slot of the cache (torch reference:
`torch_ref.reshape_and_cache_ref`, also the CPU backend's write). An fp8 cache stores them
quantized (`fp8_quantize`, the arithmetic of kv_quant.quantize_kv_ref). The attention kernels
read it back by a cast alone, with the scales folded into their score scale and output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.kv_quant import check_kv_scales, kv_quant_args
from specserve.attention.torch_ref import reshape_and_cache_ref
from specserve.ops import pdl

__all__ = ["reshape_and_cache", "reshape_and_cache_ref"]


@triton.jit
def fp8_quantize(
    x, scale, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr
):
    """x / scale in fp32, clamped to +-FP8_MAX and rounded to nearest even onto the fp8 grid
    (FP8_MANT mantissa bits, normals from 2^FP8_MIN_EXP): an fp32 tensor the cast to the fp8
    type then takes exactly. NOTE: rounded here, not by the cast, because the Triton
    interpreter's fp32 -> fp8 cast truncates (and drops the carry of a rounded-up mantissa), so
    the CPU tests would not see the GPU's bits; the GPU's cast of these exact values is the same."""
    y = x.to(tl.float32) / scale
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    # Normals: round the fp32 mantissa to FP8_MANT bits (ties to even) on the bit pattern;
    # a carry into the exponent is the right result.
    DROP: tl.constexpr = 23 - FP8_MANT
    b = y.to(tl.int32, bitcast=True)
    b = b + ((1 << (DROP - 1)) - 1) + ((b >> DROP) & 1)
    normal = (b & ~((1 << DROP) - 1)).to(tl.float32, bitcast=True)
    # Subnormals: a fixed step 2^(FP8_MIN_EXP - FP8_MANT); fp32 addition of 1.5 * 2^23 rounds
    # |y| / step to an integer, ties to even; the sign goes back on after (-0 stays -0).
    STEP: tl.constexpr = 2.0 ** (FP8_MIN_EXP - FP8_MANT)
    MAGIC: tl.constexpr = 12582912.0
    a = tl.abs(y)
    sub = ((a * (1.0 / STEP) + MAGIC) - MAGIC) * STEP
    # NOTE: the sign by its bit: Triton's negation is 0 - x, which turns -0 into +0.
    sub = (sub.to(tl.int32, bitcast=True) | (y.to(tl.int32, bitcast=True) & -(1 << 31))).to(
        tl.float32, bitcast=True
    )
    return tl.where(a < 2.0**FP8_MIN_EXP, sub, normal)


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])  # per-step views
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
    kv_scales_ptr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
):
    pdl.start(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    # NOTE: padding tokens (slot -1) write nothing, so the null block stays untouched.
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < num_kv_heads)[:, None]
    src_k = t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :]
    src_v = t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dst = dst + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + src_k, mask=mask)
    v = tl.load(v_ptr + src_v, mask=mask)
    if KV_FP8:
        k = fp8_quantize(k, tl.load(kv_scales_ptr), FP8_MAX, FP8_MANT, FP8_MIN_EXP)
        v = fp8_quantize(v, tl.load(kv_scales_ptr + 1), FP8_MAX, FP8_MANT, FP8_MIN_EXP)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    # [num_tokens, num_kv_heads, head_dim]
    k: torch.Tensor,
    # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,
    # [num_tokens] int64, -1 = padding (skipped)
    slot_mapping: torch.Tensor,
    # [2] fp32 (key, value scales): an fp8 cache's, else None
    kv_scales: torch.Tensor | None = None,
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    check_kv_scales(kv_cache.dtype, kv_scales)
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        **pdl.launch_kwargs(k.device),
        kv_scales_ptr=kv_scales if kv_scales is not None else k,
        **kv_quant_args(kv_cache.dtype),
    )
