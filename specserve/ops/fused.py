"""Dispatch of the fused ops: Triton kernels on CUDA (no autograd), torch references otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and not torch.is_grad_enabled()


# ---- references -------------------------------------------------------------------------------
def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # NOTE: with a residual, add first (in the model dtype) and return (normed, new residual)
    # as vLLM does; matches HF's arithmetic order.
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def rope_ref(
    positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Neox (rotate-half) rotary embedding of x [tokens, heads, head_dim]; cos/sin [pos, dim]."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * c + rotated * s).to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- dispatch ---------------------------------------------------------------------------------
def rms_norm(
    # [tokens, hidden]
    x: torch.Tensor,
    # [hidden]
    weight: torch.Tensor,
    eps: float,
    # [tokens, hidden] or None
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if _use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        from specserve.ops.triton_kernels import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def rope_(
    # [tokens]
    positions: torch.Tensor,
    # [tokens, q_heads, head_dim] (may be a strided view into the fused qkv output)
    q: torch.Tensor,
    # [tokens, kv_heads, head_dim]
    k: torch.Tensor,
    # [max_position, head_dim] fp32 as cat(cos, cos) / cat(sin, sin)
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k; in place on CUDA, returns the rotated (q, k)."""
    if _use_triton(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        from specserve.ops.triton_kernels import rope_triton_

        rope_triton_(positions, q, k, cos, sin)
        return q, k
    return rope_ref(positions, q, cos, sin), rope_ref(positions, k, cos, sin)


def qk_norm_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_eps: float,
    k_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (Qwen3's q_norm / k_norm): rms_norm_ref over head_dim."""
    return rms_norm_ref(q, q_weight, q_eps)[0], rms_norm_ref(k, k_weight, k_eps)[0]


def qk_norm_(
    # [tokens, q_heads, head_dim] (may be a strided view into the fused qkv output)
    q: torch.Tensor,
    # [tokens, kv_heads, head_dim]
    k: torch.Tensor,
    # [head_dim]
    q_weight: torch.Tensor,
    # [head_dim]
    k_weight: torch.Tensor,
    q_eps: float,
    k_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k; in place on CUDA (one launch for both), returns the normed
    (q, k). NOTE: rms_norm's kernel takes 2-D rows only; q and k views of the fused qkv output
    cannot be flattened to 2-D, and the torch fallback costs ~8 launches a norm."""
    if _use_triton(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        from specserve.ops.triton_kernels import qk_norm_triton_

        qk_norm_triton_(q, k, q_weight, k_weight, q_eps, k_eps)
        return q, k
    return qk_norm_ref(q, k, q_weight, k_weight, q_eps, k_eps)


def silu_and_mul(
    # [tokens, 2 * inter]
    x: torch.Tensor,
) -> torch.Tensor:
    if _use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        from specserve.ops.triton_kernels import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def argmax(
    # [rows, V] float
    x: torch.Tensor,
) -> torch.Tensor:
    """[rows] int64 index of each row's max, the first one on ties (as torch.argmax). On CUDA
    over a large vocabulary: a two-launch Triton reduction over 8192-wide chunks (torch's
    single-row reduction took 28 us of a batch-1 decode step on an H100)."""
    if _use_triton(x) and x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] >= 16384:
        from specserve.ops.triton_kernels import argmax_triton

        return argmax_triton(x)
    return x.argmax(dim=-1)
