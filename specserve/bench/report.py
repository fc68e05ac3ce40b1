"""Benchmark metrics from per-request timings, and vLLM's `vllm bench serve` result table."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from specserve.bench.endpoint import RequestFuncOutput

# metric key -> (short name, section header), in the table's order
METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def _peaks(ok: list[RequestFuncOutput]) -> tuple[float, int]:
    """Peak output tokens in any one-second bucket and peak number of requests in flight at
    once. A chunk counts the tokens it carried (under speculation one chunk holds several), as
    the server's continuous usage stats tell; without them, one per chunk (vLLM's count)."""
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    t1 = max(o.start_time + o.latency for o in ok)
    buckets = np.zeros(int(np.ceil(t1 - t0)) + 1)
    for o in ok:
        t = o.start_time + o.ttft
        n_chunks = len(o.itl) + 1
        tokens = o.chunk_tokens if len(o.chunk_tokens) == n_chunks else [1] * n_chunks
        for dt, n in zip([0.0, *o.itl], tokens):
            t += dt
            buckets[int(t - t0)] += n
    # Sweep over [start, end) intervals; a departure sorts before an arrival at the same time.
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return float(buckets.max()), peak


def calculate_metrics(
    outputs: list[RequestFuncOutput], duration: float, percentiles: list[float]
) -> dict[str, Any]:
    ok = [o for o in outputs if o.success]
    if not ok:
        warnings.warn("All requests failed; check the benchmark arguments.", stacklevel=2)
    failed = [o for o in outputs if not o.success]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, o in enumerate(failed[:10]):
            print(f"Error {i}: {o.error}")
    out_lens = [o.output_tokens if o.success else 0 for o in outputs]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(out_lens)
    values: dict[str, list[float]] = {
        "ttft": [o.ttft for o in ok],
        "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1],
        "itl": [x for o in ok for x in o.itl],
        "e2el": [o.latency for o in ok],
    }
    peak_tok, peak_conc = _peaks(ok)
    r: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": peak_tok,
        "max_concurrent_requests": peak_conc,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": out_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    for key, vals in values.items():
        ms = np.asarray(vals or [0.0]) * 1000
        r[f"mean_{key}_ms"] = float(ms.mean())
        r[f"median_{key}_ms"] = float(np.median(ms))
        r[f"std_{key}_ms"] = float(ms.std())
        for p in percentiles:
            r[f"p{_pword(p)}_{key}_ms"] = float(np.percentile(ms, p))
        # The worst single value: a one-time stall (a compile, a graph capture on the serving
        # path) is one ITL among thousands and never moves a percentile.
        r[f"max_{key}_ms"] = float(ms.max())
    return r


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _row(name: str, value: Any, fmt: str = "") -> str:
    return ("{:<40} {:<10" + fmt + "}").format(name, value)


def format_result(
    r: dict[str, Any],
    max_concurrency: int | None,
    request_rate: float,
    metrics: list[str],
    percentiles: list[float],
) -> str:
    """The result table, line for line in `vllm bench serve`'s layout."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(_row("Successful requests:", r["completed"]))
    lines.append(_row("Failed requests:", r["failed"]))
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_row("Request rate configured (RPS):", request_rate, ".2f"))
    lines.append(_row("Benchmark duration (s):", r["duration"], ".2f"))
    lines.append(_row("Total input tokens:", r["total_input_tokens"]))
    lines.append(_row("Total generated tokens:", r["total_output_tokens"]))
    lines.append(_row("Request throughput (req/s):", r["request_throughput"], ".2f"))
    lines.append(_row("Output token throughput (tok/s):", r["output_throughput"], ".2f"))
    lines.append(_row("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"], ".2f"))
    lines.append(_row("Peak concurrent requests:", r["max_concurrent_requests"], ".2f"))
    lines.append(_row("Total token throughput (tok/s):", r["total_token_throughput"], ".2f"))
    if "prefix_cache_hit_rate" in r:
        lines.append(_row("Prefix cache hit rate (%):", r["prefix_cache_hit_rate"], ".2f"))
    for key, (name, header) in METRICS.items():
        if key not in metrics:
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(_row(f"Mean {name} (ms):", r[f"mean_{key}_ms"], ".2f"))
        lines.append(_row(f"Median {name} (ms):", r[f"median_{key}_ms"], ".2f"))
        for p in percentiles:
            lines.append(_row(f"P{_pword(p)} {name} (ms):", r[f"p{_pword(p)}_{key}_ms"], ".2f"))
        lines.append(_row(f"Max {name} (ms):", r[f"max_{key}_ms"], ".2f"))
    if "mean_ttft_ms_by_turn" in r:
        lines.append("{s:{c}^{n}}".format(s="Time to First Token by Turn", n=50, c="-"))
        for t, (mean, median) in enumerate(
            zip(r["mean_ttft_ms_by_turn"], r["median_ttft_ms_by_turn"]), start=1
        ):
            lines.append(_row(f"Mean TTFT turn {t} (ms):", mean, ".2f"))
            lines.append(_row(f"Median TTFT turn {t} (ms):", median, ".2f"))
    if "spec_decode_num_drafts" in r:
        lines.append("{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"))
        lines.append(_row("Acceptance rate (%):", r["spec_decode_acceptance_rate"], ".2f"))
        lines.append(_row("Acceptance length:", r["spec_decode_acceptance_length"], ".2f"))
        lines.append(_row("Drafts:", r["spec_decode_num_drafts"]))
        lines.append(_row("Draft tokens:", r["spec_decode_draft_tokens"]))
        lines.append(_row("Accepted tokens:", r["spec_decode_accepted_tokens"]))
        per_pos = r["spec_decode_per_position_acceptance_rates"]
        if per_pos:
            lines.append("Per-position acceptance (%):")
            for i, rate in enumerate(per_pos):
                lines.append(_row(f"  Position {i}:", rate * 100, ".2f"))
    lines.append("=" * 50)
    return "\n".join(lines)


def print_result(
    r: dict[str, Any],
    max_concurrency: int | None,
    request_rate: float,
    metrics: list[str],
    percentiles: list[float],
) -> None:
    print(format_result(r, max_concurrency, request_rate, metrics, percentiles))
