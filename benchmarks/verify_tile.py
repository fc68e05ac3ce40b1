"""Prototype: can a Triton tile GEMM stream the weights of a 65-256-row verification batch
faster than cuBLAS? (Issue 23: batch-16 verification at K = 4 is 80 rows, where cuBLAS streams
2.0-2.7 TB/s and the skinny matmul's swap-AB tiles lose; benchmarks/RESULTS.md session 23.)

The kernel here is the ordinary orientation: a program owns all rows (one BLOCK_M tile) and
BLOCK_N weight rows, so each K step reads a weight tile at least as large as the activation
tile; split-K over `split` programs fills the SMs, each adding its fp32 partial into a
workspace with atomics (order-dependent: timing only, not an engine kernel), then one cast.
Each config runs over a model's 32 distinct weights of a shape in a CUDA graph (the weights
stream from HBM, as the decode plan times them), against F.linear.

    python benchmarks/verify_tile.py [--rows 80,128,256] [--weights qkv,o,gate_up,down]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from decode import copy_bandwidth  # noqa: E402
from gemv import SHAPES  # noqa: E402

from specserve.ops.gemv_plan import graph_us  # noqa: E402


@triton.jit
def _tile_kernel(
    x_ptr, w_ptr, ws_ptr, M, N, K, k_split, stride_xm, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_end = tl.minimum(K, (pid_k + 1) * k_split)
    for k0 in range(pid_k * k_split, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows < M)[:, None])
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=(n < N)[:, None])  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc)
    out = ws_ptr + rows[:, None] * N + n[None, :]
    tl.atomic_add(out, acc, mask=(rows < M)[:, None] & (n < N)[None, :], sem="relaxed")


def tile_matmul(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, cfg: tuple) -> torch.Tensor:
    """x @ w.T for x [M <= block_m, K]: `cfg` = (block_m, block_n, block_k, split, warps,
    stages); `ws` [M, N] fp32 (zeroed here)."""
    bm, bn, bk, split, warps, stages = cfg
    M, K = x.shape
    N = w.shape[0]
    ws.zero_()
    k_split = triton.cdiv(triton.cdiv(K, bk), split) * bk
    grid = (triton.cdiv(N, bn), triton.cdiv(K, k_split))
    _tile_kernel[grid](
        x, w, ws, M, N, K, k_split, x.stride(0), w.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return ws.to(x.dtype)


CONFIGS = [(128, 128, 64, s, 8, st) for s in (1, 2, 4, 8) for st in (3, 4)]
CONFIGS += [(128, 256, 64, s, 8, 3) for s in (2, 4, 8)]
CONFIGS += [(256, 128, 64, s, 8, 3) for s in (1, 2, 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="80,128,256")
    ap.add_argument("--weights", default="qkv,o,gate_up,down")
    args = ap.parse_args()
    bw = copy_bandwidth()
    dev = torch.device("cuda")
    out = []
    for name in args.weights.split(","):
        n, k, count = SHAPES[name]
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5 for _ in range(count)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            acc = torch.empty(m, n, device=dev, dtype=torch.float32)
            ref = F.linear(x, ws[0]).float()
            mb = 2 * n * k * count / 1e6  # MB / us = TB/s
            row = {"weight": name, "M": m, "cublas_tbs": mb / graph_us(
                lambda x=x, ws=ws: [F.linear(x, w) for w in ws])}  # fmt: skip
            for cfg in CONFIGS:
                if cfg[0] < m:
                    continue
                y = tile_matmul(x, ws[0], acc, cfg).float()
                err = ((y - ref).norm() / ref.norm()).item()
                assert err < 2e-2, (name, m, cfg, err)
                t = graph_us(
                    lambda x=x, cfg=cfg, ws=ws, acc=acc: [tile_matmul(x, w, acc, cfg) for w in ws]
                )
                row[str(cfg)] = mb / t
            best = max((c for c in row if c.startswith("(")), key=row.get)
            print(
                f"{name} M={m}: cuBLAS {row['cublas_tbs']:.2f} TB/s, best tile {best} "
                f"{row[best]:.2f} TB/s ({100 * row[best] * 1e12 / bw:.0f}% of copy)",
                flush=True,
            )
            out.append(row)
        del ws
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "verify_tile.json"), "w") as f:
            json.dump({"copy_bandwidth_GBs": bw / 1e9, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
