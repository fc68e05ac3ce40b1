"""A step's inputs, from the engine's rank to the other tensor-parallel ranks.

Rank 0 (the engine's process) schedules; every rank runs the same `ModelRunner.launch` /
`finish` over its shards. Before rank 0 launches a step it sends the other ranks what their
runners read of it (`StepMessage`): the scheduled requests' step fields, and per request only
what changed since the last message (its tokens and sampling parameters once, when it takes a
row; new output tokens; its block list when it grew), the rows freed since, and the step's
logprob and draft counts. A worker keeps a mirror `Request` per running request and rebuilds
the `SchedulerOutput`; rows are handed out in the same order on every rank, so they agree
(the message carries rank 0's rows, and a worker checks).

Structured outputs: the grammar matchers live on rank 0 only. For each structured request that
samples in the step, the message carries the mask rows rank 0's matcher walked over the step's
drafts (`SentMasks`); a worker's mirror holds them as its grammar, so every rank masks its
logits alike (and so samples alike). Rank 0's own launch reads the same rows (tp_executor.py).

The channel is the group's TCPStore (torch.distributed's rendezvous store): one pickled
message a step under `step/<n>`. A worker blocks on the next key; the store lives in rank 0's
process, so a worker whose engine died gets an error, not a hang.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specserve.request import Request
from specserve.sampling_params import SamplingParams
from specserve.scheduler_output import ScheduledRequest, SchedulerOutput
from specserve.structured.bitmask import SentMasks
from specserve.worker.model_runner import ModelRunner
from specserve.worker.step_results import StepOutput


@dataclass
class NewRequest:
    """What a row needs when a request takes one (new, or resumed after preemption)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    cache_hit_tokens: int
    bad_words_token_ids: list[list[int]]


@dataclass
class RequestStep:
    request_id: str
    row: int
    num_tokens: int
    num_draft: int
    start: int
    start_on_device: bool
    num_pending_tokens: int
    num_computed_tokens: int
    prompt_logprobs_len: int
    host_draft_tokens: list[int]
    # Output tokens the worker's mirror lacks, and the block list when its length changed.
    new_output_ids: list[int]
    block_ids: list[int] | None
    new: NewRequest | None = None
    # A structured request that samples this step: its grammar's masks, walked on rank 0.
    masks: SentMasks | None = None


@dataclass
class StepMessage:
    step: int
    # Request ids whose rows were freed since the last message, in order.
    removed: list[str]
    requests: list[RequestStep]
    reqs_logprobs: list[int]
    num_drafts: int | None
    # Debug (SPECSERVE_TP_CHECK=1): workers post their sampled tokens for rank 0 to compare.
    check: bool = False
    shutdown: bool = False


@dataclass
class _Sent:
    num_output: int
    num_blocks: int


@dataclass
class StepSender:
    """Rank 0's side: builds each step's message from what the workers already have."""

    sent: dict[str, _Sent] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    step: int = 0

    def remove(self, req: Request) -> None:
        if self.sent.pop(req.request_id, None) is not None:
            self.removed.append(req.request_id)

    def message(
        self,
        sched: SchedulerOutput,
        reqs_logprobs: list[int],
        num_drafts: int | None,
        runner: ModelRunner,
        check: bool,
    ) -> StepMessage:
        """The step's message. New requests take their rows here (as `launch` would), so the
        message carries rank 0's rows."""
        steps = []
        for s in sched.scheduled:
            req = s.req
            new = None
            if req.row < 0:
                runner.add_request(req)
                new = NewRequest(
                    list(req.prompt_token_ids),
                    list(req.output_token_ids),
                    req.sampling_params,
                    req.seed,
                    req.cache_hit_tokens,
                    req.bad_words_token_ids,
                )
                self.sent[req.request_id] = _Sent(req.num_output_tokens, -1)
            sent = self.sent[req.request_id]
            out = req.output_token_ids[sent.num_output :] if new is None else []
            blocks = list(req.block_ids) if len(req.block_ids) != sent.num_blocks else None
            sent.num_output, sent.num_blocks = req.num_output_tokens, len(req.block_ids)
            masks = None
            if req.grammar is not None and s.samples:
                masks = SentMasks.walk(req.grammar, s.num_draft, runner.vocab_size)
            steps.append(
                RequestStep(
                    req.request_id,
                    req.row,
                    s.num_tokens,
                    s.num_draft,
                    s.start,
                    s.start_on_device,
                    req.num_pending_tokens,
                    req.num_computed_tokens,
                    len(req.prompt_logprobs),
                    list(req.host_draft_tokens),
                    out,
                    blocks,
                    new,
                    masks,
                )  # fmt: skip
            )
        msg = StepMessage(
            self.step, self.removed, steps, list(reqs_logprobs), num_drafts, check=check
        )
        self.removed = []
        self.step += 1
        return msg


