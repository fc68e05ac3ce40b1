"""Triton kernels of `fused_moe` (ops/moe.py): CUDA, inference only, CUDA-graph capturable.

Two paths, chosen by the token count (known on the host, so one captured graph holds one path):

Decode (T <= DECODE_MAX_TOKENS): no sorting, no padding. Decode is a stream of expert weights,
so the kernels are gemv-like (ops/gemv.py): each program owns a few weight rows and walks K in
long contiguous tiles, the few activation rows come from L2.
  `_moe_decode_gate_up_kernel`  program (pair, column block) -> inter[pair] = act(g, u)
  `_moe_decode_down_kernel`     program (token, column block): the token's top_k experts' rows
                                as one [top_k, BLOCK_N, STEPS * BLOCK_K] slab, every tile of it
                                requested at once (before the PDL wait, the K loop unrolled),
                                products accumulated elementwise and reduced over K once, after
                                the loop, then weighted by the routing weights and summed over
                                top_k in registers: a fixed order (deterministic, no atomics).
  Pairs (tokens) are the fastest grid index, so the programs reading one column block of an
  expert chosen twice in a batch run side by side: the second read comes from L2, and HBM
  traffic is the distinct experts' bytes.

Grouped GEMM (prefill and verification batches):
  `_moe_align_kernel`  the (token, k) pairs grouped by expert (stable), each expert's segment
                       padded to BLOCK_M with the sentinel P, the expert of every BLOCK_M
                       block, and the padded total (vLLM's moe_align_block_size).
  `_moe_gemm_kernel`   per (block, column block): rows gathered through the sorted pair ids,
                       tl.dot over K with the expert's weights; gate_up with the activation
                       epilogue -> inter [P, I]; down with the routing weight -> y [P, H].
  `_moe_sum_kernel`    out[t] = sum_j y[t * top_k + j], in fp32.
  Buffers and grids are sized by the worst case, P + min(E, P) * (BLOCK_M - 1) padded rows;
  programs past the padded total (read on the device) return at once: no host sync.

gpt-oss (`Epilogue`): expert biases (HAS_BIAS) are added to the fp32 accumulators, and the
activation is a constexpr (ACT "silu" or "swiglu_oai" with ALPHA and LIMIT), so the plain SiLU
kernels compile as they did without them.

Rounding: products accumulate in fp32; inter and y are rounded to the model dtype once each
(the reference rounds after each linear, so 16-bit results differ by an ulp or so).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from specserve.ops import graph_rows, l2, pdl, skinny
from specserve.tunables import tunables

DECODE_MAX_TOKENS = 8
# Decode launch configs: (BLOCK_N, BLOCK_K, num_warps). gate_up: a [BLOCK_N, BLOCK_K] gate
# and up tile per K step (the dense gemv's shape); down: [top_k, BLOCK_N, BLOCK_K], so a small
# BLOCK_N still keeps top_k * BLOCK_N * BLOCK_K weights in flight and gives H / BLOCK_N
# programs per token. benchmarks/moe.py --sweep times the alternatives.
DecodeConfig = tuple[int, int, int]
# (max K, max top_k, config) rows, the first whose bounds hold wins (table_configs).
ConfigTable = tuple[tuple[float, float, DecodeConfig], ...]
DECODE_GATE_UP_CONFIG: DecodeConfig = (8, 512, 4)  # any shape (the tables' fallback)
# Per shape class, the first row whose bounds hold: (max K, max top_k, config); K is H for
# gate_up, the expert intermediate I for down. Why: at short K a program's few K steps are
# serial round trips (each step's loads wait for the previous step's math, a cross-warp
# reduction); at (8, 512, 4) Qwen3-30B-A3B's batch-1 gate_up reached 81% of the copy bandwidth,
# ~4 us over its bytes. One tile spanning K (BLOCK_K >= K) makes a program ONE round trip:
# gate_up issues all its weights as soon as it has its expert id. Registers (sm_90 cubin,
# Qwen3 shape): (4, 2048, 4) 72 -> 7 programs an SM. Measured on the H100 (`python
# benchmarks/moe.py --quick --sweep`): GLM-4.7-Flash 31.5 us a layer at one token with
# (2, 2048, 8) vs 42.7 with (4, 2048, 4). gate_up's tile does not depend on top_k (fused
# shared experts, models/moe.py, make it top_k + 1; only the grid grows).
DECODE_GATE_UP_TABLE: ConfigTable = (
    (2048, 4, (2, 2048, 8)),  # GLM-4.7-Flash: H = 2048, top-4
    (2048, 5, (2, 2048, 8)),  # GLM-4.7-Flash + shared: top-4 + 1 (the sweep's best too)
    (2048, float("inf"), (4, 2048, 4)),  # Qwen3-30B-A3B: top-8 (one token: persistent, below)
    (float("inf"), float("inf"), DECODE_GATE_UP_CONFIG),
)
# What benchmarks/moe.py --sweep times (each with the other kernel at its table config).
DECODE_GATE_UP_CONFIGS: tuple[DecodeConfig, ...] = (
    (8, 512, 4),
    (4, 2048, 4),
    (4, 2048, 8),
    (4, 1024, 4),
    (8, 1024, 4),
    (2, 2048, 8),
    (16, 512, 8),
)
# The down kernel holds a program's whole slab in registers and requests it before the PDL
# wait. A down kernel walking K in a loop with a cross-thread reduction a step is STEPS serial
# round trips a program: in batch-1 steps (H100, `python benchmarks/timeline.py`) Qwen3-30B-A3B
# spanned 3137 / 3125 us with it vs 3095 with this kernel; GLM-4.7-Flash (top-4 + shared) 3961
# vs 3839; GLM-4.5-Air + shared (top-9) 124.2 vs 112.0 us a layer alone.
# The gate_up decode kernel lets down launch right after its own PDL wait instead of after its
# weight stream, so down's programs take SM slots early and stream their slabs during gate_up's
# tail (Qwen3-30B-A3B span 3095 vs ~3178 us, GLM-4.7-Flash 3839 vs ~3896; the dense gemv
# measured slower that way: ops/pdl.py). down triggering right after its wait as well was
# slower (H100): Qwen3-30B-A3B step 2807 -> 2857-2861 us, down 5.8 -> 8.3 us a layer (the next
# gemv's programs take the slots its second wave needs), GLM-4.7-Flash 3336 -> 3344 us.
# Tried and dropped (H100; the patch is at commit b3db210, benchmarks/experiments/): the fused
# shared experts' gate_up programs (their ids are fixed) requesting their weights before the
# wait. GLM-4.7-Flash gate_up 24.5 -> 23.2-23.4 us a layer, but the step does not move
# (3304-3327 vs 3307-3311 us): down or the router, which the early stream competes with, slow.
# One-token steps whose table config is a key of `tunables().moe_gate_up_persistent` run the
# persistent gate_up kernel instead, at the value's own config (one K tile: BLOCK_K >= H) and
# programs an SM; everything else runs one program a column block, in waves. Each persistent
# program serves one pair's column blocks, its expert id and x row loaded once, the next
# block's weights requested before the current block's sums. Alone the experts stream no faster
# (H100: ~2.7 TB/s either way); in Qwen3-30B-A3B's batch-1 step it is 20-30 us faster (2854 ->
# 2829, 2.86 -> 2.83 ms: the grid fits the SMs at once, so down's programs take their slots
# sooner). Not with more tokens: each program's blocks multiply, and one block of prefetch no
# longer covers a round trip (its EAGLE-3 K = 3 step, 4 tokens, 5.01 -> 6.18 ms; and the wave
# kernel at (4, 2048, 8) instead of (4, 2048, 4): 5.52). GLM-4.7-Flash's (2, 2048, 8) at 4 an SM
# was 140 us a step slower (3473 -> 3613): it stays in waves.

# A program's whole [next_pow2(top_k), BLOCK_N, STEPS * BLOCK_K] bf16 slab sits in
# registers (plus a [.., BLOCK_K] fp32 accumulator), so BLOCK_N (and warps) are chosen per shape
# to keep the slab near 24 KB: no spills, registers for >= 4 programs an SM where the slab
# allows (sm_90 cubin registers a thread at the real shapes, checked by tests/test_moe_ops.py;
# BLOCK_K 256 keeps 16-byte loads and few unrolled steps).
# Per row: (max K = I, max top_k, config).
DECODE_DOWN_TABLE: ConfigTable = (
    (1024, 8, (2, 256, 4)),  # Qwen3-30B-A3B (I 768, top-8): [8, 2, 768], 80 regs, 6 an SM
    (2048, 4, (2, 256, 4)),  # GLM-4.7-Flash (I 1536, top-4): [4, 2, 1536], 80 regs, 6 an SM
    # gpt-oss (I 2880 in 6 steps of 512, biases): [4, 1, 3072], 86 regs, 5 an SM
    (float("inf"), 4, (1, 512, 4)),
    # GLM-4.7-Flash + shared (top-5: 8 rows), GLM-4.5-Air (I 1408, top-8) and DeepSeek-V3
    # (I 2048, top-8): [8, 1, 1536 / 1536 / 2048], 80 / 80 / 106 regs, 6 / 6 / 4 an SM
    (2048, 8, (1, 256, 4)),
    # Top-8 + shared (16 rows): GLM-4.5-Air [16, 1, 1536] at 8 warps, 80 regs, 3 an SM;
    # DeepSeek-V3's [16, 1, 2048] (64 KB a program) takes 106 regs, 2 an SM (128 KB in flight
    # an SM): no config of this kernel fits three.
    (float("inf"), float("inf"), (1, 256, 8)),
)
# What benchmarks/moe.py --sweep times for down.
DECODE_DOWN_CONFIGS: tuple[DecodeConfig, ...] = (
    (2, 256, 4),
    (1, 256, 4),
    (1, 512, 4),
    (2, 512, 4),
    (2, 128, 4),
    (1, 256, 8),
    (2, 256, 8),
    (4, 256, 8),
)


def table_configs(
    gate_up_table: ConfigTable, down_table: ConfigTable, hidden: int, inter: int, top_k: int
) -> tuple[DecodeConfig, DecodeConfig]:
    """(gate_up, down): each table's first row whose bounds hold (K = H, then I)."""
    gate_up = next(c for k, t, c in gate_up_table if hidden <= k and top_k <= t)
    down = next(c for k, t, c in down_table if inter <= k and top_k <= t)
    return gate_up, down


