"""Decode matmuls of the Llama-3-8B shape: cuBLAS (F.linear) vs specserve's Triton gemv.

For each weight of a layer (qkv, o, gate_up, down) and lm_head, bf16, M = 1, 4, 8 rows: time per
weight inside a CUDA graph that runs the matmul over a model's worth of distinct weights of that
shape (32 per layer shape, 1 lm_head), so every weight streams from memory as in a forward (one
4096 x 4096 weight called repeatedly would sit in the 50 MB L2 and look faster than HBM
allows) and launch gaps are those of a captured
forward; the weight-read bandwidth it reaches and its share of the device-to-device copy
bandwidth (the floor decode.py uses). Every Triton launch config in `specserve.ops.gemv.CONFIGS`
is tried; the best is reported next to cuBLAS, after a check against the reference.
"gate_up+silu" compares cuBLAS + the SiLU-and-mul kernel with the fused Triton kernel.

    python benchmarks/gemv.py          # table last; $OUT/gemv.json
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402
from decode import copy_bandwidth  # noqa: E402

SHAPES = {  # name: (N, K) of the nn.Linear weight, and how many of them a forward reads
    "qkv": (6144, 4096, 32),
    "o": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 1),
}


def main() -> None:
    from specserve.ops.gemv import CONFIGS, gemv, gemv_ref
    from specserve.ops.gemv_plan import graph_us as graph_us_once

    bw = copy_bandwidth()
    rows = []
    for name, (n, k, count) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        w = ws[0]

        def graph_us(fn: Callable[[torch.Tensor], object], ws: list = ws) -> float:
            """Microseconds per weight of `fn(w)` over all of `ws` in one graph."""
            return graph_us_once(lambda: [fn(w) for w in ws]) / len(ws)

        for m in (1, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = gemv_ref(x, w).float()
            cublas = graph_us(lambda w, x=x: F.linear(x, w))
            best = None
            for cfg in CONFIGS:
                err = (gemv(x, w, config=cfg).float() - ref).abs().max().item()
                assert err <= 2e-2 * ref.abs().max().item(), (name, m, cfg, err)
                us = graph_us(lambda w, x=x, cfg=cfg: gemv(x, w, config=cfg))
                if best is None or us < best[0]:
                    best = (us, cfg)
            nbytes = 2 * n * k
            rows.append(
                {
                    "weight": name,
                    "N": n,
                    "K": k,
                    "M": m,
                    "cublas_us": cublas,
                    "triton_us": best[0],
                    "triton_config": best[1],
                    "cublas_pct_of_copy_bw": 100 * nbytes / (cublas * 1e-6) / bw,
                    "triton_pct_of_copy_bw": 100 * nbytes / (best[0] * 1e-6) / bw,
                }
            )
            if name == "gate_up":  # + SiLU-and-mul: two kernels vs the fused one
                from specserve.ops import silu_and_mul

                two = graph_us(lambda w, x=x: silu_and_mul(F.linear(x, w)))
                cfg = best[1]
                fused = graph_us(lambda w, x=x, cfg=cfg: gemv(x, w, config=cfg, silu_mul=True))
                rows.append(
                    {
                        "weight": "gate_up+silu",
                        "N": n,
                        "K": k,
                        "M": m,
                        "cublas_us": two,
                        "triton_us": fused,
                        "triton_config": cfg,
                        "cublas_pct_of_copy_bw": 100 * 2 * n * k / (two * 1e-6) / bw,
                        "triton_pct_of_copy_bw": 100 * 2 * n * k / (fused * 1e-6) / bw,
                    }
                )
        del w, ws
    result = {"device": torch.cuda.get_device_name(), "copy_bw_GBs": bw / 1e9, "rows": rows}
    write_json("gemv.json", result)
    print(f"\n{result['device']}  copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    print(
        f"{'weight':>8} {'M':>2} {'cuBLAS us':>10} {'% of bw':>8} {'Triton us':>10} {'% of bw':>8}  config"
    )
    for r in rows:
        print(
            f"{r['weight']:>8} {r['M']:>2} {r['cublas_us']:>10.1f} "
            f"{r['cublas_pct_of_copy_bw']:>7.1f}% {r['triton_us']:>10.1f} "
            f"{r['triton_pct_of_copy_bw']:>7.1f}%  {r['triton_config']}"
        )


if __name__ == "__main__":
    main()
