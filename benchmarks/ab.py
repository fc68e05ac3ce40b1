"""Any benchmark script under module switches, one fresh process per variant.

    python benchmarks/ab.py --variants "base;specserve.attention.triton_paged.PROGRAMS_PER_SM=4" \
        --tail 6 -- benchmarks/spec_step.py --ks 4 --batches 16 --modes fused

A variant is `;`-separated from the next and sets `module.NAME=value` pairs (`,`-separated; a
value is a Python expression, commas inside it allowed: `M.TABLE=((1, 2),)`) before the script
runs, so compiled kernels and plans do not leak between variants. Each variant's last `--tail`
output lines are printed under a `### variant` header (benchmarks/timeline_sweep.py is this
for timeline.py, with a summary table).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# argv: the variant's assignments, the script, then the script's arguments.
RUNNER = r"""
import importlib, re, runpy, sys
for pair in filter(None, re.split(r",(?=[A-Za-z_][\w.]*=)", sys.argv[1])):
    name, value = pair.split("=", 1)
    mod, attr = name.rsplit(".", 1)
    setattr(importlib.import_module(mod), attr, eval(value))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_variant(variant: str, script: list[str]) -> str:
    """stdout of `script` (path and arguments) in a fresh process with `variant` set."""
    sets = "" if variant == "base" else variant
    cmd = [sys.executable, "-c", RUNNER, sets, *script]
    return subprocess.run(cmd, capture_output=True, text=True, env=os.environ).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", required=True)
    ap.add_argument("--tail", type=int, default=12, help="output lines kept per variant")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [its arguments]")
    args = ap.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    for variant in args.variants.split(";"):
        out = run_variant(variant, script).splitlines()
        print(f"### {variant}", *out[-args.tail :], sep="\n", flush=True)


if __name__ == "__main__":
    main()
