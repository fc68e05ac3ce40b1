"""`specserve bench serve ...` and `specserve bench compare ...` (flags as `vllm bench serve`)."""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmark a running server")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    add_serve_args(bsub.add_parser("serve", help="load a server and report latency/throughput"))
    c = bsub.add_parser("compare", help="side-by-side table of saved `bench serve` results")
    c.add_argument("results", nargs="+", metavar="RESULT.json", help="first = before/baseline")
    c.add_argument("--plot", default=None, metavar="FILE.png", help="throughput/TPOT plot")
    c.set_defaults(func=_compare)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from specserve.bench.datasets import DATASETS
    from specserve.bench.endpoint import BACKENDS

    p.add_argument("--backend", default="openai", choices=list(BACKENDS))
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: --model / root)")
    p.add_argument("--dataset-name", default="random", choices=list(DATASETS))
    p.add_argument("--dataset-path", default=None, help="jsonl with a `prompt` field (custom)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1024, help="random dataset prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="max tokens per request")
    # vLLM's prefix_repetition flags and defaults
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    p.add_argument("--prefix-repetition-output-len", type=int, default=128)
    p.add_argument(
        "--multi-turn-num-conversations", type=int, default=8, help="multi-turn: conversations"
    )
    p.add_argument("--multi-turn-num-turns", type=int, default=4, help="multi-turn: turns each")
    p.add_argument(
        "--multi-turn-input-len", type=int, default=128, help="multi-turn: new tokens per turn"
    )
    p.add_argument(
        "--multi-turn-output-len", type=int, default=64, help="multi-turn: max tokens per turn"
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson req/s (inf: all at once)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="(always on for random)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (vLLM's default: 0)"
    )
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true", help="keep per-request lists")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--label", default=None, help="result label (default: the backend)")
    p.add_argument(
        "--sweep-max-concurrency", default=None, metavar="1,16,64", help="one run per value"
    )
    p.add_argument(
        "--sweep-num-prompts-factor",
        type=int,
        default=None,
        help="sweep runs use concurrency x this many prompts (default: --num-prompts)",
    )
    p.add_argument("--ready-check-timeout-sec", type=float, default=600)
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from specserve.bench.serve import cmd_bench_serve

    return cmd_bench_serve(args)


def _compare(args: argparse.Namespace) -> int:
    from specserve.bench.compare import cmd_bench_compare

    return cmd_bench_compare(args)