class StepReceiver:
    """A worker's side: mirror requests, rebuilt scheduler outputs, the runner driven."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.mirrors: dict[str, Request] = {}

    def run(self, msg: StepMessage) -> StepOutput:
        for rid in msg.removed:
            req = self.mirrors.pop(rid, None)
            if req is not None:
                self.runner.remove_request(req)
        sched = SchedulerOutput()
        for r in msg.requests:
            req = self._mirror(r)
            sched.scheduled.append(
                ScheduledRequest(req, r.num_tokens, r.num_draft, r.start, r.start_on_device)
            )
        return self.runner.finish(self.runner.launch(sched, msg.reqs_logprobs, msg.num_drafts))

    def _mirror(self, r: RequestStep) -> Request:
        if r.new is not None:
            n = r.new
            req = Request(r.request_id, n.prompt_token_ids, n.sampling_params, seed=n.seed)
            req.output_token_ids = list(n.output_token_ids)
            req.cache_hit_tokens = n.cache_hit_tokens
            req.bad_words_token_ids = n.bad_words_token_ids
            if n.sampling_params.structured_outputs is not None:
                # A grammar from the start, as on rank 0 (min_tokens leaves the stop tokens to
                # it); the masks come with each step that samples the request.
                req.grammar = SentMasks([], torch.empty(0, 0, dtype=torch.int32))
            self.mirrors[r.request_id] = req
            self.runner.add_request(req)
        req = self.mirrors[r.request_id]
        if req.row != r.row:
            raise RuntimeError(
                f"tensor-parallel rows diverged: request {r.request_id!r} has row {req.row} "
                f"here and {r.row} on rank 0"
            )
        req.output_token_ids.extend(r.new_output_ids)
        if r.block_ids is not None:
            req.block_ids = r.block_ids
        req.num_pending_tokens = r.num_pending_tokens
        req.num_computed_tokens = r.num_computed_tokens
        req.start_on_device = r.start_on_device
        req.host_draft_tokens = r.host_draft_tokens
        if r.masks is not None:
            req.grammar = r.masks
        del req.prompt_logprobs[r.prompt_logprobs_len :]
        req.prompt_logprobs.extend([None] * (r.prompt_logprobs_len - len(req.prompt_logprobs)))
        return req


class StepChannel:
    """Step messages over the group's TCPStore: rank 0 writes `step/<n>`, workers read it."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def send(self, msg: StepMessage) -> None:
        self.store.set(f"step/{msg.step}", pickle.dumps(msg))
        if msg.step >= 2:
            # NOTE: every worker has read step n - 2: step n - 1's collectives needed them all
            # (rank 0 launches at most one step ahead of the results it has read).
            self.store.delete_key(f"step/{msg.step - 2}")

    def recv(self, step: int) -> StepMessage:
        """Block until rank 0 sends step `step` (an idle engine sends nothing for hours)."""
        self.store.set_timeout(datetime.timedelta(days=365))
        return pickle.loads(self.store.get(f"step/{step}"))

    def post_tokens(self, rank: int, step: int, out: StepOutput) -> None:
        """Debug: this rank's sampled tokens and accept counts for step `step`."""
        acc = None if out.num_accepted is None else np.asarray(out.num_accepted)
        self.store.set(f"check/{step}/{rank}", pickle.dumps((np.asarray(out.tokens), acc)))

    def compare_tokens(self, world_size: int, step: int, out: StepOutput) -> None:
        """Debug: raise if any rank sampled other tokens than rank 0 at step `step`."""
        mine = (np.asarray(out.tokens), out.num_accepted)
        for rank in range(1, world_size):
            key = f"check/{step}/{rank}"
            tokens, acc = pickle.loads(self.store.get(key))
            self.store.delete_key(key)
            if not np.array_equal(tokens, mine[0]) or (
                acc is not None and not np.array_equal(acc, np.asarray(mine[1]))
            ):
                raise RuntimeError(
                    f"tensor-parallel rank {rank} sampled other tokens than rank 0 at step "
                    f"{step}: {tokens.tolist()} vs {mine[0].tolist()}"
                )
