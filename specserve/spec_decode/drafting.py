"""What every on-device speculator shares: its drafter, the draft probabilities the rejection
sampler reads, and the one way a sampled draft lands in the persistent token buffer.

Autoregressive drafting (one draft per call, at the device scalar `current_draft_step`), PTD
(all K drafts from one forward) and multi-layer MTP (one draft per module) differ only in how
they run the drafter; they subclass `DeviceSpeculator` (PTD and multi-layer MTP through
`OneShotSpeculator`, no decode steps) and call `store_drafts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.attention.backend import CommonAttentionMetadata, ForwardContext
from specserve.config.speculative import SpeculativeConfig
from specserve.models.drafters import Drafter
from specserve.sample.rejection import sample_draft
from specserve.sample.sampler import SamplingTensors
from specserve.spec_decode.interface import Speculator

if TYPE_CHECKING:
    from specserve.spec_decode.interface import DraftRunner
    from specserve.step_inputs import StepInputs


@dataclass
class TargetStep:
    """What a target step leaves for a speculator to draft from (the eager drafting path)."""

    inp: StepInputs
    common: CommonAttentionMetadata
    ctx: ForwardContext
    # [T, hidden] target hidden states (final norm)
    hidden: torch.Tensor
    # EAGLE-3's taps of the target's residual stream, each [T, hidden]
    aux: list[torch.Tensor]
    # [B] drafts accepted per request this step
    num_acc: torch.Tensor
    st: SamplingTensors


class DeviceSpeculator(Speculator):
    """Base of the speculators whose drafts never leave the device."""

    graph_capturable = True

    def __init__(self, spec: SpeculativeConfig, drafter: Drafter, device: torch.device) -> None:
        self.spec = spec
        self.model = drafter
        self.k = spec.num_speculative_tokens
        self.greedy_draft = spec.draft_sample_method == "greedy"
        # Coupled verification needs no draft probabilities: sampled drafts draw the target's
        # noise instead (sample/rejection.py).
        self.coupled = spec.rejection_sample_method == "coupled"
        self.device = device
        self._draft_probs: torch.Tensor | None = None  # [rows, K, vocab], lazily

    @property
    def kv_lookahead(self) -> int:
        # EAGLE / EAGLE-3 / MTP (shift 1): the drafter's input at p is the token at p + 1.
        return self.model.shift

    def sliding_windows(self) -> set[int | None]:
        return self.model.sliding_windows()

    def aux_layers(self) -> tuple[int, ...]:
        return self.model.aux_layers()

    def propose(self, runner: DraftRunner, t: TargetStep, num_drafts: int | None = None) -> None:
        """Write the next step's drafts into the token buffer. `num_drafts` (dynamic K): how
        many the next step will verify; None: all K."""
        raise NotImplementedError

    def draft_probs(self, rows: torch.Tensor) -> torch.Tensor | None:
        if self.greedy_draft or self.coupled or self._draft_probs is None:
            return None
        return self._draft_probs[rows]

    def ensure_draft_probs(self, runner: DraftRunner) -> torch.Tensor | None:
        """The [rows, K, vocab] draft probabilities, allocated at first use (None when greedy:
        the rejection sampler then needs no probabilities)."""
        if not self.greedy_draft and not self.coupled and self._draft_probs is None:
            vocab = runner.vocab_size
            self._draft_probs = torch.zeros(
                runner.states.num_rows, self.k, vocab, device=self.device
            )
        return self._draft_probs

    def store_drafts(
        self,
        runner: DraftRunner,
        # the drafter (or MTP module) whose vocabulary the logits are in
        drafter: Drafter,
        # [B * J, draft_vocab] float
        logits: torch.Tensor,
        st: SamplingTensors,
        # [B] persistent rows
        rows: torch.Tensor,
        # [B, J] position each draft takes (keys its random draw)
        draft_pos: torch.Tensor,
        # [B, J] token-buffer column to write (the scratch column for drafts never verified)
        col: torch.Tensor,
        # the first draft's index in 0..K-1: an int, or a 0-dim device tensor (graph-safe)
        step: torch.Tensor | int,
    ) -> None:
        """Sample J drafts per request, write them into the token buffer (and their
        probabilities, at draft indices step .. step + J - 1, for the rejection sampler)."""
        B, J = col.shape
        st_rows = (
            st if J == 1 else st.index(torch.arange(B, device=rows.device).repeat_interleave(J))
        )
        cols = None
        if self.coupled and drafter.d2t is not None:
            cols = drafter.to_target_ids(torch.arange(logits.shape[1], device=logits.device))
        tokens, probs = sample_draft(
            logits, st_rows, draft_pos.reshape(-1), self.greedy_draft, self.coupled, cols
        )
        runner.states.token_ids[rows[:, None], col] = drafter.to_target_ids(tokens).view(B, J)
        buf = self.ensure_draft_probs(runner)
        if probs is None or buf is None:
            return
        if drafter.d2t is not None:  # reduced draft vocabulary -> target vocabulary
            full = probs.new_zeros(probs.shape[0], buf.shape[2])
            full[:, drafter.to_target_ids(torch.arange(probs.shape[1], device=probs.device))] = (
                probs
            )
            probs = full
        # In place at (row, step + j) through flat indices: graph-safe with a device `step`.
        idx = rows * self.k + step
        if J > 1:
            idx = (idx[:, None] + torch.arange(J, device=idx.device)).reshape(-1)
        buf.view(-1, buf.shape[2]).index_copy_(0, idx, probs)


class OneShotSpeculator(DeviceSpeculator):
    """A speculator whose whole proposal is its `draft_prefill` (PTD's one forward, multi-layer
    MTP's module chain; the signature of AutoregressiveSpeculator.draft_prefill, returning
    (None, None)): DraftGraphRunner captures no decode steps for it."""

    num_decode_steps = 0

    def decode_steps_for(self, num_drafts: int | None) -> int:
        return 0

    def propose(self, runner: DraftRunner, t: TargetStep, num_drafts: int | None = None) -> None:
        """Eager drafting (batches the target ran without a graph). `num_drafts` (dynamic K) is
        not used: all K drafts come from the one proposal (multi-layer MTP: every module runs, so
        each module's KV stays complete for when K grows again); the scheduler verifies only
        the first drafts."""
        self.draft_prefill(runner, t.inp, t.ctx, t.hidden, t.aux, t.num_acc, t.st)
