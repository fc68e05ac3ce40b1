"""Engine counters (vLLM's names and log line) shared by LLM.get_metrics() and /metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from specserve.request import Request

logger = logging.getLogger("specserve")


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_spec_tokens

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def per_position_rate(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]

    def log_line(self) -> str:
        per_pos = ", ".join(f"{r:.3f}" for r in self.per_position_rate())
        return (
            f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
            f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} "
            f"tokens, Per-position acceptance rate: {per_pos}, "
            f"Avg Draft acceptance rate: {100 * self.acceptance_rate:.1f}%"
        )


class EngineStats:
    def __init__(self, num_spec_tokens: int) -> None:
        self.spec = SpecDecodingStats(num_spec_tokens)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_preemptions = 0
        # The adaptive draft budget: the last step's choice and the mean since the start.
        self.draft_budget: float = float(num_spec_tokens)
        self.mean_draft_budget: float = float(num_spec_tokens)
        self._last_log = time.monotonic()
        self._logged = SpecDecodingStats(num_spec_tokens)
        # Prefix-cache (queries, hits) in tokens at the last log line.
        self._logged_prefix = (0, 0)

    def record_draft(self, req: Request, num_draft: int, num_accepted: int) -> None:
        s = self.spec
        s.num_drafts += 1
        s.num_draft_tokens += num_draft
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_pos[i] += 1
        m = req.metrics
        m.num_drafts += 1
        m.num_draft_tokens += num_draft
        m.num_accepted_tokens += num_accepted

    def snapshot(
        self,
        num_running: int,
        num_waiting: int,
        kv_usage: float,
        prefix_cache_queries: int = 0,
        prefix_cache_hits: int = 0,
    ) -> dict[str, Any]:
        """The counters with the engine's gauges and the KV cache's prefix-cache counters
        (tokens), which the engine reads for it."""
        s = self.spec
        return {
            "num_requests_running": num_running,
            "num_requests_waiting": num_waiting,
            "kv_cache_usage_perc": kv_usage,
            "prefix_cache_queries_total": prefix_cache_queries,
            "prefix_cache_hits_total": prefix_cache_hits,
            "prompt_tokens_total": self.prompt_tokens,
            "generation_tokens_total": self.generation_tokens,
            "num_preemptions_total": self.num_preemptions,
            "spec_decode_num_drafts_total": s.num_drafts,
            "spec_decode_num_draft_tokens_total": s.num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": s.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos_total": list(s.accepted_per_pos),
            "spec_decode_mean_acceptance_length": s.mean_acceptance_length,
            "spec_decode_acceptance_rate": s.acceptance_rate,
            "spec_decode_draft_budget": self.draft_budget,
            "spec_decode_mean_draft_budget": self.mean_draft_budget,
        }

    def maybe_log(
        self, disabled: bool, interval: float, prefix_cache: tuple[int, int] | None = None
    ) -> None:
        """`prefix_cache`: the (queries, hits) token counters when prefix caching is on."""
        now = time.monotonic()
        if disabled or now - self._last_log < interval:
            return
        self._last_log = now
        if prefix_cache is not None:
            # vLLM's wording; over the interval since the previous line.
            q, h = (a - b for a, b in zip(prefix_cache, self._logged_prefix))
            self._logged_prefix = prefix_cache
            logger.info("Prefix cache hit rate: %.1f%%", 100 * h / q if q else 0.0)
        if self.spec.num_spec_tokens:
            # The line covers the interval since the previous one, as vLLM's does.
            d = SpecDecodingStats(self.spec.num_spec_tokens)
            d.num_drafts = self.spec.num_drafts - self._logged.num_drafts
            d.num_draft_tokens = self.spec.num_draft_tokens - self._logged.num_draft_tokens
            d.num_accepted_tokens = self.spec.num_accepted_tokens - self._logged.num_accepted_tokens
            d.accepted_per_pos = [
                a - b for a, b in zip(self.spec.accepted_per_pos, self._logged.accepted_per_pos)
            ]
            logger.info(d.log_line())
            self._logged = SpecDecodingStats(self.spec.num_spec_tokens)
            self._logged.num_drafts = self.spec.num_drafts
            self._logged.num_draft_tokens = self.spec.num_draft_tokens
            self._logged.num_accepted_tokens = self.spec.num_accepted_tokens
            self._logged.accepted_per_pos = list(self.spec.accepted_per_pos)
