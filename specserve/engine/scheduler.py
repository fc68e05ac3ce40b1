"""Continuous batching: FCFS, a token budget, chunked prefill, preemption by recompute, and
prefix-cache hits for requests as they are admitted."""

from __future__ import annotations

import logging
from collections import deque

from specserve.engine.kv_cache import KVCacheManager
from specserve.request import Request, RequestStatus
from specserve.scheduler_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger("specserve")


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        num_lookahead_tokens: int = 0,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        # Drafter decode steps write KV up to K positions past the verified tokens.
        self.lookahead = num_lookahead_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and free its blocks at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _kv_tokens(self, req: Request, start: int, n: int) -> int:
        return min(start + n + self.lookahead, self.max_model_len)

    def _fits_alone(self, req: Request, start: int, n: int) -> bool:
        """Whether `req` could run with every other request preempted. The engine clamps
        max_model_len to the cache, so this holds for every request it admits; a request that
        fails it would otherwise preempt itself forever (and block the queue behind it)."""
        return self.kv.blocks_needed(self._kv_tokens(req, start, n)) <= self.kv.pool.num_blocks

    def _end(self, req: Request, out: SchedulerOutput) -> None:
        logger.warning(
            "request %s needs KV for %d tokens but the whole cache holds %d: finished (length)",
            req.request_id,
            req.num_scheduling_tokens + self.lookahead,
            self.kv.pool.num_blocks * self.kv.block_size,
        )
        self.remove(req)
        req.status = RequestStatus.FINISHED_LENGTH
        out.ended.append(req)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        # What a launched step computes for it is void: it restarts from its host tokens.
        victim.num_pending_tokens = 0
        victim.start_on_device = False
        victim.num_draft_tokens = 0
        victim.host_draft_tokens = []
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def schedule(self, num_spec_tokens: int | None = None) -> SchedulerOutput:
        """`num_spec_tokens` caps the drafts verified this step (dynamic speculation)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            start = req.num_computed_tokens
            remaining = req.num_scheduling_tokens - start
            if remaining > 1:  # still prefilling (chunked) or recomputing
                n, k = min(remaining, budget), 0
            else:
                k = req.num_draft_tokens
                if num_spec_tokens is not None:
                    k = min(k, num_spec_tokens)
                k = max(0, min(k, budget - 1))
                n = 1 + k
            if not self._fits_alone(req, start, n):
                self._end(req, out)
                continue
            while not self.kv.allocate(req, self._kv_tokens(req, start, n)):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is RequestStatus.PREEMPTED:
                continue  # `req` itself was the newest and got preempted; nothing at index i
            out.scheduled.append(ScheduledRequest(req, n, k, start, req.start_on_device))
            scheduled.add(id(req))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # A request holding no blocks starts with the prefix cache's longest hit.
            hit = self.kv.lookup(req) if not req.block_ids else []
            start = len(hit) * self.kv.block_size if hit else req.num_computed_tokens
            remaining = req.num_scheduling_tokens - start
            if remaining > budget and not self.chunked:
                break
            n = min(remaining, budget)
            if not self._fits_alone(req, start, req.num_scheduling_tokens - start):
                self._end(req, out)  # it would block every request behind it forever
                continue
            if not self.kv.allocate(req, self._kv_tokens(req, start, n), hit):
                break  # new work never preempts running work
            # Admitted (new, or resumed after preemption: waiting requests hold no KV).
            req.num_computed_tokens = req.cache_hit_tokens = start
            self.kv.record_lookup(req.num_tokens, start)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = start
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, 0, start))
            budget -= n
        return out
