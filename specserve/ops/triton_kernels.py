"""Triton kernels behind specserve.ops (CUDA only; references in fused.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.ops import pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    res_out_ptr,
    w_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0)
        # The sum is rounded to the model dtype first, as the reference's `x + residual`.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    T, N = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if T == 0:
        return out, res_out
    res = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    block = triton.next_power_of_2(N)
    _rms_norm_kernel[(T,)](
        x,
        res,
        out,
        ro,
        weight,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        ro.stride(0),
        N,
        eps,
        HAS_RES=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
        **pdl.launch_kwargs(x.device),
    )
    return out, res_out


@triton.jit
def _head_norm_rows(
    base_ptr,
    w_ptr,
    stride_h,
    num_heads,
    d,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """RMSNorm of each of `num_heads` rows of HEAD_DIM at base_ptr, in place."""
    h = tl.arange(0, BLOCK_H)
    dm = d < HEAD_DIM
    m = (h < num_heads)[:, None] & dm[None, :]
    p = base_ptr + h[:, None] * stride_h + d[None, :]
    xf = tl.load(p, mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)
    # Rounded to the model dtype before the weight, as rms_norm_ref.
    y = (xf * inv[:, None]).to(base_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(p, (w[None, :] * y).to(base_ptr.dtype.element_ty), mask=m)


@triton.jit
def _qk_norm_kernel(
    q_ptr,
    k_ptr,
    q_w_ptr,
    k_w_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    num_q_heads,
    num_k_heads,
    q_eps,
    k_eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program a token: every q head and every k head normalized in place (Qwen3's
    # q_norm / k_norm), one launch instead of a torch chain per norm.
    pdl.start(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    _head_norm_rows(
        q_ptr + t * stride_qt, q_w_ptr, stride_qh, num_q_heads, d, q_eps, HEAD_DIM, BLOCK_HQ
    )
    _head_norm_rows(
        k_ptr + t * stride_kt, k_w_ptr, stride_kh, num_k_heads, d, k_eps, HEAD_DIM, BLOCK_HK
    )


def qk_norm_triton_(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_eps: float,
    k_eps: float,
) -> None:
    T, hq, dim = q.shape
    if T == 0:
        return
    _qk_norm_kernel[(T,)](
        q,
        k,
        q_weight,
        k_weight,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        hq,
        k.shape[1],
        q_eps,
        k_eps,
        HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
        **pdl.launch_kwargs(q.device),
    )


@triton.jit
def _rope_rows(
    base_ptr,
    stride_h,
    num_heads,
    c,
    s,
    d,
    dm,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    m = (h < num_heads)[:, None] & dm[None, :]
    p = base_ptr + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(p, (x1 * c - x2 * s).to(base_ptr.dtype.element_ty), mask=m)
    tl.store(p + HALF, (x2 * c + x1 * s).to(base_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    # cos/sin rows are cat(c, c): the first half holds every frequency once.
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=dm, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + d, mask=dm, other=0.0)[None, :]
    _rope_rows(q_ptr + t * stride_qt, stride_qh, num_q_heads, c, s, d, dm, HALF, BLOCK_HQ)
    _rope_rows(k_ptr + t * stride_kt, stride_kh, num_k_heads, c, s, d, dm, HALF, BLOCK_HK)


def rope_triton_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    T, hq, dim = q.shape
    if T == 0:
        return
    half = dim // 2
    _rope_kernel[(T,)](
        positions,
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        hq,
        k.shape[1],
        HALF=half,
        BLOCK_D=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
        **pdl.launch_kwargs(q.device),
    )


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + N + cols, mask=m, other=0.0).to(tl.float32)
    # Rounded to the model dtype between the two ops, as the reference's silu(gate) * up.
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    T, two_n = x.shape
    n = two_n // 2
    out = torch.empty(T, n, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    block = 1024
    _silu_and_mul_kernel[(T, triton.cdiv(n, block))](
        x,
        out,
        x.stride(0),
        out.stride(0),
        n,
        BLOCK=block,
        num_warps=4,
        **pdl.launch_kwargs(x.device),
    )
    return out


@triton.jit
def _argmax_chunks_kernel(
    x_ptr, val_ptr, idx_ptr, stride_x, V, CHUNKS, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """Row r, chunk c: the max of x[r, c*BLOCK : (c+1)*BLOCK] and its first index (NaN counts
    as +inf: a NaN row still yields a valid index)."""
    pdl.start(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    m = tl.max(x, axis=0)
    first = tl.min(tl.where(x == m, cols, V), axis=0)
    tl.store(val_ptr + r * CHUNKS + c, m)
    tl.store(idx_ptr + r * CHUNKS + c, first)


@triton.jit
def _argmax_merge_kernel(
    val_ptr, idx_ptr, out_ptr, CHUNKS, BLOCK_C: tl.constexpr, PDL: tl.constexpr
):
    """Row r: the chunk holding the row's max first (chunks are in column order), its index."""
    pdl.start(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < CHUNKS
    v = tl.load(val_ptr + r * CHUNKS + c, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + r * CHUNKS + c, mask=ok, other=2147483647)
    m = tl.max(v, axis=0)
    tl.store(out_ptr + r, tl.min(tl.where(v == m, i, 2147483647), axis=0).to(tl.int64))


def argmax_triton(x: torch.Tensor, block: int = 8192) -> torch.Tensor:
    """[rows] int64 = x.argmax(-1) for x [rows, V] (V < 2**31), in two launches."""
    rows, V = x.shape
    chunks = triton.cdiv(V, block)
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    kw = pdl.launch_kwargs(x.device)
    _argmax_chunks_kernel[(rows, chunks)](
        x, vals, idx, x.stride(0), V, chunks, BLOCK=block, num_warps=8, **kw
    )
    _argmax_merge_kernel[(rows,)](
        vals, idx, out, chunks, BLOCK_C=triton.next_power_of_2(chunks), **kw
    )
    return out
