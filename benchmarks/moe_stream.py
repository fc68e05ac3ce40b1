"""The batch-1 MoE expert stream alone: fused_moe_decode (gate_up + down) at real expert shapes,
under gate_up launch variants, as us a call and TB/s of expert weights.

    python benchmarks/moe_stream.py [--variants "4,2048,4,0;2,2048,8,4"] [--reps 64]

A variant is `BLOCK_N,BLOCK_K,warps,per_sm`: gate_up's decode config, and per_sm
its `moe_triton.GATE_UP_PERSISTENT` entry (0: one program a column block, in waves; k: the
persistent kernel, k programs an SM); "table": the shape tables as they stand. down keeps its
table config. Each call reads `top_k` experts of one token, different random experts at each
of `--reps` calls captured back to back in one CUDA graph, so the weights come from HBM (128
experts of 6-9 MB against a 50 MB L2). Outputs are checked against the first variant's.
Writes $OUT/moe_stream.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from specserve.ops import moe_triton as mt

# name: (experts, intermediate, hidden, top_k)
SHAPES = {
    "qwen3-30b-a3b": (128, 768, 2048, 8),
    "glm47-flash": (64, 1536, 2048, 5),  # top-4 + the fused shared expert
}
DEFAULT_VARIANTS = (
    "table;4,2048,4,0;2,2048,8,0;1,2048,4,8;2,2048,4,5;2,2048,8,4;4,2048,8,2;4,2048,4,3;2,2048,8,2"
)


def time_variant(shape: tuple[int, int, int, int], variant: str, reps: int, iters: int = 10):
    E, inter, H, top_k = shape
    saved = mt.DECODE_GATE_UP_TABLE, mt.GATE_UP_PERSISTENT
    if variant != "table":
        bn, bk, warps, per_sm = (int(v) for v in variant.split(","))
        mt.DECODE_GATE_UP_TABLE = ((float("inf"), float("inf"), (bn, bk, warps)),)
        cfg = (bn, bk, warps)
        mt.GATE_UP_PERSISTENT = {cfg: (cfg, per_sm)} if per_sm else {}
    try:
        g = torch.Generator("cuda").manual_seed(0)
        w13 = (torch.randn(E, 2 * inter, H, generator=g, device="cuda") / H**0.5).bfloat16()
        w2 = (torch.randn(E, H, inter, generator=g, device="cuda") / inter**0.5).bfloat16()
        x = torch.randn(1, H, generator=g, device="cuda").bfloat16()
        ids = [torch.randperm(E, generator=g, device="cuda")[:top_k] for _ in range(reps)]
        ids = [i.to(torch.int32)[None] for i in ids]
        tw = [torch.rand(1, top_k, generator=g, device="cuda") for _ in range(reps)]
        outs = [mt.fused_moe_decode(x, w13, w2, tw[r], ids[r]) for r in range(reps)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for r in range(reps):
                mt.fused_moe_decode(x, w13, w2, tw[r], ids[r])
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / (iters * reps)
        return us, 3 * top_k * inter * H * 2 / us / 1e6, torch.cat(outs)
    finally:
        mt.DECODE_GATE_UP_TABLE, mt.GATE_UP_PERSISTENT = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=64)
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        ref = None
        for variant in args.variants.split(";"):
            us, tbs, out = time_variant(SHAPES[name], variant, args.reps)
            ref = out if ref is None else ref
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            rows.append(dict(shape=name, variant=variant, us=us, tbs=tbs, rel_err=err))
            print(f"{name} {variant}: {us:.2f} us, {tbs:.2f} TB/s, rel err {err:.1e}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_stream.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(
        "\n| shape | gate_up variant (BLOCK_N,BLOCK_K,warps,per_sm) | us a call | TB/s | rel err |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['variant']} | {r['us']:.2f} | {r['tbs']:.2f} | {r['rel_err']:.1e} |"
        )


if __name__ == "__main__":
    main()
