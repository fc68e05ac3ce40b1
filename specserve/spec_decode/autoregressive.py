"""The one drafting loop shared by draft_model, EAGLE, EAGLE-3 and MTP.

  draft prefill  over the target's scheduled tokens (same shapes, same attention metadata);
                 input ids shifted by `drafter.shift`; rejected positions stay as padding
  draft decode   single-token steps; between steps positions, seq_lens and slots advance and the
                 attention metadata is REBUILT (builders may hold position-dependent state)

Drafts are written into the persistent token buffer right after the request's newest token, so
the next target step gathers `[last token, d1..dK]` like any other input. Nothing here reads
back from the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.attention.backend import CommonAttentionMetadata, ForwardContext
from specserve.config.speculative import SpeculativeConfig
from specserve.models.drafters import Drafter
from specserve.ops.spec_kernels import (
    DraftDecodeInputs,
    prepare_draft_decode_inputs,
    prepare_draft_prefill_inputs,
)
from specserve.sample.sampler import SamplingTensors
from specserve.spec_decode.drafting import DeviceSpeculator, TargetStep
from specserve.spec_decode.tree import TreeDrafter

if TYPE_CHECKING:
    from specserve.spec_decode.interface import DraftRunner
    from specserve.step_inputs import StepInputs


class AutoregressiveSpeculator(DeviceSpeculator):
    tracks_kv_at_zero = True

    def __init__(self, spec: SpeculativeConfig, drafter: Drafter, device: torch.device) -> None:
        super().__init__(spec, drafter, device)
        # False for a Q-only MTP that shares the target's KV: every draft step at one position.
        self.advance_draft_positions = True
        # False for a drafter whose forward returns one tensor (used for logits and carried on).
        self.model_returns_tuple = True
        # 0-dim device scalar: the draft step being sampled. Sampling reads it to pick the
        # column of the draft probs, so one captured step graph serves every step.
        self.current_draft_step = torch.zeros((), dtype=torch.int64, device=device)
        # Draft trees (spec_decode/tree.py): None drafts a chain. Its rows are allocated with
        # the runner's (`bind_rows`).
        self.tree: TreeDrafter | None = None
        self._tree_spec = spec if spec.is_tree else None

    def bind_rows(self, num_rows: int) -> None:
        """Allocate per-request state for `num_rows` persistent rows (the runner calls it)."""
        if self._tree_spec is not None and self.tree is None:
            self.tree = TreeDrafter(self._tree_spec, num_rows, self.device)

    @property
    def num_decode_steps(self) -> int:
        """Single-token draft steps after the draft prefill (shift-1 drafters sample d1 there)."""
        return self.k - 1 if self.model.shift == 1 else self.k

    def decode_steps_for(self, num_drafts: int | None) -> int:
        if num_drafts is None:
            return self.num_decode_steps
        return max(0, min(self.num_decode_steps, num_drafts - (self.k - self.num_decode_steps)))

    def decode_metadata(
        self, runner: DraftRunner, rows: torch.Tensor, pos: torch.Tensor, max_seq_len: int
    ) -> CommonAttentionMetadata:
        """Metadata for one single-token draft step at positions `pos` [B] (graph-safe).

        One launch on CUDA. Positions at or past max_model_len get slot -1: drafts never write
        KV there."""
        B = pos.shape[0]
        m = self._decode_inputs(runner, rows, pos, with_ids=False)
        return CommonAttentionMetadata(
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            positions=pos,
            block_table=m.block_table,
            slot_mapping=m.slot_mapping,
            token_req=m.token_req,
            num_reqs=B,
            num_tokens=B,
            max_query_len=1,
            max_seq_len=min(max_seq_len, runner.max_model_len),
        )

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, h: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.model(ids, pos, h, ctx)
        return out if self.model_returns_tuple else (out, out)

    def _decode_inputs(
        self,
        runner: DraftRunner,
        rows: torch.Tensor,
        pos: torch.Tensor,
        with_ids: bool = True,
        with_metadata: bool = True,
    ) -> DraftDecodeInputs:
        return prepare_draft_decode_inputs(
            runner.states.token_ids,
            runner.states.block_table,
            rows,
            pos,
            self.model.shift,
            runner.block_size,
            runner.max_model_len,
            with_ids,
            with_metadata,
        )

    def _sample(
        self,
        runner: DraftRunner,
        # [B, hidden]
        h: torch.Tensor,
        st: SamplingTensors,
        # [B] persistent rows
        rows: torch.Tensor,
        # [B] position the drafted token lands at
        write_pos: torch.Tensor,
        # [B] 0 for rows that must not be written (mid-prompt chunks, padding)
        samples: torch.Tensor,
        # 0-dim device tensor (or int): the draft step, i.e. the probs column
        step: torch.Tensor | int,
    ) -> None:
        """Sample one draft per row and write it (and its probs) at draft step `step`."""
        logits = self.model.draft_logits(h).float()
        scratch = runner.states.token_ids.shape[1] - 1
        col = torch.where(samples > 0, write_pos, torch.full_like(write_pos, scratch))
        self.store_drafts(
            runner, self.model, logits, st, rows, write_pos[:, None], col[:, None], step
        )

    # ---- the two phases -------------------------------------------------------------------
    def draft_prefill(
        self,
        runner: DraftRunner,
        inp: StepInputs,
        ctx: ForwardContext,
        # [T, hidden] target hidden states (final norm)
        hidden: torch.Tensor,
        aux: list[torch.Tensor],
        # [B]
        num_acc: torch.Tensor,
        st: SamplingTensors,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafter over the target's tokens (shifted), same metadata; samples d1 for shift-1
        drafters. Returns (position of the first decode step's input [B], its hidden [B, H])."""
        out, carry, last, next_pos, d1_pos = self.prefill_forward(
            runner, inp, ctx, hidden, aux, num_acc
        )
        self.current_draft_step.fill_(0)
        if self.model.shift == 1:
            self._sample(runner, out[last], st, inp.idx_mapping, d1_pos, inp.samples, 0)
            self.current_draft_step.fill_(1)
        return next_pos, (carry[last] if carry is not None else None)

    def prefill_forward(
        self,
        runner: DraftRunner,
        inp: StepInputs,
        ctx: ForwardContext,
        hidden: torch.Tensor,
        aux: list[torch.Tensor],
        num_acc: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft prefill's forward -> (outputs [T, H], carried states [T, H] or None,
        index of each request's last verified token [B], its position + 1 and + 2 [B])."""
        ids, h_in, last, next_pos, d1_pos = self._prefill_inputs(runner, inp, hidden, aux, num_acc)
        out, carry = self._forward(ids, inp.positions, h_in, ctx)
        return out, carry, last, next_pos, d1_pos

    def prefill_kv(
        self,
        runner: DraftRunner,
        inp: StepInputs,
        ctx: ForwardContext,
        hidden: torch.Tensor,
        aux: list[torch.Tensor],
        num_acc: torch.Tensor,
    ) -> None:
        """The draft prefill's KV writes alone (`Drafter.write_kv`): a k = 0 step that keeps
        the drafter's KV complete. The full forward cost a tracked step ~9% over a plain one
        (gpt-oss-20b's EAGLE-3 head at batch 1, H100: its MLP is 70% of its weights)."""
        ids, h_in, *_ = self._prefill_inputs(runner, inp, hidden, aux, num_acc)
        self.model.write_kv(ids, inp.positions, h_in, ctx)

    def _prefill_inputs(
        self,
        runner: DraftRunner,
        inp: StepInputs,
        hidden: torch.Tensor,
        aux: list[torch.Tensor],
        num_acc: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (the drafter's input ids [T], hidden input [T, H] or None, `last`, P + 1, P + 2)."""
        d = self.model
        rows = inp.idx_mapping
        # One launch on CUDA: shifted input ids and, per request, the index `last` of its last
        # verified token (rejected drafts after it are padding) and that token's position P + 1
        # (the first decode step's input) and P + 2 (where d1 lands).
        ids, last, next_pos, d1_pos = prepare_draft_prefill_inputs(
            runner.states.token_ids,
            rows,
            inp.token_req,
            inp.positions,
            inp.query_start_loc,
            inp.num_draft,
            num_acc,
            d.shift,
        )
        h_in = d.combine_hidden(hidden, aux) if d.uses_hidden else None
        return ids, h_in, last, next_pos, d1_pos

    def draft_step(
        self,
        runner: DraftRunner,
        rows: torch.Tensor,
        # [B] position of this step's drafter input
        pos: torch.Tensor,
        # [B, hidden] or None
        h: torch.Tensor | None,
        samples: torch.Tensor,
        st: SamplingTensors,
        ctx: ForwardContext,
    ) -> torch.Tensor | None:
        """One single-token draft step at `current_draft_step`; returns the carried hidden."""
        # The ids half of prepare_draft_decode_inputs (one launch on CUDA): gathered here, after
        # the previous step wrote its draft, because the fused loop builds the metadata once.
        x = self._decode_inputs(runner, rows, pos, with_metadata=False)
        out, carry = self._forward(x.input_ids, pos, h, ctx)
        self._sample(runner, out, st, rows, x.write_pos, samples, self.current_draft_step)
        self.current_draft_step.add_(1)
        return carry

    def propose(self, runner: DraftRunner, t: TargetStep, num_drafts: int | None = None) -> None:
        """Eager drafting: prefill, then single-token steps with metadata REBUILT each step.

        `num_drafts` < K (dynamic speculation) runs fewer decode steps; the prefill always runs,
        so the drafter's KV stays complete for when K grows again. A tree is drafted whole
        (spec_decode/tree.py): a budget of n < K verifies its first n nodes."""
        if num_drafts == 0:  # no drafts: the drafter's KV over the verified tokens only
            self.prefill_kv(runner, t.inp, t.ctx, t.hidden, t.aux, t.num_acc)
            return
        if self.tree is not None:
            self.tree.draft(self, runner, t.inp, t.ctx, t.hidden, t.aux, t.num_acc, t.st)
            return
        inp, rows = t.inp, t.inp.idx_mapping
        pos, h = self.draft_prefill(runner, inp, t.ctx, t.hidden, t.aux, t.num_acc, t.st)
        for j in range(self.decode_steps_for(num_drafts)):
            p = pos + (j if self.advance_draft_positions else 0)
            ctx_j = runner.forward_context(
                self.decode_metadata(runner, rows, p, inp.max_seq_len + j + 1)
            )
            h = self.draft_step(runner, rows, p, h, inp.samples, t.st, ctx_j)
