"""/metrics in Prometheus text format under vLLM's metric names, so its dashboards and
`vllm bench serve` read a specserve server unchanged.

Engine counters are read at scrape time from the engine thread's latest snapshot (a collector,
not counters bumped twice); latency histograms are observed on the engine thread as outputs
leave it. Each server owns a CollectorRegistry, so several servers can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.outputs import OutputTiming, RequestOutput

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histogram_quantile() panels match.
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
E2E_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip

# snapshot key -> (vLLM metric name without the `_total` suffix, help)
_COUNTERS = {
    "prompt_tokens_total": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens_total": ("vllm:generation_tokens", "Number of generation tokens."),
    "num_preemptions_total": ("vllm:num_preemptions", "Cumulative number of preemptions."),
    "prefix_cache_queries_total": (
        "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "prefix_cache_hits_total": (
        "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
    ),
    "spec_decode_num_drafts_total": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "spec_decode_num_draft_tokens_total": ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    "spec_decode_num_accepted_tokens_total": (
        "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
    ),
}  # fmt: skip
_GAUGES = {
    "num_requests_running": ("vllm:num_requests_running", "Number of requests in model execution."),
    "num_requests_waiting": ("vllm:num_requests_waiting", "Number of requests waiting to run."),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
}  # fmt: skip


class _EngineCollector(Collector):
    def __init__(self, model_name: str, snapshot: Callable[[], dict[str, Any]], spec: bool) -> None:
        self.model_name = model_name
        self.snapshot = snapshot
        self.spec = spec

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        for key, (name, doc) in _GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(snap[key]))
            yield g
        for key, (name, doc) in _COUNTERS.items():
            # NOTE: spec counters only exist with speculation on, as in vLLM: a client tells
            # "no speculation" from "nothing accepted" by their absence.
            if key.startswith("spec_decode") and not self.spec:
                continue
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(snap[key]))
            yield c
        if self.spec:
            g = GaugeMetricFamily(
                "vllm:spec_decode_draft_budget",
                "Drafts the adaptive budget chose for the latest step (the maximum K when fixed).",
                labels=["model_name"],
            )
            g.add_metric([self.model_name], float(snap["spec_decode_draft_budget"]))
            yield g
            c = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=["model_name", "position"],
            )
            for pos, n in enumerate(snap["spec_decode_num_accepted_tokens_per_pos_total"]):
                c.add_metric([self.model_name, str(pos)], float(n))
            yield c


class PrometheusMetrics:
    """The registry behind one server's /metrics; also an OutputObserver for the engine."""

    def __init__(self, model_name: str, snapshot: Callable[[], dict[str, Any]], spec: bool) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, snapshot, spec))
        kw: dict[str, Any] = {"labelnames": ["model_name"], "registry": self.registry}
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
            **kw,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=ITL_BUCKETS,
            **kw,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            buckets=E2E_BUCKETS,
            **kw,
        ).labels(model_name)
        self.model_name = model_name
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )

    def observe(self, output: RequestOutput, timing: OutputTiming) -> None:
        if timing.ttft is not None:
            self.ttft.observe(timing.ttft)
        if timing.itl is not None:
            # NOTE: one observation per step even when accepted drafts bring several tokens,
            # as vLLM does; the benchmark's TPOT is where speculation's per-token gain shows.
            self.itl.observe(timing.itl)
        if timing.e2e is not None:
            self.e2e.observe(timing.e2e)
            self.success.labels(self.model_name, timing.finish_reason or "abort").inc()

    def count_aborted(self, n: int) -> None:
        """`n` requests ended unfinished (the client left, or the server ended them): vLLM
        counts them under finished_reason="abort"."""
        if n > 0:
            self.success.labels(self.model_name, "abort").inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
