"""benchmarks/timeline.py under module switches, one run each: the step span per variant.

    python benchmarks/timeline_sweep.py --shape qwen3-30b-a3b \
        --variants "base;specserve.attention.triton_paged.MAX_SPLITS=4"

A variant is `;`-separated from the next and sets `module.NAME=value` pairs (`,`-separated; a
value is a Python expression, commas inside it allowed: `M.TABLE=((1, 2),)`) before timeline.py runs in a fresh process, so compiled kernels and plans
do not leak between variants. The last lines print each variant's span.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))
from ab import run_variant  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--prompt-len", default="128")
    ap.add_argument("--variants", required=True)
    ap.add_argument(
        "--step-ms", action="store_true", help="also each variant's step time without profiler"
    )
    args = ap.parse_args()
    spans = []
    for variant in args.variants.split(";"):
        script = ["benchmarks/timeline.py", "--shape", args.shape, "--batch", args.batch]
        script += ["--prompt-len", args.prompt_len]
        script += ["--step-ms"] if args.step_ms else []
        out = run_variant(variant, script)
        print(f"### {variant}\n{out}", flush=True)
        m = re.search(r"span (\d+)\s+busy (\d+)", out)
        step = re.search(r"step (\d+) us \(wall (\d+)\); host waits (\d+)", out)
        spans.append((variant, *(m.groups() if m else "??"), *(step.groups() if step else "---")))
    print("variant | span us | busy us | step us | wall us | host waits us")
    for row in spans:
        print(" | ".join(row))


if __name__ == "__main__":
    main()
