"""Prefix caching under speculative decoding, served: `specserve serve` (Llama-3-8B shape, dummy
weights, EAGLE-3-shaped head, K = 3, synthetic acceptance 0.7, adaptive K off) driven by
`specserve bench serve`, caching on vs off (`--no-enable-prefix-caching`).

  multi-turn         32 conversations x 8 turns of 128 new tokens + 128 answer tokens (the
                     last turn resends ~1.9k tokens of history), concurrency 8: mean TTFT at
                     turn 1 and turn 8 (and their ratio), prefix-cache hit rate, TPOT; and the
                     hit rate with speculation off (caching on) beside the one with it on.
  prefix_repetition  4 prefixes of 2,000 tokens, 100-token suffixes, 256 output tokens,
                     concurrency 1 / 16 / 64: output throughput and mean TTFT.

Three servers, one after another (serve_sweep.py's helpers, serve_shape.py's model dirs):
EAGLE-3 with caching (both workloads), EAGLE-3 without (both), plain with caching (multi-turn).
Each first runs a short random-prompt warm-up (its prompts share nothing with the measured ones)
so Triton compiles stay out of the figures.

    python benchmarks/prefix_cache.py --quick            # fewer prompts: one 10-minute call
    python benchmarks/prefix_cache.py                    # the full counts
    python benchmarks/prefix_cache.py --device cpu --shape tiny   # CPU smoke run, tiny sizes

bench serve's JSON is kept in --result-dir and copied to $OUT with a summary
(prefix_cache.json); the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import out_dir, write_json  # noqa: E402
from serve_shape import write_shape  # noqa: E402
from serve_sweep import serve_cmd, sh, wait_healthy  # noqa: E402

SPEC = {
    "method": "eagle3",
    "num_speculative_tokens": 3,
    "rejection_sample_method": "synthetic",
    "synthetic_acceptance_rate": 0.7,
    "adaptive": False,
}

# Workload sizes: (full, --quick, tiny smoke).
SIZES = {
    "full": {
        "mt_convs": 32, "mt_turns": 8, "mt_in": 128, "mt_out": 128, "mt_conc": 8,
        "pr_prefix": 2000, "pr_suffix": 100, "pr_num_prefixes": 4, "pr_out": 256,
        "pr_concs": (1, 16, 64), "pr_prompts": lambda c: max(16, 4 * c),
        "warm_in": 2048, "warm_out": 32, "warm_n": 16, "max_len": 4096,
    },
    "quick": {
        "mt_convs": 16, "mt_turns": 8, "mt_in": 128, "mt_out": 128, "mt_conc": 8,
        "pr_prefix": 2000, "pr_suffix": 100, "pr_num_prefixes": 4, "pr_out": 256,
        "pr_concs": (1, 16, 64), "pr_prompts": lambda c: max(8, 2 * c),
        "warm_in": 2048, "warm_out": 16, "warm_n": 16, "max_len": 4096,
    },
    "tiny": {
        "mt_convs": 4, "mt_turns": 8, "mt_in": 16, "mt_out": 8, "mt_conc": 2,
        "pr_prefix": 200, "pr_suffix": 10, "pr_num_prefixes": 2, "pr_out": 8,
        "pr_concs": (1, 4), "pr_prompts": lambda c: 2 * c,
        "warm_in": 64, "warm_out": 4, "warm_n": 2, "max_len": 1024,
    },
}  # fmt: skip

# (label, speculation, prefix caching, workloads)
CONFIGS = (
    ("eagle3-cache", True, True, ("multi-turn", "prefix_repetition")),
    ("eagle3-nocache", True, False, ("multi-turn", "prefix_repetition")),
    ("plain-cache", False, True, ("multi-turn",)),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=("llama3-8b", "tiny"))
    ap.add_argument("--device", default="auto", help="the server's --device (cpu: smoke run)")
    ap.add_argument("--quick", action="store_true", help="fewer prompts (one 10-minute call)")
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--labels", default=",".join(c[0] for c in CONFIGS), help="servers to run")
    ap.add_argument("--result-dir", default="/tmp/prefix_cache")
    args = ap.parse_args(argv)
    args.size = "tiny" if args.shape == "tiny" else "quick" if args.quick else "full"
    bad = set(args.labels.split(",")) - {c[0] for c in CONFIGS}
    if bad:
        raise SystemExit(f"unknown --labels: {', '.join(sorted(bad))}")
    return args


def bench(args: argparse.Namespace, url: str, target: str, name: str, flags: list[str]) -> dict:
    """One `bench serve` run saved as <result-dir>/<name>.json; returns its result dict."""
    sh([sys.executable, "-m", "specserve.entrypoints.cli", "bench", "serve", "--base-url", url,
        "--model", target, "--temperature", "0", "--disable-tqdm", "--save-result",
        "--result-dir", args.result_dir, "--result-filename", f"{name}.json", "--label", name,
        *flags])  # fmt: skip
    with open(os.path.join(args.result_dir, f"{name}.json")) as f:
        return json.load(f)


def server_cmd(args: argparse.Namespace, target: str, spec: dict | None, cache: bool) -> list[str]:
    """`specserve serve` for one configuration (serve_sweep's command)."""
    s = SIZES[args.size]
    # serve_sweep's command sizes --max-model-len as input + output + 64.
    ns = argparse.Namespace(shape=args.shape, port=args.port, max_num_seqs=args.max_num_seqs,
                            device=args.device, input_len=s["max_len"] - 64, output_len=0,
                            async_scheduling=None, tensor_parallel_size=1)  # fmt: skip
    cmd = serve_cmd(ns, target, spec)
    return cmd if cache else [*cmd, "--no-enable-prefix-caching"]


def run_server(
    args: argparse.Namespace, target: str, label: str, spec: dict | None, cache: bool, work: tuple
) -> dict:
    s = SIZES[args.size]
    cmd = server_cmd(args, target, spec, cache)
    url = f"http://127.0.0.1:{args.port}"
    log = os.path.join(args.result_dir, f"{label}-server.log")
    print("+", " ".join(cmd), f"> {log}", flush=True)
    with open(log, "w") as f:
        server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    res: dict = {}
    try:
        up = wait_healthy(url, server, log)
        print(f"{label}: the server answered /health after {up:.1f} s", flush=True)
        t0 = time.monotonic()
        bench(args, url, target, f"{label}-warmup", ["--dataset-name", "random", "--seed", "1234",
              "--input-len", str(s["warm_in"]), "--output-len", str(s["warm_out"]),
              "--num-prompts", str(s["warm_n"]), "--max-concurrency", str(s["warm_n"])])  # fmt: skip
        print(f"{label}: warm-up {time.monotonic() - t0:.1f} s", flush=True)
        if "multi-turn" in work:
            res["multi-turn"] = bench(args, url, target, f"{label}-multiturn", [
                "--dataset-name", "multi-turn",
                "--multi-turn-num-conversations", str(s["mt_convs"]),
                "--multi-turn-num-turns", str(s["mt_turns"]),
                "--multi-turn-input-len", str(s["mt_in"]),
                "--multi-turn-output-len", str(s["mt_out"]),
                "--max-concurrency", str(s["mt_conc"])])  # fmt: skip
        if "prefix_repetition" in work:
            for c in s["pr_concs"]:
                res[f"prefix_repetition-c{c}"] = bench(args, url, target, f"{label}-prefix-c{c}", [
                    "--dataset-name", "prefix_repetition",
                    "--prefix-repetition-prefix-len", str(s["pr_prefix"]),
                    "--prefix-repetition-suffix-len", str(s["pr_suffix"]),
                    "--prefix-repetition-num-prefixes", str(s["pr_num_prefixes"]),
                    "--prefix-repetition-output-len", str(s["pr_out"]),
                    "--num-prompts", str(s["pr_prompts"](c)), "--max-concurrency", str(c)])  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=120)
    return res


