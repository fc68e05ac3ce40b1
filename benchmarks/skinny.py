"""Verification-sized matmuls (2-64 rows) of the Llama-3-8B shape: cuBLAS vs the Triton skinny
matmul (specserve/ops/skinny.py) and, up to 8 rows, the gemv.

For each weight (qkv, o, gate_up, down, lm_head; bf16) and M = 2, 4, 8, 16, 32, 64 rows: time
per weight inside a CUDA graph over a model's worth of distinct weights of that shape (as
benchmarks/gemv.py: every weight streams from HBM, launch gaps are a captured forward's), for
cuBLAS and every config in `skinny.CONFIGS` (and the gemv's `gemv_plan.CANDIDATES` up to 8
rows), after a check against F.linear; the weight-read bandwidth as % of the device-to-device
copy bandwidth (decode.py's floor). "gate_up+silu": cuBLAS + the SiLU-and-mul kernel vs the
fused epilogue. Under 3 minutes on an H100 (compiles included).

    python benchmarks/skinny.py                 # table last; $OUT/skinny.json
    python benchmarks/skinny.py --rows 16,64 --weights o,down
    python benchmarks/skinny.py --sweep --rows 4,16   # a wide config grid (tiles, splits,
                                                      # stages) instead of skinny.CONFIGS
    python benchmarks/skinny.py --configs "64,128,2,4,3;32,128,4,4,3"   # these, all ranked
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402
from decode import copy_bandwidth  # noqa: E402
from gemv import SHAPES  # noqa: E402


def sweep_configs() -> list:
    """--sweep: narrow to wide tiles, automatic and fixed splits, shallow and deep pipelines."""
    from specserve.ops.skinny import SkinnyConfig

    return [
        SkinnyConfig(bn, bk, split, 4, stages)
        for bn in (16, 32, 64)
        for bk in (128, 256, 512)
        for split in (0, 1, 3)
        for stages in (3, 5)
        if bn * bk <= 16384
    ]


def main() -> None:
    from specserve.ops import silu_and_mul
    from specserve.ops.gemv import MAX_M, planned_matmul
    from specserve.ops.gemv_plan import CANDIDATES, graph_us
    from specserve.ops.skinny import (
        CONFIGS,
        SkinnyConfig,
        new_counters,
        num_sms,
        resolve_split,
    )

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="2,4,8,16,32,64")
    ap.add_argument("--weights", default=",".join([*SHAPES, "gate_up+silu"]))
    ap.add_argument("--sweep", action="store_true", help="time sweep_configs(), not CONFIGS")
    ap.add_argument(
        "--configs",
        default="",
        help="skinny configs to time instead, block_n,block_k,split_k,num_warps,num_stages "
        "each, ';'-separated",
    )
    args = ap.parse_args()
    configs = sweep_configs() if args.sweep else CONFIGS
    if args.configs:
        configs = [SkinnyConfig(*map(int, c.split(","))) for c in args.configs.split(";")]
    ranked = args.sweep or bool(args.configs)
    ms = [int(m) for m in args.rows.split(",")]
    names = args.weights.split(",")
    t0 = time.perf_counter()
    bw = copy_bandwidth()
    dev = torch.device("cuda")
    rows = []
    for name in names:
        silu = name == "gate_up+silu"
        n, k, count = SHAPES["gate_up" if silu else name]
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5 for _ in range(count)]
        counters = [new_counters(dev, n // 16 + 1) for _ in ws]

        def per_weight(
            fn: Callable[[torch.Tensor, torch.Tensor], object], ws: list = ws, cs: list = counters
        ) -> float:
            """Microseconds per weight of fn(w, counters) over all of `ws` in one graph."""
            pairs = list(zip(ws, cs))
            return graph_us(lambda: [fn(w, c) for w, c in pairs]) / len(ws)

        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].float())
            if silu:
                gate, up = ref.chunk(2, dim=-1)
                ref = F.silu(gate) * up
                cublas = per_weight(lambda w, c, x=x: silu_and_mul(F.linear(x, w)))
            else:
                cublas = per_weight(lambda w, c, x=x: F.linear(x, w))
            cands = [*configs, *(CANDIDATES if m <= MAX_M else ())]
            times = {}
            for cfg in cands:
                y = planned_matmul(x, ws[0], None, cfg, silu, counters[0]).float()
                err = ((y - ref).norm() / ref.norm()).item()
                assert err < 2e-2, (name, m, cfg, err)
                times[cfg] = per_weight(
                    lambda w, c, x=x, cfg=cfg, s=silu: planned_matmul(x, w, None, cfg, s, c)
                )
            best = min(times, key=times.get)
            nbytes = 2 * n * k
            splits = 1
            if isinstance(best, SkinnyConfig):  # else a gemv config (no split)
                splits = resolve_split(best, n // 2 if silu else n, k, num_sms(dev))[0]
            rows.append(
                {
                    "weight": name,
                    "N": n,
                    "K": k,
                    "M": m,
                    "cublas_us": cublas,
                    "triton_us": times[best],
                    "triton_config": list(best),
                    "splits": splits,
                    "all_us": {str(c): t for c, t in times.items()},
                    "cublas_pct_of_copy_bw": 100 * nbytes / (cublas * 1e-6) / bw,
                    "triton_pct_of_copy_bw": 100 * nbytes / (times[best] * 1e-6) / bw,
                }
            )
            print(f"{name} M={m}: cuBLAS {cublas:.1f} us, best {best} {times[best]:.1f} us")
            if ranked:
                for c in sorted(times, key=times.get)[1 : 5 if args.sweep else None]:
                    print(f"    {tuple(c)} {times[c]:.1f} us")
        del ws
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_bw_GBs": bw / 1e9,
        "seconds": time.perf_counter() - t0,
        "rows": rows,
    }
    write_json("skinny.json", result)
    print(f"\n{result['device']}  copy bandwidth {bw / 1e9:.0f} GB/s, {result['seconds']:.0f} s")
    print(
        f"{'weight':>12} {'M':>2} {'cuBLAS us':>10} {'% of bw':>8} {'Triton us':>10} "
        f"{'% of bw':>8} {'speedup':>7}  config"
    )
    for r in rows:
        print(
            f"{r['weight']:>12} {r['M']:>2} {r['cublas_us']:>10.1f} "
            f"{r['cublas_pct_of_copy_bw']:>7.1f}% {r['triton_us']:>10.1f} "
            f"{r['triton_pct_of_copy_bw']:>7.1f}% {r['cublas_us'] / r['triton_us']:>6.2f}x"
            f"  {tuple(r['triton_config'])} splits {r['splits']}"
        )


if __name__ == "__main__":
    main()
