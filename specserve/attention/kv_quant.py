"""The fp8 KV cache's arithmetic (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2), in torch.

A layer's keys and values are stored as `value / scale`, clamped to the format's finite range
and rounded to nearest even (`quantize_kv_ref`); readers multiply the fp8 value back by the
scale (`dequantize_kv_ref`). Each layer holds one key and one value scale ([2] fp32,
`KVCacheLayer.kv_scales`; an MLA layer's latent row uses the key scale): the checkpoint's
`k_scale` / `v_scale` (or the older `kv_scale`), 1.0 without them, or computed from the first
prefill with calculate_kv_scales (`compute_kv_scales_`).

The Triton kernels quantize where they write the cache (kv_write.py, rope_kv_write.py, the
attention kernel's fused write, MLA's prologue) with the same arithmetic, so a cache written
by a kernel holds the torch reference's bits, and dequantize in their key loops. Plain torch:
the CPU backend imports this module without Triton.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT: calculate_kv_scales sets scale = amax / these,
# so the first prefill's largest key lands at 200 (of e4m3's 448) and value at 100, leaving
# headroom for later tokens that exceed it.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES


def check_kv_scales(cache_dtype: torch.dtype, kv_scales: torch.Tensor | None) -> None:
    """An fp8 cache is written and read only with its layer's scales."""
    if is_fp8(cache_dtype) and kv_scales is None:
        raise ValueError("an fp8 KV cache needs its layer's kv_scales")


def quantize_kv_ref(
    # [...] any float dtype
    x: torch.Tensor,
    # [] fp32
    scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """x / scale in fp32, clamped to the fp8 format's finite range, rounded to nearest even."""
    m = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-m, m).to(dtype)


def dequantize_kv_ref(
    # [...] fp8
    x: torch.Tensor,
    # [] fp32
    scale: torch.Tensor,
) -> torch.Tensor:
    """The fp32 values an fp8 cache entry stands for."""
    return x.float() * scale


def store_kv(
    # [...] the cache's dtype
    dst: torch.Tensor,
    # [...] the model's dtype
    x: torch.Tensor,
    # [] fp32 or None (not an fp8 cache)
    scale: torch.Tensor | None,
) -> torch.Tensor:
    """x as `dst`'s dtype stores it: quantized for an fp8 cache, cast otherwise."""
    check_kv_scales(dst.dtype, scale)
    if is_fp8(dst.dtype):
        return quantize_kv_ref(x, scale, dst.dtype)
    return x.to(dst.dtype)


def compute_kv_scales_(
    # [2] fp32: (key scale, value scale), set in place
    kv_scales: torch.Tensor,
    # [num_tokens, ...]
    k: torch.Tensor,
    # [num_tokens, ...] or None (MLA: one latent row, the key scale only)
    v: torch.Tensor | None,
) -> None:
    """calculate_kv_scales: the scales from this forward's keys and values, as vLLM's
    Attention.calc_kv_scales (amax / K_SCALE_CONSTANT, amax / V_SCALE_CONSTANT). A layer whose
    keys are all zero keeps a tiny positive scale, never 0 (the write divides by it)."""
    tiny = torch.finfo(torch.float32).tiny
    kv_scales[0] = (k.float().abs().amax() / K_SCALE_CONSTANT).clamp_min(tiny)
    if v is not None:
        kv_scales[1] = (v.float().abs().amax() / V_SCALE_CONSTANT).clamp_min(tiny)


def kv_quant_args(dtype: torch.dtype) -> dict[str, object]:
    """The Triton kernels' fp8 constexprs for a cache of `dtype`: KV_FP8 (quantize on write,
    dequantize on read), FP8_MAX (the finite range), FP8_MANT (mantissa bits) and FP8_MIN_EXP
    (the smallest normal exponent): what `kv_write._fp8_quantize` rounds with."""
    if not is_fp8(dtype):
        return dict(KV_FP8=False, FP8_MAX=0.0, FP8_MANT=0, FP8_MIN_EXP=0)
    mant = 3 if dtype == torch.float8_e4m3fn else 2
    min_exp = -6 if dtype == torch.float8_e4m3fn else -14
    return dict(KV_FP8=True, FP8_MAX=torch.finfo(dtype).max, FP8_MANT=mant, FP8_MIN_EXP=min_exp)


def compute_dtype(kv_dtype: torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention computes in: the cache's, or the model's for an fp8 cache."""
    return model_dtype if is_fp8(kv_dtype) else kv_dtype