def _f(x: object, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def summarize(results: dict, mt_conc: int) -> tuple[dict, list[str]]:
    summary: dict = {"multi-turn": {}, "prefix_repetition": {}}
    lines = [f"multi-turn (concurrency {mt_conc}):",
             f"{'server':16} {'TTFT t1 ms':>10} {'TTFT t8 ms':>10} {'t8/t1':>6} "
             f"{'hit %':>6} {'TPOT ms':>8} {'accept len':>10}"]  # fmt: skip
    for label, res in results.items():
        r = res.get("multi-turn")
        if not r:
            continue
        by_turn = r.get("mean_ttft_ms_by_turn") or [None]
        t1, tn = by_turn[0], by_turn[-1]
        row = {
            "ttft_turn1_ms": t1,
            f"ttft_turn{len(by_turn)}_ms": tn,
            "ttft_last_over_first": tn / t1 if t1 and tn is not None else None,
            "prefix_cache_hit_rate": r.get("prefix_cache_hit_rate"),
            "mean_tpot_ms": r.get("mean_tpot_ms"),
            "acceptance_length": r.get("spec_decode_acceptance_length"),
            "mean_ttft_ms_by_turn": by_turn,
        }
        summary["multi-turn"][label] = row
        lines.append(f"{label:16} {_f(t1):>10} {_f(tn):>10} {_f(row['ttft_last_over_first'], '.2f'):>6} "
                     f"{_f(row['prefix_cache_hit_rate']):>6} {_f(row['mean_tpot_ms'], '.2f'):>8} "
                     f"{_f(row['acceptance_length'], '.2f'):>10}")  # fmt: skip
    lines += ["prefix_repetition:",
              f"{'server':16} {'conc':>5} {'out tok/s':>10} {'TTFT ms':>9} {'hit %':>6}"]  # fmt: skip
    for label, res in results.items():
        for key, r in res.items():
            if not key.startswith("prefix_repetition"):
                continue
            c = r.get("max_concurrency")
            row = {k: r.get(k) for k in ("output_throughput", "mean_ttft_ms",
                                         "prefix_cache_hit_rate", "mean_tpot_ms")}  # fmt: skip
            summary["prefix_repetition"].setdefault(label, {})[str(c)] = row
            lines.append(f"{label:16} {c:>5} {_f(row['output_throughput']):>10} "
                         f"{_f(row['mean_ttft_ms']):>9} {_f(row['prefix_cache_hit_rate']):>6}")  # fmt: skip
    return summary, lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.makedirs(args.result_dir, exist_ok=True)
    target, head = write_shape(os.path.join(args.result_dir, "models"), args.shape)
    results: dict = {}
    for label, spec_on, cache, work in CONFIGS:
        if label in args.labels.split(","):
            spec = {**SPEC, "model": head} if spec_on else None
            results[label] = run_server(args, target, label, spec, cache, work)
    summary, lines = summarize(results, SIZES[args.size]["mt_conc"])
    for name in os.listdir(args.result_dir):
        if name.endswith((".json", ".log")):
            shutil.copy(os.path.join(args.result_dir, name), out_dir())
    sizes = {k: v for k, v in SIZES[args.size].items() if not callable(v)}
    path = write_json("prefix_cache.json", {"shape": args.shape, "device": args.device,
                                            "size": args.size, "sizes": sizes, "spec": SPEC,
                                            "summary": summary, "runs": results})  # fmt: skip
    print(f"wrote {path}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