def decode_configs(hidden: int, inter: int, top_k: int) -> tuple[DecodeConfig, DecodeConfig]:
    """(gate_up, down) launch configs of the decode kernels for this expert shape."""
    return table_configs(DECODE_GATE_UP_TABLE, DECODE_DOWN_TABLE, hidden, inter, top_k)


# Grouped GEMM configs: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages), by the
# mean pairs per expert (P / E; bounds inclusive). Chosen after vLLM's tuned H100 table for
# E=128, N=768; one config serves both GEMMs (gate_up reads twice BLOCK_N weight columns a
# step: its SiLU epilogue needs gate and up accumulators).
GemmConfig = tuple[int, int, int, int, int, int]
GEMM_CONFIGS: tuple[tuple[float, GemmConfig], ...] = (
    (4.0, (16, 64, 128, 1, 4, 3)),
    (16.0, (16, 128, 128, 1, 4, 3)),
    (48.0, (32, 128, 64, 8, 4, 3)),
    (96.0, (64, 128, 64, 8, 4, 3)),
    (float("inf"), (128, 128, 64, 8, 8, 3)),
)


def uses_decode_path(num_tokens: int) -> bool:
    """Whether "auto" takes the decode kernels for `num_tokens` tokens. Judged on the tokens a
    captured graph runs (`graph_rows.row_bound`), so an eager step and its padded graph take
    the same path whatever the capture sizes (the gemm_config below is judged alike)."""
    return graph_rows.row_bound(num_tokens) <= DECODE_MAX_TOKENS


