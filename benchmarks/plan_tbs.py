"""The decode_matmul="auto" plan decode.py logged, as weight-stream TB/s per candidate.

One line per weight shape and row bucket of the last engine in decode.py's JSON (the plan
covers every bucket, whatever batch the engine ran): each candidate's TB/s (the shape's weight
bytes over all its layers / the plan's CUDA-graph time for them) and the choice.

    python benchmarks/plan_tbs.py $OUT/decode.json [--rows 128]
"""

from __future__ import annotations

import argparse
import json
import re


def label(c: str) -> str:
    """SkinnyConfig(block_n=64, block_k=128, split_k=3, num_warps=4, ...) -> S64k128s3w4."""
    m = re.search(r"block_n=(\d+), block_k=(\d+), split_k=(\d+), num_warps=(\d+)", c)
    if not m:
        return c
    return f"S{m[1]}k{m[2]}" + (f"s{m[3]}" if m[3] != "0" else "") + f"w{m[4]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--rows", default="", help="comma list of buckets to print (default all)")
    args = ap.parse_args()
    keep = {int(r) for r in args.rows.split(",") if r}
    rows = json.load(open(args.json))["rows"]
    for p in rows[-1].get("specserve_async_gemv", {}).get("decode_matmul_plan", []):
        if keep and p["rows"] not in keep:
            continue
        n, k = p["shape"]
        mb = n * k * 2 * p["layers"] / 1e6  # MB / us = TB/s
        us = " ".join(f"{label(c)} {mb / t:.2f}" for c, t in p["us"].items())
        tag = ("silu " if p["silu_mul"] else "") + ("norm" if p["norm_fed"] else "")
        print(f"{p['shape']} M={p['rows']} {tag:9} -> {label(p['choice'])}: TB/s {us}")


if __name__ == "__main__":
    main()
