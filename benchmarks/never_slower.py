"""Speculation that never loses: output tokens/s of the adaptive draft budget against plain
decoding and every fixed K, across acceptance and load.

Cells (offline, N requests at once with max_num_seqs = N, 128-token random prompts, ignore_eos):
  llama3-8b   Llama-3-8B shape, dummy weights, an EAGLE-3-shaped head (serve_shape.py);
              synthetic acceptance r in {0.3, 0.6, 0.85}; concurrency 1 / 16 / 64;
              plain, fixed K = 1..5 (adaptive=false), adaptive (max K = 5)
  gpt-oss-20b gpt-oss-20b shape with MXFP4 experts and its EAGLE-3-shaped head
              (gpt_oss_decode.py); r = 0.7; concurrency 1 / 16; plain, K = 1..3, adaptive
One engine per configuration serves all its cells (the synthetic rate is read per step; the
adaptive budget starts afresh in every cell, so its learning is part of the measurement).
Prints a table of tok/s and ratios to plain; $OUT/never_slower.json, which also holds each
adaptive cell's decisions (the k chosen at each step) and its measured step costs per batch bucket
and k, so that a cell that misses can be read without another run.

    python benchmarks/never_slower.py                   # one H100, ~8 min (estimate)
    python benchmarks/never_slower.py --only llama3-8b  # or gpt-oss-20b: one half
    python benchmarks/never_slower.py --quick           # 128 output tokens, fewer K
    python benchmarks/never_slower.py --only llama3-8b --rates 0.3 --concurrency 64  # one cell
    python benchmarks/never_slower.py --device cpu --shape tiny --quick   # code paths only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402

PROMPT_LEN = 128


def write_dirs(root: str, shape: str) -> dict[str, tuple[str, str]]:
    """shape name -> (target dir, EAGLE-3 head dir), configs only (dummy weights)."""
    from serve_shape import write_shape

    out = {}
    if shape in ("all", "llama3-8b", "tiny"):
        name = "tiny" if shape == "tiny" else "llama3-8b"
        out[name] = write_shape(root, name)
    if shape in ("all", "gpt-oss-20b"):
        from gpt_oss_decode import GPT_OSS_20B, GPT_OSS_EAGLE3

        dirs = []
        for sub, cfg in (
            ("gpt-oss-20b-target", GPT_OSS_20B),
            ("gpt-oss-20b-eagle3", GPT_OSS_EAGLE3),
        ):
            path = os.path.join(root, sub)
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(cfg, f, indent=1)
            dirs.append(path)
        out["gpt-oss-20b"] = (dirs[0], dirs[1])
    return out


def make_llm(target: str, spec: dict | None, max_seqs: int, device: str) -> Any:
    from specserve import LLM

    return LLM(
        target,
        dtype="bfloat16" if device == "cuda" else "float32",
        device=device,
        load_format="dummy",
        max_model_len=PROMPT_LEN + 640,
        max_num_seqs=max_seqs,
        speculative_config=spec,
        gpu_memory_utilization=0.85,
        disable_log_stats=True,
    )


def run_cell(llm: Any, n: int, out_len: int, vocab: int, seed: int) -> float:
    """Output tokens per second of `n` requests of `out_len` tokens sent at once."""
    import numpy as np

    from specserve import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [
        {"prompt_token_ids": rng.integers(10, vocab - 10, PROMPT_LEN).tolist()} for _ in range(n)
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def configs(max_k: int, quick: bool) -> list[tuple[str, int | None, bool]]:
    """(label, K or None for plain, adaptive)."""
    ks = [1, 3, max_k] if quick else list(range(1, max_k + 1))
    return (
        [("plain", None, False)]
        + [(f"K={k}", k, False) for k in sorted(set(ks))]
        + [("adaptive", max_k, True)]
    )


def traced_budget(max_k: int) -> Any:
    """A DraftBudget that keeps its decisions, step samples and their order (what the JSON
    reports)."""
    import numpy as np

    from specserve.spec_decode.dynamic import DraftBudget

    class Traced(DraftBudget):
        def __init__(self, max_k: int) -> None:
            super().__init__(max_k)
            self.choices: list[int] = []
            self.samples: dict[str, list[float]] = {}
            # In order: the batch of each decision, each recorded step as [batch, k, ms,
            # tracked], and "end" where a request ended (where a cell's costs moved, and why).
            self.trace: list[int | str | list] = []
            self.ended: set[str] = set()

        def choose(self, batch: int, requests: list[tuple[str, bool]]) -> int:
            k = super().choose(batch, requests)
            self.choices.append(k)
            self.trace.append(batch)
            return k

        def record_step(self, batch: int, k: int, seconds: float, tracked: bool = False) -> None:
            key = f"b{self.bucket(batch)} k{k}{' tracked' * tracked}"
            self.samples.setdefault(key, []).append(seconds * 1e3)
            self.trace.append([batch, k, round(seconds * 1e3, 3), tracked])
            super().record_step(batch, k, seconds, tracked)

        def forget(self, request_id: str) -> None:
            if request_id not in self.ended:  # (the engine may forget a request twice)
                self.ended.add(request_id)
                self.trace.append("end")
            super().forget(request_id)

        def restart_trace(self) -> None:
            """Forget the decisions and samples kept so far (not what the budget learned):
            `report` and `mean_budget` then cover what follows."""
            self.choices, self.samples, self.trace = [], {}, []
            self._budget_sum, self._budget_n = 0.0, 0

        def report(self) -> dict:
            pct = lambda v, q: round(float(np.percentile(v, q)), 2)  # noqa: E731
            return {
                "choices": "".join(map(str, self.choices)),
                "cost_table_ms": {
                    b: [None if np.isnan(x) else round(1e3 * x, 2) for x in c.table()]
                    for b, c in self.costs.items()
                },
                "step_ms": {
                    key: {"n": len(v), "p10": pct(v, 10), "p50": pct(v, 50), "p90": pct(v, 90)}
                    for key, v in sorted(self.samples.items())
                },
                # a copy: the next cell's warm-up still runs with this budget
                "trace": list(self.trace),
            }

    return Traced(max_k)


def bench_shape(
    name: str, dirs: tuple[str, str], rates: list[float], concs: list[int], max_k: int,
    args: argparse.Namespace, result: dict,
) -> None:  # fmt: skip
    target, head = dirs
    with open(os.path.join(target, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    cells = result.setdefault(name, {})
    for label, k, adaptive in configs(max_k, args.quick):
        spec = None
        if k is not None:
            spec = {
                "method": "eagle3", "model": head, "num_speculative_tokens": k,
                "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": rates[0],
                "adaptive": adaptive,
            }  # fmt: skip
        t0 = time.perf_counter()
        llm = make_llm(target, spec, max(concs), args.device)
        build = time.perf_counter() - t0
        eng = llm.engine
        for conc in concs:
            run_cell(llm, conc, 16, vocab, 1)  # warm: compiles of this batch's shapes
            for r in rates if spec is not None else [None]:
                if spec is not None:
                    eng.config.spec.synthetic_acceptance_rate = r
                if eng.budget is not None:
                    eng.budget = traced_budget(max_k)
                tps = run_cell(llm, conc, args.output_len, vocab, 2)
                m = llm.get_metrics()
                cell = cells.setdefault(f"c{conc}", {}).setdefault(label, {})[str(r)] = {
                    "tok_s": tps,
                    "mean_draft_budget": m.get("spec_decode_mean_draft_budget"),
                }
                if eng.budget is not None:
                    cell["budget"] = eng.budget.report()
                print(f"  {name} {label:>8} c={conc:<3} r={r}: {tps:8.1f} tok/s", flush=True)
        print(f"  ({label}: built in {build:.0f} s)", flush=True)
        del llm, eng
        write_json("never_slower.json", result)


def table(result: dict, rates: dict[str, list[float]]) -> list[str]:
    lines = []
    for name, by_conc in result.items():
        if not isinstance(by_conc, dict) or name in ("meta",):
            continue
        for conc, by_label in by_conc.items():
            plain = by_label.get("plain", {}).get("None", {}).get("tok_s")
            for r in rates[name]:
                row = {lab: v.get(str(r), {}).get("tok_s") for lab, v in by_label.items()}
                row["plain"] = plain
                fixed = [v for lab, v in row.items() if lab.startswith("K=") and v]
                best = max([plain or 0, *fixed])
                ad = row.get("adaptive")
                if not ad or not plain:
                    continue
                budget = by_label["adaptive"][str(r)]["mean_draft_budget"]
                lines.append(
                    f"{name:<12} {conc:>4} r={r:<5} plain {plain:9.1f}  best fixed "
                    f"{max(fixed) if fixed else 0:9.1f}  adaptive {ad:9.1f}  "
                    f"x plain {ad / plain:5.2f}  x best {ad / best:5.2f}  mean K {budget:.2f}"
                )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="all", choices=("all", "llama3-8b", "gpt-oss-20b", "tiny"))
    ap.add_argument("--only", default=None, choices=("llama3-8b", "gpt-oss-20b"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--rates", default=None, help="comma-separated subset of each shape's rates")
    ap.add_argument("--concurrency", default=None, help="comma-separated subset of concurrencies")
    args = ap.parse_args()
    shape = args.only or args.shape
    if args.output_len is None:
        args.output_len = 128 if args.quick else 512
    root = os.path.join(os.environ.get("OUT", "/tmp"), "never_slower_models")
    dirs = write_dirs(root, shape)
    plan = {
        "llama3-8b": ([0.3, 0.6, 0.85], [1, 16, 64], 5),
        "tiny": ([0.3, 0.85], [1, 4], 3),
        "gpt-oss-20b": ([0.7], [1, 16], 3),
    }
    if args.quick:
        plan["llama3-8b"] = ([0.3, 0.85], [1, 64], 5)
    for name, (rates, concs, max_k) in plan.items():
        if args.rates:
            rates = [r for r in rates if str(r) in args.rates.split(",")]
        if args.concurrency:
            concs = [c for c in concs if str(c) in args.concurrency.split(",")]
        plan[name] = (rates, concs, max_k)
    import torch

    result: dict[str, Any] = {
        "meta": {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "command": " ".join(sys.argv),
            "output_len": args.output_len,
        }
    }
    t0 = time.perf_counter()
    for name, d in dirs.items():
        rates, concs, max_k = plan[name]
        bench_shape(name, d, rates, concs, max_k, args, result)
    path = write_json("never_slower.json", result)
    print(f"\n{time.perf_counter() - t0:.0f} s; wrote {path}")
    if args.device == "cpu":
        print("(CPU: other processes shared the cores; the tiny shape checks code paths only)")
    print("\n".join(table(result, {n: plan[n][0] for n in dirs})))


if __name__ == "__main__":
    main()