def gemm_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> GemmConfig:
    per_expert = num_pairs / num_experts
    bm, bn, bk, group, warps, stages = next(c for b, c in GEMM_CONFIGS if per_expert <= b)
    if dtype == torch.float32:
        # NOTE: float32 tiles take twice the shared memory (gate_up at (16, 128, 128) would
        # need 272 KB of the H100's 227) and registers (spills at BLOCK_M 128): halve N and K.
        return bm, bn // 2, bk // 2, group, warps, stages
    return bm, bn, bk, group, warps, stages


# NOTE: token-count arguments are not specialized (Triton would compile a variant for 1 and for
# multiples of 16), so every batch size a graph captures shares one compiled kernel.
@triton.jit(do_not_specialize=["P"])
def _moe_align_kernel(
    topk_ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    P,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # Program e places expert e's pairs. Each program counts every expert's pairs itself (P
    # ids from L2, cheap next to the GEMMs), so the segment offsets need no second launch and
    # no atomics, and each segment keeps the pairs' order: deterministic.
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(topk_ids_ptr + p, mask=p < P, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E, mask=p < P)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    mine = experts == e
    end = tl.sum(tl.where(mine, ends, 0), 0)
    count = tl.sum(tl.where(mine, counts, 0), 0)
    start = end - tl.sum(tl.where(mine, padded, 0), 0)
    if e == 0:
        tl.store(num_post_pad_ptr, tl.sum(padded, 0))
    # This expert's blocks.
    for b0 in range(start // BLOCK_M, end // BLOCK_M, BLOCK_P):
        b = b0 + tl.arange(0, BLOCK_P)
        tl.store(
            expert_ids_ptr + b, tl.zeros([BLOCK_P], dtype=tl.int32) + e, mask=b < end // BLOCK_M
        )
    # Its pairs, in order, then the sentinel P over the segment's padding.
    pos = start
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        hit = (tl.load(topk_ids_ptr + p, mask=p < P, other=-1) == e).to(tl.int32)
        tl.store(sorted_ids_ptr + pos + tl.cumsum(hit, 0) - 1, p, mask=hit != 0)
        pos += tl.sum(hit, 0)
    pad = start + count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ids_ptr + pad, tl.zeros([BLOCK_M], dtype=tl.int32) + P, mask=pad < end)


@triton.jit
def _act(gate, up, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """The gate_up epilogue on fp32 accumulators: silu(gate) * up, or gpt-oss's clamped SwiGLU
    ("swiglu_oai", ops/moe.py's formula)."""
    if ACT == "swiglu_oai":
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        return (up + 1.0) * (gate / (1.0 + tl.exp(-ALPHA * gate)))
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _gate_up_store(
    gate, up, b_ptr, expert, stride_be, n, n_ok, N, inter_ptr, pair, stride_im,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """inter[pair, n] = act(gate (+ b13[e, n]), up (+ b13[e, N + n])): the decode gate_up
    kernels' epilogue (bf16 and MXFP4), gate / up [BLOCK_N] fp32 sums of column block n."""
    if HAS_BIAS:
        b_row = b_ptr + expert * stride_be + n
        gate += tl.load(b_row, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(b_row + N, mask=n_ok, other=0.0).to(tl.float32)
    y = _act(gate, up, ACT, ALPHA, LIMIT)
    tl.store(inter_ptr + pair.to(tl.int64) * stride_im + n, y.to(inter_ptr.dtype.element_ty), n_ok)


@triton.jit
def _down_store(
    acc, b_ptr, expert, stride_be, n, n_ok, j_ok, route_w, out_ptr, t, stride_om,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """out[t, n] = sum_j route_w[j] * (acc[j, n] (+ b2[expert_j, n])): the decode down
    kernels' epilogue (bf16 and MXFP4), acc [BLOCK_TOPK, BLOCK_N] fp32, the top_k sum
    in a fixed order."""
    if HAS_BIAS:  # the chosen experts' biases
        b = b_ptr + expert[:, None] * stride_be + n[None, :]
        acc += tl.load(b, mask=j_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    y = tl.sum(acc * route_w[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + n, y.to(out_ptr.dtype.element_ty), n_ok)


@triton.jit
def _gemm_block(pid, N, num_pid_m, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program pid in grouped order: GROUP_M consecutive row
    blocks share a column block, so the blocks of one expert read its weight tile from L2
    after the first."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_m, (pid % in_group) // group_m


@triton.jit
def _gemm_epilogue(
    acc, acc_up, b_ptr, c_ptr, topk_w_ptr, expert, pair, row_ok, n, n_ok, N, stride_be,
    stride_cm, GATE_UP: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """A grouped-GEMM block's epilogue: + bias (b[e, n], and b[e, N + n] on up), act(gate, up)
    under GATE_UP, times the routing weight under MUL_WEIGHT; stored at the pairs' rows of c."""
    if HAS_BIAS:
        b_row = b_ptr + expert * stride_be + n
        acc += tl.load(b_row, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATE_UP:
            acc_up += tl.load(b_row + N, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATE_UP:
        acc = _act(acc, acc_up, ACT, ALPHA, LIMIT)
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["P", "num_pid_m"])
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
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
    stride_we,
    stride_wn,
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
    # c[pair, n] = (a[pair // a_div] @ W[e, n, :]^T) for the pairs of one expert's block.
    # gate_up: a = x, a_div = top_k, W = w13 and c = act(gate, up) (columns n and N + n);
    # down: a = inter, a_div = 1, W = w2, c = routing weight * product. HAS_BIAS: + b[e, n]
    # (and b[e, N + n] on up) before the epilogue (gpt-oss).
    # Grouped order (_gemm_block).
    pid_m, pid_n = _gemm_block(tl.program_id(0), N, num_pid_m, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < P
    a_rows = a_ptr + (pair // a_div).to(tl.int64)[:, None] * stride_am
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_cols = w_ptr + expert * stride_we + n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_cols + k[:, None], mask=w_ok, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            w_up = tl.load(w_cols + N * stride_wn + k[:, None], mask=w_ok, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
    _gemm_epilogue(
        acc, acc_up, b_ptr, c_ptr, topk_w_ptr, expert, pair, row_ok, n, n_ok, N, stride_be,
        stride_cm, GATE_UP, MUL_WEIGHT, HAS_BIAS, ACT, ALPHA, LIMIT,
    )  # fmt: skip


@triton.jit
def _moe_sum_kernel(
    y_ptr,
    out_ptr,
    H,
    top_k,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_TOPK)
    rows = (t * top_k + j)[:, None] * H
    ok = (j < top_k)[:, None] & (h < H)[None, :]
    y = tl.load(y_ptr + rows + h[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, tl.sum(y, 0).to(out_ptr.dtype.element_ty), mask=h < H)


@triton.jit(do_not_specialize=["P"])
def _moe_decode_gate_up_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    topk_ids_ptr,
    inter_ptr,
    N,
    K,
    P,
    top_k,
    stride_xm,
    stride_we,
    stride_wn,
    stride_be,
    stride_im,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    W_EVICT: tl.constexpr = "",
    PERSISTENT: tl.constexpr = False,
):
    # inter[pair, n] = act(W13[e, n] @ x[t] (+ b13[e, n]), W13[e, N + n] @ x[t] (+ b13[e, N + n])),
    # e = topk_ids[pair]; act = silu(gate) * up, or swiglu_oai.
    # Waves: program pid serves pair pid % P, column block pid // P. PERSISTENT (one K tile:
    # BLOCK_K >= K) on a grid of G programs, G a multiple of P: program pid serves pair pid % P
    # and its column blocks pid // P, pid // P + G // P, ...; so it loads its expert id and x
    # row once, and it requests its next block's weights before reducing the current one (two
    # blocks in flight a program, no waves: the grid fits the SMs at once).
    pid = tl.program_id(0)
    pair = pid % P
    n = (pid // P) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    # The expert id is the router's output (the previous kernel): nothing to preload.
    pdl.wait(PDL)
    # Right after the wait, so down's programs launch and preload their slabs during this
    # kernel's weight stream (down also preloads the routing, which the router wrote).
    pdl.trigger(PDL)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xm
    w_expert = w_ptr + expert * stride_we
    gate_rows = w_expert + n.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    if PERSISTENT:
        k = tl.arange(0, BLOCK_K)
        k_ok = k < K
        xk = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        tile_ok = n_ok[:, None] & k_ok[None, :]
        first_rows = gate_rows + k[None, :]
        gate = tl.load(first_rows, mask=tile_ok, other=0.0, eviction_policy=W_EVICT)
        up = tl.load(first_rows + N * stride_wn, mask=tile_ok, other=0.0, eviction_policy=W_EVICT)
        step = tl.num_programs(0) // P  # blocks between a program's consecutive ones
        for block in range(pid // P, tl.cdiv(N, BLOCK_N), step):
            cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
            n_next = cols + step * BLOCK_N
            next_ok = (n_next < N)[:, None] & k_ok[None, :]
            next_rows = w_expert + n_next.to(tl.int64)[:, None] * stride_wn + k[None, :]
            gate_next = tl.load(next_rows, mask=next_ok, other=0.0, eviction_policy=W_EVICT)
            up_next = tl.load(
                next_rows + N * stride_wn, mask=next_ok, other=0.0, eviction_policy=W_EVICT
            )
            acc = tl.sum(gate.to(tl.float32) * xk, axis=1)
            acc_up = tl.sum(up.to(tl.float32) * xk, axis=1)
            _gate_up_store(
                acc, acc_up, b_ptr, expert, stride_be, cols, cols < N, N, inter_ptr, pair,
                stride_im, HAS_BIAS, ACT, ALPHA, LIMIT,
            )  # fmt: skip
            gate, up = gate_next, up_next
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            tile_ok = n_ok[:, None] & k_ok[None, :]
            gate = tl.load(gate_rows + k[None, :], mask=tile_ok, other=0.0, eviction_policy=W_EVICT)
            up = tl.load(up_rows + k[None, :], mask=tile_ok, other=0.0, eviction_policy=W_EVICT)
            gate, up = gate.to(tl.float32), up.to(tl.float32)
            xk = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc += tl.sum(gate * xk, axis=1)
            acc_up += tl.sum(up * xk, axis=1)
        _gate_up_store(
            acc, acc_up, b_ptr, expert, stride_be, n, n_ok, N, inter_ptr, pair, stride_im,
            HAS_BIAS, ACT, ALPHA, LIMIT,
        )  # fmt: skip


@triton.jit
def _down_program(N, T, top_k, BLOCK_N: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """A down kernel program's share of the grid (T tokens x N / BLOCK_N column tiles): its
    token t, output columns n [BLOCK_N] and n_ok, and the token's (token, expert) pair indices
    [BLOCK_TOPK] with j_ok (j < top_k). Index arithmetic only: no memory access."""
    pid = tl.program_id(0)
    t = pid % T
    n = (pid // T) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_TOPK)
    return t, n, n < N, t * top_k + j, j < top_k


@triton.jit
def _routing(topk_ids_ptr, topk_w_ptr, pair, ok):
    """(expert int64, routing weight fp32) of each pair (0 / 0.0 where not ok)."""
    expert = tl.load(topk_ids_ptr + pair, mask=ok, other=0).to(tl.int64)
    route_w = tl.load(topk_w_ptr + pair, mask=ok, other=0.0).to(tl.float32)
    return expert, route_w


@triton.jit
def _down_tile(w_rows, rows_ok, k, K, W_EVICT: tl.constexpr):
    """[BLOCK_TOPK, BLOCK_N, BLOCK_K]: the chosen experts' weight rows at columns k (W_EVICT:
    ops/l2.py's policy)."""
    ok = rows_ok & (k < K)[None, None, :]
    return tl.load(w_rows + k[None, None, :], mask=ok, other=0.0, eviction_policy=W_EVICT)


@triton.jit(do_not_specialize=["T"])
def _moe_decode_down_kernel(
    inter_ptr,
    w_ptr,
    b_ptr,
    topk_ids_ptr,
    topk_w_ptr,
    out_ptr,
    N,
    K,
    T,
    top_k,
    stride_im,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STEPS: tl.constexpr,
    PDL: tl.constexpr,
    PRELOAD: tl.constexpr,
    W_EVICT: tl.constexpr = "",
):
    # out[t, n] = sum_j topk_weights[t, j] * (W2[e_j, n] @ inter[t * top_k + j] (+ b2[e_j, n])).
    # The K loop is unrolled (STEPS = cdiv(K, BLOCK_K) on the host) and its weight tiles are
    # loaded first, all of them, into a tuple, so a program is ONE round trip to HBM; the
    # products accumulate elementwise into a tile-shaped fp32 accumulator and the cross-thread
    # sum over K runs once, after the loop. The price is registers: a program holds its whole
    # [BLOCK_TOPK, BLOCK_N, STEPS * BLOCK_K] slab, so DECODE_DOWN_TABLE picks BLOCK_N (and
    # warps) to fit it.
    # PRELOAD (under PDL): the routing and EVERY weight tile are loaded before waiting for the
    # gate_up kernel. Safe because the routing was written before gate_up started (it is
    # gate_up's input too), gate_up lets this kernel launch only after its own wait, and
    # weights never depend on the previous kernel; only inter is read after the wait.
    t, n, n_ok, pair, j_ok = _down_program(N, T, top_k, BLOCK_N, BLOCK_TOPK)
    k = tl.arange(0, BLOCK_K)
    if not PRELOAD:
        pdl.wait(PDL)
    expert, route_w = _routing(topk_ids_ptr, topk_w_ptr, pair, j_ok)
    # [BLOCK_TOPK, BLOCK_N, 1] row starts
    w_rows = w_ptr + expert[:, None, None] * stride_we + n.to(tl.int64)[None, :, None] * stride_wn
    rows_ok = j_ok[:, None, None] & n_ok[None, :, None]
    # NOTE: a tuple, not a Python list (static_range unrolls in the frontend, and a tuple of
    # tensors is what Triton can carry): STEPS tiles [BLOCK_TOPK, BLOCK_N, BLOCK_K].
    tiles = ()
    for s in tl.static_range(STEPS):
        tiles = tiles + (_down_tile(w_rows, rows_ok, s * BLOCK_K + k, K, W_EVICT),)
    if PRELOAD:
        pdl.wait(PDL)
    # [BLOCK_TOPK, 1] inter rows, its tiles (from L2) requested after the wait. NOTE: ptxas
    # keeps the weight loads ahead of the wait and of every FMA, but sinks some of these
    # below the first FMAs (sm_90 SASS at Qwen3's config: 2 of 6 issued before the math).
    h_rows = inter_ptr + pair.to(tl.int64)[:, None] * stride_im
    h_ok = j_ok[:, None]
    hs = ()
    for s in tl.static_range(STEPS):
        ks = s * BLOCK_K + k
        hs = hs + (tl.load(h_rows + ks[None, :], mask=h_ok & (ks < K)[None, :], other=0.0),)
    acc = tl.zeros([BLOCK_TOPK, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for s in tl.static_range(STEPS):
        acc += tiles[s].to(tl.float32) * hs[s].to(tl.float32)[:, None, :]
    pdl.trigger(PDL)
    acc2 = tl.sum(acc, axis=2)  # [BLOCK_TOPK, BLOCK_N]
    _down_store(
        acc2, b_ptr, expert, stride_be, n, n_ok, j_ok, route_w, out_ptr, t, stride_om, HAS_BIAS
    )


def moe_align(
    # [num_tokens, top_k]
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [max_padded] int32: pair indices t * top_k + j grouped by expert in pair
    order, each group padded to a multiple of block_m with P = topk_ids.numel();
    expert_ids [max_padded / block_m] int32: the expert of each block; num_post_pad [1] int32:
    the padded total). Entries past num_post_pad are unwritten."""
    P = topk_ids.numel()
    max_padded = P + min(num_experts, P) * (block_m - 1)
    max_padded = triton.cdiv(max_padded, block_m) * block_m
    dev = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=dev)
    _moe_align_kernel[(num_experts,)](
        topk_ids.reshape(-1),
        sorted_ids,
        expert_ids,
        num_post_pad,
        P,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_P=1024,  # one compiled kernel for every P
        BLOCK_M=block_m,
    )
    return sorted_ids, expert_ids, num_post_pad


def moe_align_ref(
    # [num_tokens, top_k]
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`moe_align`'s layout up to its padded total, in torch (host loop; tests):
    (sorted_ids [total], expert_ids [total / block_m], total)."""
    flat = topk_ids.reshape(-1).long().cpu()
    P = flat.numel()
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for e in range(num_experts):
        pairs = (flat == e).nonzero().flatten().tolist()
        blocks = -(-len(pairs) // block_m)
        sorted_ids += pairs + [P] * (blocks * block_m - len(pairs))
        expert_ids += [e] * blocks
    as_int = dict(dtype=torch.int32)
    return torch.tensor(sorted_ids, **as_int), torch.tensor(expert_ids, **as_int), len(sorted_ids)


@dataclass(frozen=True)
class Epilogue:
    """What the experts add to SwiGLU (gpt-oss): biases on both projections and the
    activation, "silu" or "swiglu_oai" (ops/moe.py). The default is the plain SwiGLU."""

    # [E, 2I] (gate, then up) or None
    w13_bias: torch.Tensor | None = None
    # [E, H] or None
    w2_bias: torch.Tensor | None = None
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def consts(self) -> dict:
        """The gate_up kernels' activation constexprs. NOTE: alpha and limit are compile-time
        only under swiglu_oai, so the SiLU kernels are one compiled variant whatever they are."""
        oai = self.activation == "swiglu_oai"
        return dict(
            ACT=self.activation,
            ALPHA=float(self.alpha) if oai else 0.0,
            LIMIT=float(self.limit) if oai else 0.0,
        )


PLAIN = Epilogue()


def _bias_args(b: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(pointer argument, expert stride): a missing bias passes any tensor, never read."""
    return (dummy, 0) if b is None else (b, b.stride(0))


def _gemm(
    a: torch.Tensor,
    w: torch.Tensor,
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
    b, stride_be = _bias_args(bias, w)
    _moe_gemm_kernel[(num_pid_m * triton.cdiv(N, block_n),)](
        a,
        w,
        b,
        c,
        sorted_ids,
        expert_ids,
        num_post_pad,
        topk_weights,
        N,
        a.shape[1],
        topk_weights.numel(),
        num_pid_m,
        a_div,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        stride_be,
        c.stride(0),
        GATE_UP=gate_up,
        MUL_WEIGHT=not gate_up,
        HAS_BIAS=bias is not None,
        **(epilogue.consts() if gate_up else PLAIN.consts()),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )


def fused_moe_gemm(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: GemmConfig | None = None,
    epilogue: Epilogue = PLAIN,
) -> torch.Tensor:
    """The grouped-GEMM path (any token count); arguments as `fused_moe`."""
    T, top_k = topk_ids.shape
    E, two_i, H = w13.shape
    P = T * top_k
    # NOTE: the tiles of the pairs a captured graph runs (graph_rows), not of P itself: the
    # eager step and its padded graph must pick the same config.
    config = config or gemm_config(graph_rows.row_bound(T) * top_k, E, x.dtype)
    align = moe_align(topk_ids, E, config[0])
    inter = torch.empty(P, two_i // 2, dtype=x.dtype, device=x.device)
    _gemm(x, w13, epilogue.w13_bias, inter, align, topk_weights, top_k, True, epilogue, config)
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    _gemm(inter, w2, epilogue.w2_bias, y, align, topk_weights, 1, False, epilogue, config)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)  # the sum writes rows of H
    block_h = 1024
    _moe_sum_kernel[(T, triton.cdiv(H, block_h))](
        y, out, H, top_k, BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_H=block_h
    )
    return out


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (skinny.num_sms, cached); 4 on the CPU interpreter,
    so that a persistent program there serves several column blocks too."""
    return skinny.num_sms(device) if device.type == "cuda" else 4


def fused_moe_decode(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[DecodeConfig, DecodeConfig] | None = None,
    epilogue: Epilogue = PLAIN,
) -> torch.Tensor:
    """The decode path (meant for T <= DECODE_MAX_TOKENS, correct for any); as `fused_moe`.
    `configs`: (gate_up, down) launch configs, default the shape tables'."""
    T, top_k = topk_ids.shape
    E, two_i, H = w13.shape
    inter_size, P = two_i // 2, T * top_k
    (gn, gk, gw), (dn, dk, dw) = configs or decode_configs(H, inter_size, top_k)
    kw = pdl.launch_kwargs(x.device)
    b13, s13 = _bias_args(epilogue.w13_bias, w13)
    b2, s2 = _bias_args(epilogue.w2_bias, w2)
    inter = torch.empty(P, inter_size, dtype=x.dtype, device=x.device)
    persistent = tunables().moe_gate_up_persistent.get((gn, gk, gw))
    # One K tile (the persistent loop has no K loop) and one token only (judged on the graph's
    # row bound, as uses_decode_path): with more, each program's column blocks multiply, and
    # one block of prefetch no longer covers a round trip (Qwen3-30B-A3B's EAGLE-3 K = 3 step,
    # 4 tokens: 5.01 -> 6.18 ms on an H100).
    persistent_launch = bool(persistent) and persistent[0][1] >= H and graph_rows.row_bound(T) == 1
    if persistent_launch:
        (gn, gk, gw), per_sm = persistent
    per_pair = triton.cdiv(inter_size, gn)  # column blocks of a pair
    if persistent_launch:  # as many programs as the SMs hold at once, at most one a block
        per_pair = min(per_pair, triton.cdiv(per_sm * _sm_count(x.device), P))
    _moe_decode_gate_up_kernel[(P * per_pair,)](
        x, w13, b13, topk_ids, inter, inter_size, H, P, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), s13, inter.stride(0),
        HAS_BIAS=epilogue.w13_bias is not None, **epilogue.consts(),
        BLOCK_N=gn, BLOCK_K=gk, num_warps=gw,
        PERSISTENT=persistent_launch,
        W_EVICT=l2.weight_eviction(), **kw,
    )  # fmt: skip
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    # The K loop unrolled: STEPS tiles of BLOCK_K (the last one masked past I).
    _moe_decode_down_kernel[(T * triton.cdiv(H, dn),)](
        inter, w2, b2, topk_ids, topk_weights, out, H, inter_size, T, top_k,
        inter.stride(0), w2.stride(0), w2.stride(1), s2, out.stride(0),
        HAS_BIAS=epilogue.w2_bias is not None,
        BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_N=dn, BLOCK_K=dk,
        STEPS=triton.cdiv(inter_size, dk), num_warps=dw,
        PRELOAD=kw["PDL"], W_EVICT=l2.weight_eviction(), **kw,
    )  # fmt: skip
    return out


def _check_shapes(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    epilogue: Epilogue,
) -> None:
    T, top_k = topk_ids.shape
    E, two_i, H = w13.shape
    b13, b2 = epilogue.w13_bias, epilogue.w2_bias
    if (
        x.shape != (T, H)
        or two_i % 2
        or w2.shape != (E, H, two_i // 2)
        or topk_weights.shape != (T, top_k)
        or (b13 is not None and b13.shape != (E, two_i))
        or (b2 is not None and b2.shape != (E, H))
    ):
        shapes = [x, w13, w2, topk_weights, topk_ids, b13, b2]
        raise ValueError(
            "fused_moe takes x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk [T, top_k], "
            "w13_bias [E, 2I] or None, w2_bias [E, H] or None; got "
            + ", ".join(str(None if t is None else tuple(t.shape)) for t in shapes)
        )
    if epilogue.activation not in ("silu", "swiglu_oai"):
        raise ValueError(
            f"fused_moe activation must be silu or swiglu_oai, got {epilogue.activation!r}"
        )


def _last_dim_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    # Loaded weights are contiguous; only a strided last dim would need a (whole) copy.
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def fused_moe_triton(
    # [T, H]
    x: torch.Tensor,
    # [E, 2I, H]
    w13: torch.Tensor,
    # [E, H, I]
    w2: torch.Tensor,
    # [T, top_k]
    topk_weights: torch.Tensor,
    # [T, top_k]
    topk_ids: torch.Tensor,
    path: str = "auto",
    epilogue: Epilogue = PLAIN,
) -> torch.Tensor:
    """`fused_moe` in Triton; path "auto" (decode kernels up to DECODE_MAX_TOKENS tokens, the
    grouped GEMM above), "decode" or "gemm"; `epilogue` the gpt-oss biases and activation."""
    _check_shapes(x, w13, w2, topk_weights, topk_ids, epilogue)
    T = topk_ids.shape[0]
    if T == 0:
        return torch.empty_like(x)
    x, w13, w2 = (_last_dim_contiguous(t) for t in (x, w13, w2))
    b13, b2 = (_last_dim_contiguous(t) for t in (epilogue.w13_bias, epilogue.w2_bias))
    epilogue = replace(epilogue, w13_bias=b13, w2_bias=b2)
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    if path == "decode" or (path == "auto" and uses_decode_path(T)):
        return fused_moe_decode(x, w13, w2, topk_weights, topk_ids, epilogue=epilogue)
    return fused_moe_gemm(x, w13, w2, topk_weights, topk_ids, epilogue=epilogue)
