"""`specserve bench serve`: load a running OpenAI-compatible server and report what vLLM's
`vllm bench serve` reports (same table layout, same JSON keys), plus speculative decoding
acceptance from the server's /metrics before and after the run.

With `--sweep-max-concurrency 1,16,64` it runs once per concurrency (`--num-prompts`, or
concurrency x `--sweep-num-prompts-factor` prompts each) and saves the runs in one JSON file,
which `specserve bench compare` reads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np

from specserve.bench.datasets import DatasetArgs, SampleRequest, sample_requests
from specserve.bench.endpoint import (
    BACKENDS,
    RequestFuncInput,
    RequestFuncOutput,
    fetch_prefix_cache_counters,
    fetch_spec_decode_counters,
    first_model,
    prefix_cache_delta,
    spec_decode_delta,
)
from specserve.bench.report import calculate_metrics, print_result

# Per-request lists vLLM drops from the saved JSON unless --save-detailed.
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


async def _arrivals(n: int, request_rate: float, rng: np.random.Generator) -> AsyncIterator[int]:
    """Yield 0..n-1 at Poisson arrival times (`request_rate` per second; inf: all at once)."""
    start = time.perf_counter()
    t = 0.0
    for i in range(n):
        if request_rate != float("inf"):
            wait = start + t - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            t += rng.exponential(1.0 / request_rate)
        yield i


async def benchmark(
    args: argparse.Namespace,
    session: aiohttp.ClientSession,
    base_url: str,
    model_id: str,
    requests: list[SampleRequest],
    max_concurrency: int | None,
) -> dict[str, Any]:
    func, endpoint = BACKENDS[args.backend]
    extra = {
        k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p)) if v is not None
    }

    def inp(r: SampleRequest, prompt: str | None = None, prompt_len: int = 0) -> RequestFuncInput:
        return RequestFuncInput(
            r.prompt if prompt is None else prompt,
            base_url + endpoint,
            prompt_len or r.prompt_len,
            r.expected_output_len,
            model_id,
            args.ignore_eos,
            extra,
        )

    if args.num_warmups > 0:
        print(f"Warming up with {args.num_warmups} requests...")
        await asyncio.gather(*(func(session, inp(requests[0])) for _ in range(args.num_warmups)))
        print("Warmup run completed.")
    print("Starting main benchmark run...")
    print(f"Traffic request rate: {args.request_rate}")
    print("Burstiness factor: 1.0 (Poisson process)")
    print(f"Maximum request concurrency: {max_concurrency}")

    before = await fetch_spec_decode_counters(session, base_url)
    cache_before = await fetch_prefix_cache_counters(session, base_url)
    pbar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        pbar = tqdm(total=len(requests))
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def limited(r: SampleRequest, prompt: str | None = None, n: int = 0) -> RequestFuncOutput:
        async with sem:
            out = await func(session, inp(r, prompt, n))
        if pbar is not None:
            pbar.update(1)
        return out

    async def conversation(turns: list[SampleRequest]) -> list[RequestFuncOutput]:
        """One multi-turn conversation: each turn resends the history (messages and the
        server's answers) plus its new message, after the previous turn's answer."""
        history: list[str] = []
        n_history, outs = 0, []
        for r in turns:
            prompt = "\n\n".join([*history, r.prompt])
            out = await limited(r, prompt, n_history + r.prompt_len)
            outs.append(out)
            history += [r.prompt, out.generated_text]
            n_history += r.prompt_len + out.output_tokens
        return outs

    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    convs = _conversations(requests)
    if convs is None:
        tasks = [
            asyncio.create_task(limited(requests[i]))
            async for i in _arrivals(len(requests), args.request_rate, rng)
        ]
        outputs = await asyncio.gather(*tasks)
    else:  # the request rate paces conversations; their turns follow one another
        conv_tasks = [
            asyncio.create_task(conversation(convs[i]))
            async for i in _arrivals(len(convs), args.request_rate, rng)
        ]
        outputs = [o for outs in await asyncio.gather(*conv_tasks) for o in outs]
    duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    after = await fetch_spec_decode_counters(session, base_url)
    cache_after = await fetch_prefix_cache_counters(session, base_url)

    result = calculate_metrics(outputs, duration, args.percentiles)
    if convs is not None:
        result.update(ttft_by_turn([r for c in convs for r in c], outputs))
    result.update(spec_decode_delta(before, after) or {})
    result.update(prefix_cache_delta(cache_before, cache_after))
    print_result(result, max_concurrency, args.request_rate, args.metrics, args.percentiles)
    return result


def _conversations(requests: list[SampleRequest]) -> list[list[SampleRequest]] | None:
    """The multi-turn dataset's requests grouped by conversation, turns in order (None: lone
    requests)."""
    if all(r.conversation < 0 for r in requests):
        return None
    convs: dict[int, list[SampleRequest]] = {}
    for r in requests:
        convs.setdefault(r.conversation, []).append(r)
    return [sorted(c, key=lambda r: r.turn) for _, c in sorted(convs.items())]


def ttft_by_turn(
    requests: list[SampleRequest], outputs: list[RequestFuncOutput]
) -> dict[str, list[float]]:
    """Mean and median TTFT (ms) of each turn index over the conversations: with a prefix
    cache, turns after the first compute only what the history does not already hold."""
    by_turn: dict[int, list[float]] = {}
    for r, o in zip(requests, outputs):
        if o.success:
            by_turn.setdefault(r.turn, []).append(o.ttft * 1000)
    turns = range(max(by_turn) + 1) if by_turn else range(0)
    return {
        "mean_ttft_ms_by_turn": [float(np.mean(by_turn.get(t, [0.0]))) for t in turns],
        "median_ttft_ms_by_turn": [float(np.median(by_turn.get(t, [0.0]))) for t in turns],
    }


def _tokenizer(args: argparse.Namespace, root: str) -> Any:
    path = args.tokenizer or (args.model if args.model and os.path.isdir(args.model) else root)
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a served name, not a directory, or no tokenizer files there
        if args.dataset_name in ("random", "prefix_repetition", "multi-turn"):
            raise ValueError(
                f"cannot load a tokenizer from {path!r} ({e}); pass --tokenizer DIR."
            ) from e
        return None


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    base_url = args.base_url.rstrip("/")
    if args.dataset_name in ("random", "prefix_repetition", "multi-turn"):
        args.ignore_eos = True  # as vLLM: random prompts run to the requested length
    sweep = _sweep(args)
    timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await wait_ready(session, base_url, args.ready_check_timeout_sec)
        model_id, root = args.model, args.model
        if model_id is None:
            model_id, root = await first_model(session, base_url)
            print(f"Model not specified, using the server's first model: {model_id}")
        tokenizer = _tokenizer(args, root)
        results = []
        for conc, num_prompts in sweep:
            data = DatasetArgs(
                args.dataset_name,
                num_prompts,
                args.output_len,
                args.input_len,
                args.dataset_path,
                args.seed,
                args.prefix_repetition_prefix_len,
                args.prefix_repetition_suffix_len,
                args.prefix_repetition_num_prefixes,
                args.prefix_repetition_output_len,
                args.multi_turn_num_conversations,
                args.multi_turn_num_turns,
                args.multi_turn_input_len,
                args.multi_turn_output_len,
            )
            requests = sample_requests(data, tokenizer)
            r = await benchmark(args, session, base_url, model_id, requests, conc)
            results.append(_with_config(args, r, model_id, len(requests), conc))
    return results


async def wait_ready(session: aiohttp.ClientSession, base_url: str, timeout: float) -> None:
    """Poll GET /health until it answers 200 (a server still loading its model is not an error
    yet); a timeout of 0 skips the check."""
    deadline = time.monotonic() + timeout
    while timeout > 0:
        try:
            async with session.get(f"{base_url}/health") as resp:
                if resp.status == 200:
                    return
        except (aiohttp.ClientError, OSError):
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"the server at {base_url} was not ready within {timeout:.0f} s.")
        await asyncio.sleep(0.5)


def _sweep(args: argparse.Namespace) -> list[tuple[int | None, int]]:
    """(max_concurrency, num_prompts) per run."""
    if not args.sweep_max_concurrency:
        return [(args.max_concurrency, args.num_prompts)]
    try:
        concs = [int(c) for c in args.sweep_max_concurrency.split(",")]
    except ValueError as e:
        raise ValueError("--sweep-max-concurrency takes integers like 1,16,64.") from e
    if any(c < 1 for c in concs):
        raise ValueError("--sweep-max-concurrency values must be >= 1.")
    f = args.sweep_num_prompts_factor
    return [(c, c * f if f else args.num_prompts) for c in concs]


def _with_config(
    args: argparse.Namespace,
    result: dict[str, Any],
    model_id: str,
    num_prompts: int,
    conc: int | None,
) -> dict[str, Any]:
    head = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": args.tokenizer or model_id,
        "num_prompts": num_prompts,
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": 1.0,
        "max_concurrency": conc,
    }
    out = {**head, **result}
    if not args.save_detailed:
        for k in DETAILED_KEYS:
            out.pop(k, None)
    return out


def save_results(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    label = args.label or args.backend
    model = os.path.basename(str(results[0]["model_id"]).rstrip("/")) or "model"
    dt = results[0]["date"]
    if args.result_filename:
        name = args.result_filename
    elif args.sweep_max_concurrency:
        concs = "_".join(str(r["max_concurrency"]) for r in results)
        name = f"{label}-sweep-c{concs}-{model}-{dt}.json"
    else:
        c = results[0]["max_concurrency"]
        conc = f"-concurrency{c}" if c is not None else ""
        name = f"{label}-{args.request_rate}qps{conc}-{model}-{dt}.json"
    path = os.path.join(args.result_dir, name) if args.result_dir else name
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
    # A single run is vLLM's flat dict; a sweep keeps each run's dict under "runs".
    doc: dict[str, Any] = results[0]
    if args.sweep_max_concurrency:
        doc = {"label": args.label, "model_id": results[0]["model_id"], "runs": results}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"Saved results to {path}")
    return path


def cmd_bench_serve(args: argparse.Namespace) -> int:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1.")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be > 0 (inf: send all at once).")
    args.percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    args.metrics = args.percentile_metrics.split(",")
    results = asyncio.run(main_async(args))
    if args.save_result:
        save_results(args, results)
    # A run in which no request succeeded measured nothing: scripts and CI must see it fail.
    failed = [r for r in results if r.get("completed", 0) == 0]
    if failed:
        print(
            f"error: every request failed in {len(failed)} of {len(results)} run(s) "
            "(see the errors above)",
            file=sys.stderr,
        )
        return 1
    return 0
