"""What the engine returns: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    # The request's token list itself: it keeps growing while the request runs (read
    # RequestOutput.delta_token_ids for what a step added).
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    # One dict per generated token: {token_id: logprob} holding the sampled token and the top-N.
    logprobs: list[dict[int, float]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # What this step added (for streaming): text that can no longer change, and token ids.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, float]] | None = None
    # With SamplingParams.prompt_logprobs: per prompt token {token: logprob} of that token and
    # the top-N, None for the first (vLLM's shape); complete from the first token on.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Beside prompt_logprobs: the prompt token's rank in its distribution (vLLM's: 1 + the
    # tokens more likely); the top-N rank by their order (1..N).
    prompt_logprob_ranks: list[int | None] | None = None
    # Prompt tokens whose KV came from the prefix cache when the request was first scheduled
    # (vLLM's field).
    num_cached_tokens: int = 0


@dataclass
class OutputTiming:
    """Latencies of one output as the engine thread hands it out (seconds, monotonic clock)."""

    ttft: float | None  # set on a request's first output
    itl: float | None  # set on every later output (one step may carry several tokens)
    e2e: float | None  # set when the request finishes
    finish_reason: str | None
