"""What the scheduler hands the model runner for one step (plain data, below every layer)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.request import Request


@dataclass
class ScheduledRequest:
    req: Request
    # Tokens fed to the target this step: a prefill chunk, or 1 + num_draft when decoding.
    num_tokens: int
    num_draft: int
    # num_computed_tokens before this step: the position of the first scheduled token. With
    # `start_on_device` (async scheduling behind a step that verifies drafts) it is only an
    # upper bound, the one KV is allocated for; the device corrects it from the accept counts.
    start: int
    start_on_device: bool = False

    @property
    def samples(self) -> bool:
        """Whether this step produces a token for the request (not a mid-prompt chunk)."""
        return self.start + self.num_tokens - self.num_draft >= self.req.num_scheduling_tokens

    def end_bound(self) -> int:
        """num_computed_tokens after this step if it accepts every draft, read while the step
        runs on the device (async scheduling, to schedule the next one). With
        `start_on_device` the step starts at the host's count, exact by then (the step before
        it has been read), not at `start`: that bound was built on the step before's bound,
        and building each on the last compounded, so a request's KV grew by 1 + K positions a
        step whatever was accepted. At batch 64 (H100, K = 1, acceptance 0.3) the cache then
        filled by context ~512 of 768, overlap stopped and a step took 12.5 ms instead of 9."""
        start = self.req.num_computed_tokens if self.start_on_device else self.start
        return start + self.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that can never fit the whole KV cache: finished with "length", not scheduled.
    ended: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
