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
