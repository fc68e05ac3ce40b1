"""cuBLAS at verification row counts: F.linear time per (weight shape, rows), bf16, H100.

    python benchmarks/verify_gemm.py [--rows 256,320,384,512] [--shapes llama3-8b]

A batch of B requests verifying K drafts runs the target's matmuls at B x (K + 1) rows (320 at
B = 64, K = 4), past the decode plan's 64-row buckets, on cuBLAS. This times each Llama-3-8B
weight shape at each row count in a CUDA graph (20 calls a replay, median of 10 replays), and
prints us and TFLOP/s: whether a row count cuBLAS tiles badly costs more than padding it to the
next one would.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

SHAPES = {
    "llama3-8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
    }
}


def time_us(fn, calls: int = 20, replays: int = 10) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="256,320,384,448,512")
    ap.add_argument("--shapes", default="llama3-8b")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name in args.shapes.split(","):
        for proj, (n, k) in SHAPES[name].items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            line = []
            for m in rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                us = time_us(lambda x=x, w=w: F.linear(x, w))
                tflops = 2 * m * n * k / us / 1e6
                results.append({"shape": name, "proj": proj, "n": n, "k": k, "rows": m, "us": us})
                line.append(f"{m}: {us:7.1f} us {tflops:4.0f} TF/s")
            print(f"{name} {proj:8s} {' | '.join(line)}", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "verify_gemm.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
