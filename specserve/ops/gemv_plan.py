"""decode_matmul="auto": per weight shape and decode row count, the faster of cuBLAS and the
Triton gemv, timed on this GPU at engine start.

Which one wins depends on the GPU, the shape and the row count (on an H200, Llama-3-8B shapes,
M = 1: Triton for the o projection, cuBLAS for down; at M >= 4 cuBLAS everywhere). Each
candidate runs over ALL of the model's weights of one shape inside a CUDA graph, as a forward
runs them: the weights stream from memory (one 4096 x 4096 bf16 weight alone would sit in L2),
and launch gaps are those of a captured step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.ops.gemv import BUCKETS, Config, DecodeLinear, gemv, use_decode_gemv_

# Launch configs tried (each is one Triton compile per row bucket, paid at start-up): the two
# that won some Llama-3-8B shape at M = 1 in benchmarks/gemv.py, and (8, 1024, 4, 3), twice the
# weight bytes in flight per K step: with it batch-1 decode went from 5.616 to 5.470 ms a step
# on the H100 (graph 5.225 -> 5.087; benchmarks/RESULTS.md, session 6 call 4).
CANDIDATES: tuple[Config, ...] = ((8, 512, 4, 4), (8, 1024, 4, 3), (16, 512, 4, 3))
# Rows the Triton kernel is tried for; larger buckets stay cuBLAS (it lost by 2x or more there).
TUNED_BUCKETS = (1, 2)
assert set(TUNED_BUCKETS) <= set(BUCKETS)

# Plans timed in this process, reused by later engines: start-up pays the timing once, and two
# engines of one process (a graph and an eager one in a test, a benchmark's variants) run the
# same kernels, so their outputs can be compared bit for bit. Key: device, weight group (shape,
# dtype, bias, gate_up), layer count, SiLU epilogue, rows, candidate set (benchmarks change it).
_PLANS: dict[tuple, tuple[Config | None, dict[str, float]]] = {}


def graph_us(fn: Callable[[], object], calls: int = 1, replays: int = 10) -> float:
    """Microseconds per call of `fn`: `calls` calls captured in one graph, median replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compiles, cuBLAS heuristics
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    return sorted(times[2:])[len(times[2:]) // 2]


def _fastest(
    layers: list[DecodeLinear], m: int, silu_mul: bool
) -> tuple[Config | None, dict[str, float]]:
    """The fastest of cuBLAS (None) and each candidate for `m` rows over `layers`' weights."""
    from specserve.ops import silu_and_mul

    w0 = layers[0].weight
    x = torch.randn(m, w0.shape[1], device=w0.device, dtype=w0.dtype)

    def run(cfg: Config | None) -> None:
        for lin in layers:
            if cfg is None:
                y = F.linear(x, lin.weight, lin.bias)
                if silu_mul:
                    silu_and_mul(y)
            else:
                gemv(x, lin.weight, lin.bias, config=cfg, silu_mul=silu_mul)

    cands = (None, *CANDIDATES)
    us = [graph_us(lambda c=c: run(c)) for c in cands]
    return cands[us.index(min(us))], {str(c): t for c, t in zip(cands, us)}


@torch.inference_mode()
def tune_decode_gemv_(models: list[nn.Module]) -> list[dict]:
    """Turn the models' nn.Linear layers into DecodeLinear (all cuBLAS), then time and plan each
    weight shape; returns the timings (one row per shape, bucket and kind)."""
    from specserve.models.layers import MLP

    for m in models:
        use_decode_gemv_(m, config=None)
    gate_up = {id(mod.gate_up_proj) for m in models for mod in m.modules() if isinstance(mod, MLP)}
    groups: dict[tuple, list[DecodeLinear]] = {}
    for m in models:
        for lin in m.modules():
            if isinstance(lin, DecodeLinear) and lin.weight.is_cuda:
                w = lin.weight
                key = (tuple(w.shape), w.dtype, lin.bias is not None, id(lin) in gate_up)
                groups.setdefault(key, []).append(lin)
    report = []
    for group, layers in groups.items():
        shape, dtype, _, is_gate_up = group
        if dtype not in (torch.bfloat16, torch.float16):
            continue
        dev = layers[0].weight.device
        for silu_mul in (False, True) if is_gate_up else (False,):
            for b in TUNED_BUCKETS:
                pkey = (dev, group, len(layers), silu_mul, b, CANDIDATES)
                if pkey not in _PLANS:
                    _PLANS[pkey] = _fastest(layers, b, silu_mul)
                cfg, times = _PLANS[pkey]
                for lin in layers:
                    (lin.silu_plan if silu_mul else lin.plan)[b] = cfg
                report.append(
                    {"shape": shape, "layers": len(layers), "rows": b, "silu_mul": silu_mul}
                    | {"choice": str(cfg), "us": times}
                )
    return report
