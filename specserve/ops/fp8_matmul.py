"""Block-scaled fp8 weights times 16/32-bit activations (W8A16): y = x @ (W * scale)^T + bias.

DeepSeek-V3's format (models/fp8.py): W [N, K] float8_e4m3fn, scale [ceil(N / bn), ceil(K / bk)]
float32, the real weight W[n, k] * scale[n // bn, k // bk]. The weight stays 8-bit in memory:
the kernel loads an fp8 tile, multiplies it by its block scale in registers, casts it to the
activations' dtype and feeds tl.dot. Activations are not quantized.

  `_fp8_block_matmul_kernel`  program (row block, column block): the K loop in steps of
                              BLOCK_K, a divisor of bk, so a step never straddles two scale
                              columns; the scale row is indexed per output column (n // bn), so
                              BLOCK_N need not match bn.
  `fp8_block_matmul`          dispatch: Triton on CUDA and on CPU under TRITON_INTERPRET=1
                              (tests), `fp8_block_matmul_ref` elsewhere. Shapes only pick the
                              tile sizes: no host sync, so CUDA graphs capture it.
  `fp8_block_matmul_ref`      dequantize, F.linear in float32, cast to x's dtype.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _fp8_block_matmul_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # Each output column's scale row; the column of the scale moves with k.
    s_row = s_ptr + (offs_n // BN).to(tl.int64) * stride_sn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N] fp8 -> float32 (exact), times its block scale, to x's dtype.
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        s = tl.load(s_row + k0 // BK, mask=n_ok, other=0.0)
        w = (w.to(tl.float32) * s[None, :]).to(x.dtype)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> None:
    (n, k), (bn, bk) = weight.shape, block
    if x.shape[-1] != k:
        raise ValueError(f"fp8_block_matmul: x has {x.shape[-1]} features, the weight {k}")
    if weight.stride(1) != 1 or scale_inv.stride(1) != 1:
        raise ValueError("fp8_block_matmul: weight and scale_inv need contiguous rows")
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"fp8_block_matmul: weight [{n}, {k}] with block [{bn}, {bk}] needs a scale of "
            f"shape {list(want)}, got {list(scale_inv.shape)}"
        )


def fp8_block_matmul_ref(
    # [..., K] bf16 / fp16 / fp32
    x: torch.Tensor,
    # [N, K] float8_e4m3fn
    weight: torch.Tensor,
    # [ceil(N / bn), ceil(K / bk)] float32
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    # [N] or None
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., N] in x's dtype: dequantize, then F.linear in float32."""
    _check(x, weight, scale_inv, block)
    (n, k), (bn, bk) = weight.shape, block
    scale = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    w = weight.float() * scale
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), w, b).to(x.dtype)


def _block_k(bk: int) -> int | None:
    """The K step: the largest power of two <= 128 dividing bk (tl.dot needs >= 16)."""
    step = 128
    while step >= 16 and bk % step:
        step //= 2
    return step if step >= 16 else None


def _tiles(m: int, k_step: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by the row count (host-known in a graph)."""
    if m <= 16:  # decode / verification: many column blocks keep the SMs busy
        return 16, 64, k_step, 4
    if m <= 64:
        return 64, 64, min(k_step, 64), 4
    return 128, 128, min(k_step, 64), 8


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (tests)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1" and not torch.is_grad_enabled()
    return x.is_cuda or (interpret and x.device.type == "cpu")


def fp8_block_matmul(
    # [..., K] bf16 / fp16 / fp32
    x: torch.Tensor,
    # [N, K] float8_e4m3fn
    weight: torch.Tensor,
    # [ceil(N / bn), ceil(K / bk)] float32
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    # [N] or None
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., N] in x's dtype, the weight read 8-bit (`_fp8_block_matmul_kernel`); the
    reference where Triton does not run or bk has no power-of-two divisor >= 16."""
    k_step = _block_k(block[1])
    if not use_triton(x) or k_step is None:
        return fp8_block_matmul_ref(x, weight, scale_inv, block, bias)
    _check(x, weight, scale_inv, block)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    bm, bn_tile, bk_tile, warps = _tiles(m, k_step)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn_tile))
    _fp8_block_matmul_kernel[grid](
        x2, weight, scale_inv, bias if bias is not None else y, y,
        m, n, k,
        x2.stride(0), weight.stride(0), scale_inv.stride(0), y.stride(0),
        BN=block[0], BK=block[1], HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn_tile, BLOCK_K=bk_tile, num_warps=warps,
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)
