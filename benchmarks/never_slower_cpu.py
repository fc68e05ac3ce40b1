"""The default model on the CPU (SmolLM2-135M-Instruct with its EAGLE-3 head, K = 3, as
`specserve generate` runs it): output tokens/s with its shipped speculative configuration
(the adaptive budget on by default, and the fixed K = 3 for reference) against no
speculation, on chat prompts and on copy tasks (prompts asking to repeat a given text), at
T = 0 and T = 1 (seeded), batch 1 and 6. All ratios come from one run: each cell runs its
engines back to back `--repeats` times (`--batched-repeats` at batch 6), in a rotated order
each time (a slow spell of the shared cores then falls on every engine alike), and reports
each engine's median; outputs are checked to equal the plain run's token for token. The JSON
keeps each adaptive run's decisions and step-time samples (never_slower.py's trace).

The adaptive budget is measured twice, as two engines of the rotation sharing one model:
  adaptive        as a server runs it: each cell starts the budget afresh and gives it one
                  untimed run of the cell's prompts; it then keeps what it learns (step costs
                  per batch bucket, acceptance per temperature class) from run to run;
  adaptive, cold  a fresh budget before every timed run: each run (at batch 6, ~60 steps)
                  also pays the budget's first visit (K, then 0) and its first probe.

    python benchmarks/never_slower_cpu.py             # ~27 min on 2 cores
    python benchmarks/never_slower_cpu.py --max-tokens 32 --repeats 1 --batched-repeats 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402
from never_slower import traced_budget  # noqa: E402

COPY_TEXT = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital "
    "of Italy.",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20",
]


def prompts(kind: str, tok: Any, n: int) -> list[list[int]]:
    from specserve.data import load_prompts

    if kind == "chat":
        texts = [r["prompt"] for r in load_prompts("chat")][:n]
    else:
        texts = [f"Repeat the following text exactly, and nothing else:\n\n{t}" for t in COPY_TEXT]
        texts = (texts * n)[:n]
    out = []
    for t in texts:
        chat = [{"role": "user", "content": t}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def timed(llm: Any, ps: list[list[int]], sp: Any, batch: int) -> tuple[float, list[list[int]]]:
    """Tokens/s over the prompts sent `batch` at a time; the outputs."""
    outs: list[list[int]] = []
    n_tok, t0 = 0, time.perf_counter()
    for i in range(0, len(ps), batch):
        chunk = [{"prompt_token_ids": p} for p in ps[i : i + batch]]
        for o in llm.generate(chunk, sp, use_tqdm=False):
            outs.append(list(o.outputs[0].token_ids))
            n_tok += len(o.outputs[0].token_ids)
    return n_tok / (time.perf_counter() - t0), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="prompt sets per cell")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine, batch-1 cells")
    ap.add_argument(
        "--batched-repeats", type=int, default=9,
        help="timed runs per engine, batch-6 cells (each run is a quarter of a batch-1 run's "
        "time; the cores' slow spells last tens of seconds, so three runs left a cell's ratio "
        "to chance: plain's runs spread 40-62 tok/s within one cell)",
    )  # fmt: skip
    ap.add_argument(
        "--cells", default=None, help="only these cells, as kind:T:B,... (e.g. chat:1:6)"
    )
    args = ap.parse_args()
    only = None if args.cells is None else set(args.cells.split(","))
    import numpy as np
    import torch

    from specserve import LLM, SamplingParams
    from specserve.data import default_model

    gguf, spec = default_model()
    common = dict(max_model_len=1024, max_num_seqs=6, disable_log_stats=True)
    adaptive = LLM(gguf, speculative_config=spec, **common)
    engines = {
        "plain": LLM(gguf, speculative_config=None, **common),
        "adaptive": adaptive,
        "adaptive, cold": adaptive,
        "fixed K=3": LLM(gguf, speculative_config={**spec, "adaptive": False}, **common),
    }
    budgeted = ("adaptive", "adaptive, cold")
    max_k = spec["num_speculative_tokens"]
    tok = engines["plain"].engine.tokenizer
    rows, result = [], {"torch_threads": torch.get_num_threads(), "cells": []}
    for kind in ("chat", "copy"):
        for temp in (0.0, 1.0):
            for batch in (1, 6):
                if only is not None and f"{kind}:{temp:g}:{batch}" not in only:
                    continue
                ps = prompts(kind, tok, 6 * args.rounds)
                sp = SamplingParams(temperature=temp, seed=7, max_tokens=args.max_tokens)
                cell: dict[str, Any] = {"kind": kind, "T": temp, "batch": batch}
                names = list(engines)
                runs: dict[str, list[float]] = {n: [] for n in names}
                budgets: dict[str, list[float]] = {n: [] for n in budgeted}
                ref = timed(engines["plain"], ps, sp, batch)[1]  # also warms this cell's shapes
                served = adaptive.engine.budget = traced_budget(max_k)
                timed(adaptive, ps, sp, batch)  # what a served engine has learned before
                repeats = args.repeats if batch == 1 else args.batched_repeats
                for rep in range(repeats):
                    turn = rep % len(names)
                    for name in names[turn:] + names[:turn]:
                        llm = engines[name]
                        if name == "adaptive":
                            served.restart_trace()  # this run's decisions alone
                            adaptive.engine.budget = served
                        elif name == "adaptive, cold":
                            adaptive.engine.budget = traced_budget(max_k)
                        tps, outs = timed(llm, ps, sp, batch)
                        runs[name].append(tps)
                        cell[f"{name} same"] = cell.get(f"{name} same", True) and outs == ref
                        if name in budgeted:
                            budget = llm.engine.budget
                            budgets[name].append(budget.mean_budget)
                            # Decisions and step-time samples: why a cell lost, if it did.
                            cell.setdefault(f"{name} budget", []).append(budget.report())
                for name in names:
                    cell[name] = float(np.median(runs[name]))
                    cell[f"{name} runs"] = runs[name]
                for name in budgeted:
                    cell[f"{name} mean K"] = float(np.mean(budgets[name]))
                result["cells"].append(cell)
                rows.append(cell)
                print(cell, flush=True)
                write_json("never_slower_cpu.json", result)
    print(
        f"\nCPU; tok/s, the median of {args.repeats} runs at B = 1 and {args.batched_repeats} "
        "at B = 6; ratios to plain from the same run"
    )
    print(f"{'prompts':<6} {'T':>3} {'B':>2} {'plain':>7} {'adaptive':>9} {'x':>5} {'mean K':>6} "
          f"{'cold':>7} {'x':>5} {'K=3':>7} {'x':>5} same")  # fmt: skip
    for c in rows:
        same = all(c[f"{n} same"] for n in ("adaptive", "adaptive, cold", "fixed K=3"))
        print(
            f"{c['kind']:<6} {c['T']:>3.0f} {c['batch']:>2} {c['plain']:7.1f} "
            f"{ratio(c, 'adaptive', 9)} {c['adaptive mean K']:6.2f} "
            f"{ratio(c, 'adaptive, cold', 7)} {ratio(c, 'fixed K=3', 7)} {same}"
        )


def ratio(cell: dict[str, Any], name: str, width: int) -> str:
    """An engine's tok/s and its ratio to plain's, as the table prints them."""
    return f"{cell[name]:{width}.1f} {cell[name] / cell['plain']:5.2f}"


if __name__ == "__main__":
    main()
