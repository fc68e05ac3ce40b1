"""The paged KV write: each token's key and value to its slot of the cache (torch reference:
`torch_ref.reshape_and_cache_ref`, also the CPU backend's write)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.torch_ref import reshape_and_cache_ref
from specserve.ops import pdl

__all__ = ["reshape_and_cache", "reshape_and_cache_ref"]


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
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
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
    )
