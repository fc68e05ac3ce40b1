"""Host-side request state: tokens, status, blocks and per-request speculation counters."""

from __future__ import annotations

import enum
import time
from typing import Any, Protocol

import torch

from specserve.outputs import RequestMetrics
from specserve.sampling_params import SamplingParams


class RequestGrammar(Protocol):
    """A request's grammar matcher (structured/matcher.py) as the engine, the sampler's logits
    processors and the bitmask builder drive it."""

    # The drafts of the next step that the grammar accepts, in order.
    drafts: list[int]
    # Draft trees: the parent of each node 0..K of the next step's tree; None for chains.
    parents: list[int] | None

    @property
    def is_terminated(self) -> bool: ...

    # bitmask: [rows, ceil(vocab / 32)] int32 on the host
    def fill_masks(self, drafts: list[int], bitmask: torch.Tensor, start: int) -> None: ...

    def fill_tree_masks(
        self, tokens_by_node: list[int], parents: list[int], bitmask: torch.Tensor, start: int
    ) -> None: ...

    def commit(self, tokens: list[int], num_accepted: int) -> int: ...

    def valid_prefix(self, drafts: list[int]) -> int: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


# NOTE: checked several times per request per step: a set lookup, not a tuple built per call.
_FINISHED = frozenset(
    (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        seed: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []
        # Prompt logprobs received so far (the first token has none); a recompute after
        # preemption skips the tokens already here.
        self.prompt_logprobs: list[dict[int, float] | None] = [None]
        # The rank of each prompt token in its distribution (1: the most likely), beside it.
        self.prompt_logprob_ranks: list[int | None] = [None]
        self.status = RequestStatus.WAITING
        # Tokens whose KV is in the cache (or being written by this step).
        self.num_computed_tokens = 0
        # Drafts waiting on the device for this request's next verification.
        self.num_draft_tokens = 0
        # Tokens sampled by a launched step that the host has not seen yet (async scheduling):
        # the scheduler counts them; their ids are already in the device token buffer.
        self.num_pending_tokens = 0
        # Set while scheduling behind a launched step that verifies this request's drafts:
        # num_computed_tokens then holds an upper bound (every draft accepted).
        self.start_on_device = False
        # Host-side drafts (n-gram) to upload with the next step's inputs.
        self.host_draft_tokens: list[int] = []
        # Grammar state of a structured-outputs request (None: unconstrained).
        self.grammar: RequestGrammar | None = None
        # sampling_params.bad_words as token id sequences (the engine tokenizes them on add).
        self.bad_words_token_ids: list[list[int]] = []
        self.block_ids: list[int] = []
        # Prefix caching (engine/kv_cache.py): the chained keys of the request's full blocks so
        # far, how many of `block_ids` are registered in the cache (hit or published), the
        # tokens the current admission took from the cache (their KV is read-only: no step
        # of this request writes below them), and vLLM's num_cached_tokens: those of the first
        # admission (-1 until then).
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.cache_hit_tokens = 0
        self.num_cached_tokens = -1
        self.row = -1  # row in the runner's persistent request-state tensors
        self.seed = seed
        # Text and stop strings, when the engine detokenizes inline (offline use): the engine's
        # RequestState (engine/output_processor.py).
        self.output_state: Any = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduling_tokens(self) -> int:
        """num_tokens plus the tokens of a launched step not yet on the host."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        mt = self.sampling_params.max_tokens
        return mt if mt is not None else 1 << 30

    def is_finished(self) -> bool:
        return self.status in _FINISHED
