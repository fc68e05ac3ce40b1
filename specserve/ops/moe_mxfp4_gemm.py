"""The grouped-GEMM path of `fused_moe` over MXFP4 experts (prefill and verification batches
of more than moe_mxfp4.MXFP4_DECODE_MAX_PAIRS_PER_EXPERT pairs an expert): ops/moe_triton.py's
aligned grouped GEMM (moe_align, the _moe_sum_kernel top-k sum) with the weight tile read 4-bit
and dequantized in registers to the activations' dtype (ops/moe_mxfp4.py's helpers), fed to
two tl.dot a step (even activation columns x low nibbles, odd x high), so nothing dense is ever
written. Layouts and the decode path: ops/moe_mxfp4.py; `fused_moe_mxfp4_ref` there is what
the tests compare with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.ops import graph_rows
from specserve.ops.moe_mxfp4 import _check_pair, _mxfp4_tile
from specserve.ops.moe_triton import (
    PLAIN,
    Epilogue,
    GemmConfig,
    _gemm_block,
    _gemm_epilogue,
    _moe_sum_kernel,
    moe_align,
)

# Grouped GEMM configs as moe_triton.GEMM_CONFIGS (by mean pairs per expert), with more warps
# where the dequantized tiles (fp32 lo/hi of gate and up before the casts) would spill at 4.
MXFP4_GEMM_CONFIGS: tuple[tuple[float, GemmConfig], ...] = (
    (4.0, (16, 64, 128, 1, 8, 3)),
    (16.0, (16, 128, 64, 1, 4, 3)),
    (48.0, (32, 128, 64, 8, 8, 3)),
    (96.0, (64, 128, 64, 8, 8, 3)),
    (float("inf"), (128, 128, 64, 8, 8, 3)),
)


def mxfp4_gemm_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> GemmConfig:
    per_expert = num_pairs / num_experts
    bm, bn, bk, group, warps, stages = next(c for b, c in MXFP4_GEMM_CONFIGS if per_expert <= b)
    if dtype == torch.float32:  # as moe_triton.gemm_config; BLOCK_K / 2 stays >= 16
        return bm, bn // 2, bk // 2, group, warps, stages
    return bm, bn, bk, group, warps, stages


@triton.jit(do_not_specialize=["P", "num_pid_m"])
def _moe_mxfp4_gemm_kernel(
    a_ptr,
    wb_ptr,
    ws_ptr,
    b_ptr,
    c_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    topk_w_ptr,
    N,
    K,
    P,
    num_pid_m,
    a_div,
    stride_am,
    stride_be,
    stride_cm,
    GATE_UP: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # As moe_triton._moe_gemm_kernel (same grouping, sentinel rows, epilogues); weight row r
    # of expert e (2N rows under GATE_UP, N otherwise): K / 2 bytes at wb + (e * rows + r) *
    # K / 2, K / 32 scales at ws + (e * rows + r) * K / 32.
    pid_m, pid_n = _gemm_block(tl.program_id(0), N, num_pid_m, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < P
    a_rows = a_ptr + (pair // a_div).to(tl.int64)[:, None] * stride_am
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    KB = K // 2
    KS = K // 32
    # [1, BLOCK_N] weight rows (gate rows under GATE_UP; up rows are N further)
    w_row = (expert * (2 * N if GATE_UP else N) + n.to(tl.int64))[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, KB, BLOCK_K // 2):
        j = k0 + tl.arange(0, BLOCK_K // 2)  # byte j holds columns 2j and 2j + 1
        j_ok = j < KB
        a_ok = row_ok[:, None] & j_ok[None, :]
        a_even = tl.load(a_rows + 2 * j[None, :], mask=a_ok, other=0.0)
        a_odd = tl.load(a_rows + 2 * j[None, :] + 1, mask=a_ok, other=0.0)
        w_ok = j_ok[:, None] & n_ok[None, :]
        # [BLOCK_K / 2, BLOCK_N] tiles: exact in bf16 (3 significant bits times 2^e)
        lo, hi = _mxfp4_tile(
            wb_ptr + w_row * KB + j[:, None], ws_ptr + w_row * KS + (j // 16)[:, None], w_ok
        )
        acc = tl.dot(a_even, lo.to(a_even.dtype), acc, input_precision=DOT_PRECISION)
        acc = tl.dot(a_odd, hi.to(a_odd.dtype), acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            up_row = w_row + N
            lo, hi = _mxfp4_tile(
                wb_ptr + up_row * KB + j[:, None], ws_ptr + up_row * KS + (j // 16)[:, None], w_ok
            )
            acc_up = tl.dot(a_even, lo.to(a_even.dtype), acc_up, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a_odd, hi.to(a_odd.dtype), acc_up, input_precision=DOT_PRECISION)
    _gemm_epilogue(
        acc, acc_up, b_ptr, c_ptr, topk_w_ptr, expert, pair, row_ok, n, n_ok, N, stride_be,
        stride_cm, GATE_UP, MUL_WEIGHT, HAS_BIAS, ACT, ALPHA, LIMIT,
    )  # fmt: skip


def _gemm_mxfp4(
    a: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    c: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor,
    a_div: int,
    gate_up: bool,
    epilogue: Epilogue,
    config: GemmConfig,
) -> None:
    block_m, block_n, block_k, group_m, num_warps, num_stages = config
    sorted_ids, expert_ids, num_post_pad = align
    N = c.shape[1]
    num_pid_m = expert_ids.shape[0]
    _moe_mxfp4_gemm_kernel[(num_pid_m * triton.cdiv(N, block_n),)](
        a, blocks, scales, a if bias is None else bias, c, sorted_ids, expert_ids, num_post_pad,
        topk_weights, N, a.shape[1], topk_weights.numel(), num_pid_m, a_div,
        a.stride(0), 0 if bias is None else bias.stride(0), c.stride(0),
        GATE_UP=gate_up, MUL_WEIGHT=not gate_up, HAS_BIAS=bias is not None,
        **(epilogue.consts() if gate_up else PLAIN.consts()),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def fused_moe_mxfp4_gemm(
    # [T, H]
    x: torch.Tensor,
    # [E, 2I, H / 32, 16], [E, 2I, H / 32] uint8
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    # [E, H, I / 32, 16], [E, H, I / 32] uint8
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    # [T, top_k] float32
    topk_weights: torch.Tensor,
    # [T, top_k]
    topk_ids: torch.Tensor,
    epilogue: Epilogue = PLAIN,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """[T, H]: the grouped-GEMM path (any T; meant for prefill and verification batches) with
    4-bit experts. Arguments as `fused_moe_mxfp4_decode`."""
    T, top_k = topk_ids.shape
    E, two_i = w13_blocks.shape[:2]
    H = x.shape[1]
    _check_pair(w13_blocks, w13_scales, two_i, H)
    _check_pair(w2_blocks, w2_scales, H, two_i // 2)
    if T == 0:
        return torch.empty_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    P = T * top_k
    # NOTE: BLOCK_K columns are BLOCK_K / 2 bytes a step; every table entry keeps that >= 16,
    # tl.dot's minimum.
    # The tiles of the pairs a captured graph runs (graph_rows): eager and graph alike.
    config = config or mxfp4_gemm_config(graph_rows.row_bound(T) * top_k, E, x.dtype)
    align = moe_align(topk_ids, E, config[0])
    inter = torch.empty(P, two_i // 2, dtype=x.dtype, device=x.device)
    b13, b2 = epilogue.w13_bias, epilogue.w2_bias
    args = (align, topk_weights)
    _gemm_mxfp4(x, w13_blocks, w13_scales, b13, inter, *args, top_k, True, epilogue, config)
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    _gemm_mxfp4(inter, w2_blocks, w2_scales, b2, y, *args, 1, False, epilogue, config)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    block_h = 1024
    _moe_sum_kernel[(T, triton.cdiv(H, block_h))](
        y, out, H, top_k, BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_H=block_h
    )
    return out
