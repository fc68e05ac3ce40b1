"""decode_matmul="auto": per weight shape and decode row bucket (1, 2, 4, ..., 64: plain decode
batches and verification batches of B x (K + 1) rows), the fastest of cuBLAS, the Triton gemv
(ops/gemv.py) and the Triton skinny matmul (ops/skinny.py), timed on this GPU at engine start.

Which one wins depends on the GPU, the shape and the row count (on an H200, Llama-3-8B shapes,
M = 1: Triton for the o projection, cuBLAS for down; at M >= 4 cuBLAS everywhere). Each
candidate runs over ALL of the model's weights of one shape inside a CUDA graph, as a forward
runs them: the weights stream from memory (one 4096 x 4096 bf16 weight alone would sit in L2),
and launch gaps are those of a captured step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.ops import plan_compile
from specserve.ops.gemv import BUCKETS, Config, DecodeLinear, PlanConfig, use_decode_gemv_
from specserve.ops.skinny import SkinnyConfig

logger = logging.getLogger("specserve")

# gemv launch configs tried (each is one Triton compile per row bucket, paid at start-up), all
# measured on the H100 (benchmarks/RESULTS.md; `python benchmarks/timeline_sweep.py --step-ms`):
# - (8, 512, 4, 4), the winner of some Llama-3-8B shape at M = 1 in benchmarks/gemv.py;
# - (8, 1024, 4, 3), twice the weight bytes in flight per K step: batch-1 decode 5.616 -> 5.470
#   ms a step (graph 5.225 -> 5.087);
# - two with a 2048-wide K tile, whose first tile (all of a 2048-deep row: K = 2048 in
#   Qwen3-30B-A3B's qkv, half of it at K = 4096) streams before the PDL wait, during the
#   previous kernel: the plan took them for Qwen3-30B-A3B's qkv and o (o 7.12 -> 5.28 us a
#   layer in the step) and Llama-3-8B's qkv (19.15 -> 18.23 us); batch-1 busy time 3031 ->
#   2992 us and 5454 -> 5430 us;
# - (2, 4096, 4, 1), a whole 4096-deep row a program: Qwen3-30B-A3B's o 5.40 -> 3.27 us a
#   layer, busy 3003 -> 2951 us;
# - (4, 4096, 8, 1), the same 64 registers a thread as (2, 4096, 4, 1) on twice the threads, so
#   half the programs: Qwen3-30B-A3B's o projection (512 programs, 4 an SM: the whole grid
#   preloads during attention) 3.29 -> 2.24 us a layer, step 2747-2750 -> 2724-2728 us;
#   Llama-3-8B's 5301 -> 5291 us;
# - (2, 8192, 8, 1), a whole row of up to 8192 (GLM-4.7-Flash's 5120-deep o, where
#   (4, 2048, 4, 2) preloaded 2048 of each row): o 7.93 -> 6.53 us a layer, step 3302 -> 3255 us.
# The tie rule below takes the first whole-row config in this order, so each sits before the
# wider ones. Configs that won no shape of the four families' plans (Llama-3-8B, Qwen3-30B-A3B,
# GLM-4.7-Flash, gpt-oss-20b) are not tried: each candidate is a compile at start-up.
CANDIDATES: tuple[Config, ...] = (
    (8, 512, 4, 4),
    (8, 1024, 4, 3),
    (4, 2048, 4, 2),
    (8, 2048, 4, 2),
    (4, 4096, 8, 1),
    (2, 4096, 4, 1),
    (2, 8192, 8, 1),
)
# Skinny-matmul configs tried (at the buckets below). From a 48-config sweep on the H100
# (`python benchmarks/skinny.py --sweep`, Llama-3-8B shapes, 4 and 16 rows): 3 stages beat 4-6,
# and fixed splits beat "two programs per SM" on the o and down projections; wide tiles at
# 32-64 rows. Which fixed split wins depends on the shape (4-16 rows, unfused, us a weight: qkv
# 2 splits 20.2-20.3 vs 3 splits 23.5-23.7, o and down 4 splits 14.0-14.2 / 42.0-42.4 vs
# 14.3-14.6 / 43.0-43.4, gate_up + SiLU 1 split 82.5-83.8 vs S32's 84.6-85.1 and cuBLAS
# 89.7-94.0), so the 64-wide tile is timed at 1, 2 and 4 splits. The split count is a launch
# argument: every count above one runs one compiled kernel (plan_compile.job).
SKINNY_CANDIDATES: tuple[SkinnyConfig, ...] = (
    SkinnyConfig(64, 128, 3, 4, 3),
    SkinnyConfig(32, 128, 0, 4, 3),
    SkinnyConfig(128, 128, 0, 8, 3),
    SkinnyConfig(64, 128, 2, 4, 3),
    SkinnyConfig(64, 128, 4, 4, 3),
    SkinnyConfig(64, 128, 1, 4, 3),
)
_S64_SPLIT3, _S32, _S128, _S64_SPLIT2, _S64_SPLIT4, _S64_SPLIT1 = SKINNY_CANDIDATES
_S64_SPLITS = (_S64_SPLIT2, _S64_SPLIT4, _S64_SPLIT1)
# Per bucket, the Triton configs timed against cuBLAS (each a compile at start-up: cold-cache
# planning is CPU-bound in them). Every gemv config at one row (batch-1 decode, where a few
# percent matter); elsewhere those that won a Llama-3-8B shape or came within 1% of the winner
# when every config was timed at every bucket (H100): the gemv lost by 1.16-3.2x at 4 and 8
# rows, the 64-row tiles of the skinny matmul by 1.17-2.3x at 64 rows, and so on. 99 compile
# jobs -> 64 for Llama-3-8B. At 2-16 rows (one 16-row tile) the 64-wide tile is also timed at
# 1 / 2 / 4 splits, its fixed 3 splits last (no compile of its own; it won no Llama-3-8B shape
# there, but the MoE and MLA targets' projections were not timed that way); 32 rows, not timed
# that way either, keep 3 only.
BUCKET_CANDIDATES: dict[int, tuple[PlanConfig, ...]] = {
    1: CANDIDATES,
    2: (CANDIDATES[1], *_S64_SPLITS, _S64_SPLIT3),
    4: (*_S64_SPLITS, _S32, _S64_SPLIT3),
    8: (*_S64_SPLITS, _S32, _S64_SPLIT3),
    16: (*_S64_SPLITS, _S32, _S64_SPLIT3),
    32: (_S64_SPLIT3, _S32, _S128),
    64: (_S128,),
}
TUNED_BUCKETS = BUCKETS
# A timer: (layers, rows, silu_mul, candidate) -> microseconds for the whole group.
Timer = Callable[[list[DecodeLinear], int, bool, PlanConfig], float]

# Plans timed in this process, reused by later engines: start-up pays the timing once, and two
# engines of one process (a graph and an eager one in a test, a benchmark's variants) run the
# same kernels, so their outputs can be compared bit for bit. Key: device, weight group (shape,
# dtype, bias, SiLU gate_up, norm-fed), layer count, SiLU epilogue, rows, candidate set
# (benchmarks change it).
# Holds launch configs and timings only, never tensors.
_PLANS: dict[tuple, tuple[PlanConfig, dict[str, float]]] = {}


def candidates(rows: int, k: int | None = None) -> tuple[PlanConfig, ...]:
    """What bucket `rows` chooses among: cuBLAS (None), then Triton configs; for weights `k`
    deep, without gemv configs whose K tile is at least twice the row and wider than the
    narrowest (more than half of every tile masked: registers for nothing, and a compile at
    start-up; Qwen3-30B-A3B's 4096-deep o timed (2, 8192, 8, 1) ~1% ahead of (4, 4096, 8, 1)
    alone, and 2777 vs 2726 us a step in place on an H100)."""
    cands = BUCKET_CANDIDATES.get(rows, ())
    if k is not None:
        narrowest = min((c[1] for c in cands if _is_gemv(c)), default=0)
        cands = tuple(c for c in cands if not _is_gemv(c) or c[1] < 2 * k or c[1] <= narrowest)
    return (None, *cands)


def _is_gemv(cfg: PlanConfig) -> bool:
    return cfg is not None and not isinstance(cfg, SkinnyConfig)


def graph_us(fn: Callable[[], object], calls: int = 1, replays: int = 10) -> float:
    """Microseconds per call of `fn`: `calls` calls captured in one graph, median replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compiles, cuBLAS heuristics
            fn()
    torch.cuda.current_stream().wait_stream(s)
    # The events are nodes of the graph (external): the time is the device's from the first
    # kernel to the last, whatever the host does around the replay. Recorded by the host around
    # each replay, a host stall between the first event and the replay counted as kernel time,
    # and the plan's compile threads (plan_compile) hold the GIL for milliseconds at a time.
    a = torch.cuda.Event(enable_timing=True, external=True)
    b = torch.cuda.Event(enable_timing=True, external=True)
    g = torch.cuda.CUDAGraph()
    # thread_local: the compile threads may allocate meanwhile
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        a.record()
        for _ in range(calls):
            fn()
        b.record()
    times = []
    for _ in range(replays + 2):
        g.replay()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    return sorted(times[2:])[len(times[2:]) // 2]


def graph_timer(layers: list[DecodeLinear], m: int, silu_mul: bool, cfg: PlanConfig) -> float:
    """Microseconds of `cfg` for `m` rows over all of `layers`' weights, in one CUDA graph. Layers
    the model feeds through norm_linear are timed as they run: the Triton kernel with the RMSNorm
    and residual add fused, cuBLAS after the separate norm kernel."""
    return graph_us(_candidate(layers, m, silu_mul, cfg))


def _candidate(
    layers: list[DecodeLinear], m: int, silu_mul: bool, cfg: PlanConfig
) -> Callable[[], None]:
    """`cfg` for `m` rows over `layers`' weights, as graph_timer times it."""
    from specserve import ops

    w0 = layers[0].weight
    x = torch.randn(m, w0.shape[1], device=w0.device, dtype=w0.dtype)
    res = torch.randn_like(x) if layers[0].norm_fed else None
    g = torch.ones(w0.shape[1], device=w0.device, dtype=w0.dtype)

    def run() -> None:
        for lin in layers:
            if cfg is None:
                h = x if res is None else ops.rms_norm(x, g, 1e-6, res)[0]
                y = F.linear(h, lin.weight, lin.bias)
                if silu_mul:
                    ops.silu_and_mul(y)
            elif res is not None:
                lin.run_norm(x, g, 1e-6, res, cfg, silu_mul)
            else:
                lin.run(x, cfg, silu_mul)

    return run


# A later candidate must beat every earlier one by more than this fraction to be chosen. Why
# (H100, benchmarks/RESULTS.md): Llama-3-8B's down projection at 16 rows timed 1389 us for its
# 32 layers with SkinnyConfig(64, 128, 3, ...) and 1398 with (32, 128, 0, ...); one start-up
# picked the second, which then cost 55.5 us a layer inside the decode step instead of 44.0
# (batch-16 span 6569 vs 6197 us). Near ties flip from run to run; the earlier candidates are
# the measured defaults.
TIE_MARGIN = 0.02


def fastest(
    layers: list[DecodeLinear], m: int, silu_mul: bool, timer: Timer = graph_timer
) -> tuple[PlanConfig, dict[str, float]]:
    """The fastest of bucket `m`'s candidates over `layers`' weights (near ties, within
    TIE_MARGIN of the best: a whole-row gemv config where `whole_row_wins_ties`, else the
    first, cuBLAS before Triton), and every candidate's time."""
    cands = candidates(m, layers[0].weight.shape[1])
    us = [timer(layers, m, silu_mul, c) for c in cands]
    best = min(us)
    ties = [c for c, t in zip(cands, us) if t <= best * (1 + TIE_MARGIN)]
    whole = [c for c in ties if whole_row_wins_ties(layers[0], c)]
    return (whole or ties)[0], {str(c): t for c, t in zip(cands, us)}


def whole_row_wins_ties(lin: DecodeLinear, cfg: PlanConfig) -> bool:
    """Whether `cfg` is a gemv config whose one K tile holds a whole weight row, for a weight
    that is not norm-fed: such a program requests all its bytes before the PDL wait, during
    the previous kernel, which the plan's back-to-back timing cannot credit (each call's
    preload lands in the previous call's weight stream). In the step a weight that is not
    norm-fed follows a latency-bound kernel (the o projection follows attention and its
    merge), where that preload is free: gpt-oss-20b's o projection, whose configs tie in the
    plan (231-233 us for 24 layers), took 6.68 us a layer with (4, 2048, 4, 2) and 5.74 with
    (2, 4096, 4, 1), attention and merge 0.2 us slower (H100, benchmarks/RESULTS.md). A
    norm-fed weight follows the previous layer's weight stream: there it lost (qkv 10.76 ->
    12.78 us), so only a clear win picks it."""
    return _is_gemv(cfg) and not lin.norm_fed and cfg[1] >= lin.weight.shape[1]


@torch.inference_mode()
def tune_decode_gemv_(models: list[nn.Module], timer: Timer | None = None) -> list[dict]:
    """Turn the models' nn.Linear layers into DecodeLinear (all cuBLAS), then time and plan each
    weight shape and row bucket; returns the timings (one row per shape, bucket and kind).
    `timer`: None times CUDA weights in CUDA graphs (plans cached per process in _PLANS); a
    given one plans weights on any device (tests) and caches nothing."""
    t0 = time.perf_counter()
    for m in models:
        use_decode_gemv_(m, config=None)
    # An MLP's gate_up runs with its activation: SiLU in the fused epilogue (the SiLU plan,
    # DecodeLinear.silu_gate_up), anything else after the plain product (the plain plan). Only
    # that one is planned.
    groups: dict[tuple, list[DecodeLinear]] = {}
    for m in models:
        for lin in m.modules():
            if isinstance(lin, DecodeLinear) and (lin.weight.is_cuda or timer is not None):
                w = lin.weight
                key = (
                    tuple(w.shape),
                    w.dtype,
                    lin.bias is not None,
                    lin.silu_gate_up,
                    lin.norm_fed,
                )
                groups.setdefault(key, []).append(lin)
    # (group, its layers, silu_mul, rows bucket, _PLANS key): every plan to make; a SiLU
    # gate_up's with the fused epilogue
    tasks = [
        (
            group,
            layers,
            group[3],
            b,
            (layers[0].weight.device, group, len(layers), group[3], b, candidates(b, group[0][1])),
        )
        for group, layers in groups.items()
        if group[1] in (torch.bfloat16, torch.float16)
        for b in TUNED_BUCKETS
    ]
    # The CUDA plans this process has not timed: their candidates compile in threads while
    # the loop below times each (shape, rows) as soon as its own are compiled.
    todo = [t for t in tasks if timer is None and t[4] not in _PLANS]

    def jobs_of(lin: DecodeLinear, silu_mul: bool, b: int) -> list[plan_compile.Job]:
        cands = candidates(b, lin.weight.shape[1])
        return [plan_compile.job(lin, b, silu_mul, c) for c in cands if c is not None]

    compiles = plan_compile.Compiles(
        {j: layers[0] for _, layers, silu, b, _ in todo for j in jobs_of(layers[0], silu, b)},
        todo[0][1][0].weight.device if todo else torch.device("cpu"),
    )
    report = []
    for group, layers, silu_mul, b, pkey in tasks:
        if timer is not None:
            cfg, times = fastest(layers, b, silu_mul, timer)
        else:
            if pkey not in _PLANS:
                compiles.wait(jobs_of(layers[0], silu_mul, b))
                _PLANS[pkey] = fastest(layers, b, silu_mul)
            cfg, times = _PLANS[pkey]
        for lin in layers:
            (lin.silu_plan if silu_mul else lin.plan)[b] = cfg
        report.append(
            {"shape": group[0], "layers": len(layers), "rows": b, "silu_mul": silu_mul}
            | {"norm_fed": layers[0].norm_fed}
            | {"choice": str(cfg), "us": times}
        )
    compiles.close()
    logger.info(
        "decode_matmul=auto: planned %d (shape, rows) in %.1f s",
        len(report),
        time.perf_counter() - t0,
    )
    return report
