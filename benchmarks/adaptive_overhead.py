"""What the adaptive draft budget costs a step, apart from its choices: plain decoding, a fixed
K = k, the adaptive budget (max K), and the adaptive budget pinned at k (the controller runs
and learns, its choice is ignored), on `never_slower.py`'s cells. With `--k 0`, the budget
pinned at 0 with the drafter's KV kept on every step (tracked k = 0: the draft prefill's forward
runs) takes fixed K's row; "adaptive@0" runs no drafter once 16 decisions pass without drafts.
Per configuration and repeat: output tok/s, steps, wall ms a step, ms a step the host waited
for the device, and the controller's host time a step. Pinned at k against fixed K = k is the
whole overhead of the adaptive engine at the same drafts; the controller's time is the host's
part of it.

    python benchmarks/adaptive_overhead.py                          # Llama-3-8B, c = 64, r = 0.3
    python benchmarks/adaptive_overhead.py --shape gpt-oss-20b --concurrency 1 --rate 0.7 --k 3 --max-k 3
    python benchmarks/adaptive_overhead.py --k 0                    # tracked k = 0 against plain
    python benchmarks/adaptive_overhead.py --device cpu --shape tiny --concurrency 4 --output-len 32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import never_slower as ns  # noqa: E402
from _common import write_json  # noqa: E402

from specserve.spec_decode.dynamic import DraftBudget  # noqa: E402


class TimedBudget(DraftBudget):
    """The controller, its host time summed in `spent`; `pin` overrides its choice."""

    pin: int | None = None
    track: bool | None = None  # overrides `tracks_drafter_kv`
    spent: float = 0.0

    @property
    def tracks_drafter_kv(self) -> bool:
        return super().tracks_drafter_kv if self.track is None else self.track

    def choose(self, batch: int, requests: list[tuple[str, bool]]) -> int:
        t = time.perf_counter()
        k = super().choose(batch, requests)
        self.spent += time.perf_counter() - t
        return k if self.pin is None else self.pin

    def record_step(self, batch: int, k: int, seconds: float, tracked: bool = False) -> None:
        t = time.perf_counter()
        super().record_step(batch, k, seconds, tracked)
        self.spent += time.perf_counter() - t

    def record_acceptances(self, *args: Any) -> None:
        t = time.perf_counter()
        super().record_acceptances(*args)
        self.spent += time.perf_counter() - t


def measure(
    llm: Any, args: argparse.Namespace, vocab: int, pin: int | None, track: bool | None
) -> dict:
    """One repeat: the cell's output tok/s and per-step times."""
    eng = llm.engine
    runner = eng.runner
    finish = runner.finish
    waited = [0.0, 0]

    def timed_finish(pending: Any) -> Any:
        t = time.perf_counter()
        out = finish(pending)
        waited[0] += time.perf_counter() - t
        waited[1] += 1
        return out

    if eng.budget is not None:
        eng.budget = TimedBudget(eng.budget.max_k)
        eng.budget.pin, eng.budget.track = pin, track
    runner.finish = timed_finish
    try:
        t0 = time.perf_counter()
        tps = ns.run_cell(llm, args.concurrency, args.output_len, vocab, 2)
        wall = time.perf_counter() - t0
    finally:
        del runner.finish  # the bound method again (no cycle keeps the engine alive)
    n = max(waited[1], 1)
    return {
        "tok_s": tps,
        "steps": waited[1],
        "step_ms": 1e3 * wall / n,
        "wait_ms": 1e3 * waited[0] / n,
        "controller_us": 1e6 * eng.budget.spent / n if eng.budget is not None else 0.0,
        "mean_k": eng.budget.mean_budget if eng.budget is not None else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="llama3-8b", choices=("llama3-8b", "gpt-oss-20b", "tiny"))
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rate", type=float, default=0.3)
    ap.add_argument("--k", type=int, default=1, help="the fixed K, and the pinned k")
    ap.add_argument("--max-k", type=int, default=5)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    root = os.path.join(os.environ.get("OUT", "/tmp"), "adaptive_overhead_models")
    target, head = ns.write_dirs(root, args.shape)[args.shape]
    with open(os.path.join(target, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    result: dict[str, Any] = {"meta": {"command": " ".join(sys.argv)}, "rows": []}
    configs = [
        ("plain", None, False, None, None),
        (f"K={args.k}", args.k, False, None, None),
        ("adaptive", args.max_k, True, None, None),
        (f"adaptive@{args.k}", args.max_k, True, args.k, None),
    ]
    if args.k == 0:  # K = 0 is plain decoding: tracked k = 0 instead
        configs[1] = ("adaptive@0 tracked", args.max_k, True, 0, True)
    for label, k, adaptive, pin, track in configs:
        spec = None
        if k is not None:
            spec = {
                "method": "eagle3", "model": head, "num_speculative_tokens": k,
                "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": args.rate,
                "adaptive": adaptive,
            }  # fmt: skip
        llm = ns.make_llm(target, spec, args.concurrency, args.device)
        ns.run_cell(llm, args.concurrency, 16, vocab, 1)  # warm
        for rep in range(args.reps):
            row = {"config": label, "rep": rep, **measure(llm, args, vocab, pin, track)}
            result["rows"].append(row)
            print(f"  {label} rep {rep}: {row['tok_s']:.1f} tok/s", flush=True)
        del llm
        gc.collect()  # the next engine sizes its KV cache from the memory this one frees
        if args.device == "cuda":
            import torch

            torch.cuda.empty_cache()
            result["meta"]["device"] = torch.cuda.get_device_name()
        write_json("adaptive_overhead.json", result)
    print(f"\n{args.shape} c = {args.concurrency} r = {args.rate} ({args.output_len} tokens)")
    print(
        f"{'config':>18} rep {'tok/s':>9} {'steps':>6} {'step ms':>8} {'wait ms':>8} {'ctl us':>7}"
    )
    for r in result["rows"]:
        print(
            f"{r['config']:>18} {r['rep']:>3} {r['tok_s']:9.1f} {r['steps']:6d} "
            f"{r['step_ms']:8.2f} {r['wait_ms']:8.2f} {r['controller_us']:7.0f}"
        )


if __name__ == "__main__":
    main()
