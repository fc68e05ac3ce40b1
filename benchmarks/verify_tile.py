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
    python benchmarks/verify_tile.py --kernel tma --rows 16,80,128   # the TMA prototype below,
                                          # with the engine's skinny configs up to 64 rows
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

from specserve.ops import gemv_plan, skinny  # noqa: E402
from specserve.ops.gemv_plan import graph_us  # noqa: E402
from specserve.ops.skinny import SkinnyConfig  # noqa: E402


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


@triton.jit
def _tma_kernel(
    w_desc, x_desc, y_ptr, ws_ptr, count_ptr, M, N, K,
    K_TILES_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    # Swap-AB: the weight tile [BLOCK_N, BLOCK_K] is the MMA's M side (64-row wgmma), the
    # activations [BLOCK_M, BLOCK_K] (rows past M zero-filled by the TMA) its N side; both
    # arrive by TMA into a STAGES-deep shared-memory ring. SPLIT > 1: each split stores its
    # fp32 [BLOCK_N, BLOCK_M] partial, and the last split of the column block to arrive
    # (acq_rel counter, reset by it) sums them in split order and stores: one launch, and
    # the same bits whatever the arrival order.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    off_n = pid_n * BLOCK_N
    k0 = pid_k * K_TILES_SPLIT * BLOCK_K
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # The last split's tiles past K come back zero-filled (TMA bounds): no mask needed.
    for i in tl.range(0, K_TILES_SPLIT, num_stages=STAGES, warp_specialize=WARP_SPECIALIZE):
        w = w_desc.load([off_n, k0 + i * BLOCK_K])
        x = x_desc.load([0, k0 + i * BLOCK_K])
        acc = tl.dot(w, x.T, acc)
    n = off_n + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    ok = (n < N)[:, None] & (m < M)[None, :]
    y = y_ptr + m[None, :] * N + n[:, None]
    if SPLIT == 1:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        part = ws_ptr + (n[:, None] * BLOCK_M + m[None, :])
        tl.store(part + pid_k * N * BLOCK_M, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial stored before the release
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT):
                total += tl.load(part + s * N * BLOCK_M, mask=ok, other=0.0)
            tl.store(y, total.to(y_ptr.dtype.element_ty), mask=ok)
            tl.store(count_ptr + pid_n, 0)


def tma_matmul(x: torch.Tensor, w: torch.Tensor, bufs: dict, cfg: tuple) -> torch.Tensor:
    """x @ w.T for x [M <= block_m, K], by TMA tiles: `cfg` = (block_m, block_n, block_k,
    programs, warps, stages, warp_specialize); split-K so the grid has about `programs`
    programs. `bufs`: y, the fp32 workspace and the counters, allocated once per shape."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, programs, warps, stages, ws = cfg
    M, K = x.shape
    N = w.shape[0]
    n_tiles, k_tiles = triton.cdiv(N, bn), triton.cdiv(K, bk)
    split = max(1, min(k_tiles, round(programs / n_tiles)))
    k_tiles_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, k_tiles_split)
    key = (M, N, bm, split)
    if key not in bufs:
        bufs[key] = (
            torch.empty(M, N, device=x.device, dtype=x.dtype),
            torch.empty(split * N * bm, device=x.device, dtype=torch.float32),
            torch.zeros(n_tiles, device=x.device, dtype=torch.int32),
        )
    y, work, count = bufs[key]
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    _tma_kernel[(n_tiles, split)](
        wd, xd, y, work, count, M, N, K, K_TILES_SPLIT=k_tiles_split,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, STAGES=stages,
        WARP_SPECIALIZE=ws, num_warps=warps,
    )  # fmt: skip
    return y


def skinny_run(x: torch.Tensor, w: torch.Tensor, bufs: dict, cfg: SkinnyConfig) -> torch.Tensor:
    """The engine's skinny matmul (ops/skinny.py) at `cfg`, its split counters kept in `bufs`."""
    if "counters" not in bufs:
        bufs["counters"] = skinny.new_counters(x.device)
    return skinny.skinny_matmul(x, w, config=cfg, counters=bufs["counters"])


# (block_n, block_k, programs, warps, stages, warp_specialize); block_m is the rows' power of 2
TMA_CONFIGS = [
    (128, 64, 132, 4, 6, False),
    (128, 128, 132, 4, 4, False),
    (64, 128, 132, 4, 5, False),
    (64, 128, 264, 4, 5, False),
    (128, 64, 264, 4, 4, False),
]
# NOTE: warp_specialize=True with these host-side descriptors never finished on the H100
# (session 24, call 3: the first such config ran until the call's timeout), so none here.

CONFIGS = [(128, 128, 64, s, 8, st) for s in (1, 2, 4, 8) for st in (3, 4)]
CONFIGS += [(128, 256, 64, s, 8, 3) for s in (2, 4, 8)]
CONFIGS += [(256, 128, 64, s, 8, 3) for s in (1, 2, 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="80,128,256")
    ap.add_argument("--weights", default="qkv,o,gate_up,down")
    ap.add_argument("--kernel", choices=("tile", "tma"), default="tile")
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
            print(f"  {name} M={m} cuBLAS: {row['cublas_tbs']:.2f} TB/s", flush=True)
            if args.kernel == "tile":
                runs = [(c, tile_matmul, acc) for c in CONFIGS if c[0] >= m]
            else:
                bm = max(16, triton.next_power_of_2(m))
                runs = [((bm, *c[:2], *c[2:]), tma_matmul, {}) for c in TMA_CONFIGS]
                # The engine's skinny matmul where the decode plan times it (<= 64 rows).
                plan = gemv_plan.BUCKET_CANDIDATES.get(triton.next_power_of_2(m), ())
                runs += [(c, skinny_run, {}) for c in plan if isinstance(c, SkinnyConfig)]
            for cfg, fn, buf in runs:
                try:
                    y = fn(x, ws[0], buf, cfg).float()
                except Exception as e:  # a config the compiler rejects (e.g. warp_specialize)
                    print(f"{name} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                err = ((y - ref).norm() / ref.norm()).item()
                assert err < 2e-2, (name, m, cfg, err)
                t = graph_us(
                    lambda x=x, cfg=cfg, ws=ws, fn=fn, buf=buf: [fn(x, w, buf, cfg) for w in ws]
                )
                row[str(cfg)] = mb / t
                print(f"  {name} M={m} {cfg}: {mb / t:.2f} TB/s", flush=True)
            best = max((c for c in row if c.startswith("(")), key=row.get)
            print(
                f"{name} M={m}: cuBLAS {row['cublas_tbs']:.2f} TB/s, best tile {best} "
                f"{row[best]:.2f} TB/s ({100 * row[best] * 1e12 / bw:.0f}% of copy)",
                flush=True,
            )
            out.append(row)
        del ws
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"verify_{args.kernel}.json"), "w") as f:
            json.dump({"copy_bandwidth_GBs": bw / 1e9, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
