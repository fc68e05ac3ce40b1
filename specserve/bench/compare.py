"""`specserve bench compare A.json B.json ...`: a side-by-side markdown table of saved runs.

Each file is one `bench serve --save-result` output: a single run or a sweep (`runs`). For every
concurrency in the first file, the table shows each file's value and its change against the
first file (`Metric | Before (c=1) | After (c=1) | Delta | ...` for two files).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

# (row name, result key, higher is better)
ROWS = [
    ("Successful requests", "completed", True),
    ("Request throughput (req/s)", "request_throughput", True),
    ("Output token throughput (tok/s)", "output_throughput", True),
    ("Total token throughput (tok/s)", "total_token_throughput", True),
    *(
        (f"{stat.capitalize()} {name} (ms)", f"{stat}_{key}_ms", False)
        for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
        for stat in ("mean", "median", "p99", "max")
        if stat != "max" or key in ("ttft", "itl")  # the worst TTFT / ITL shows a stall
    ),
    ("Acceptance length", "spec_decode_acceptance_length", True),
    ("Acceptance rate (%)", "spec_decode_acceptance_rate", True),
]


def load_runs(path: str) -> tuple[str, dict[Any, dict[str, Any]]]:
    """(name, {max_concurrency: run}) of a saved result file."""
    with open(path) as f:
        doc = json.load(f)
    runs = doc["runs"] if isinstance(doc, dict) and "runs" in doc else [doc]
    if not runs or not all(isinstance(r, dict) and "completed" in r for r in runs):
        raise ValueError(f"{path} is not a `specserve bench serve --save-result` file.")
    name = doc.get("label") or os.path.splitext(os.path.basename(path))[0]
    return name, {r.get("max_concurrency"): r for r in runs}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _delta(base: Any, new: Any) -> str:
    if not isinstance(base, (int, float)) or not isinstance(new, (int, float)) or base == 0:
        return "-"
    return f"{100.0 * (new - base) / abs(base):+.1f}%"


def compare_table(files: list[tuple[str, dict[Any, dict[str, Any]]]]) -> str:
    names = ["Before", "After"] if len(files) == 2 else [n for n, _ in files]
    concs = list(files[0][1])
    header = ["Metric"]
    for c in concs:
        cs = f"c={c if c is not None else 'inf'}"
        header.append(f"{names[0]} ({cs})")
        for n in names[1:]:
            header += [f"{n} ({cs})", "Delta" if len(files) == 2 else f"Delta {n}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row, key, _ in ROWS:
        if not any(key in r for _, runs in files for r in runs.values()):
            continue  # e.g. no speculation anywhere
        cells = [row]
        for c in concs:
            base = files[0][1][c].get(key)
            cells.append(_fmt(base))
            for _, runs in files[1:]:
                new = runs.get(c, {}).get(key)
                cells += [_fmt(new), _delta(base, new)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cmd_bench_compare(args: argparse.Namespace) -> int:
    if len(args.results) < 2:
        raise ValueError("bench compare needs at least two result files.")
    files = [load_runs(p) for p in args.results]
    for i, (p, (name, runs)) in enumerate(zip(args.results, files)):
        role = ("Before" if i == 0 else "After") if len(files) == 2 else name
        concs = ", ".join(str(c) for c in runs)
        print(f"{role}: {p} (label {name}; max concurrency {concs})")
    print()
    print(compare_table(files))
    if args.plot:
        from specserve.bench.plot import plot_sweeps

        plot_sweeps(files, args.plot)
        print(f"\nSaved plot to {args.plot}")
    return 0
