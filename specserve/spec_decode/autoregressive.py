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
from specserve.models.drafters import Drafter
from specserve.sample.rejection import sample_draft
from specserve.sample.sampler import SamplingTensors
from specserve.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from specserve.worker.input_batch import StepInputs
    from specserve.worker.model_runner import ModelRunner


class AutoregressiveSpeculator:
    proposes_on_host = False

    def __init__(self, spec: SpeculativeConfig, drafter: Drafter, device: torch.device) -> None:
        self.spec = spec
        self.model = drafter
        self.k = spec.num_speculative_tokens
        self.greedy_draft = spec.draft_sample_method == "greedy"
        # False for a Q-only MTP that shares the target's KV: every draft step at one position.
        self.advance_draft_positions = True
        self.device = device
        self._draft_probs: torch.Tensor | None = None  # [max_num_seqs, K, vocab], lazily

    def sliding_windows(self) -> set[int | None]:
        return self.model.sliding_windows()

    def aux_layers(self) -> tuple[int, ...]:
        return self.model.aux_layers()

    def draft_probs(self, rows: torch.Tensor) -> torch.Tensor | None:
        if self.greedy_draft or self._draft_probs is None:
            return None
        return self._draft_probs[rows]

    def decode_metadata(
        self, runner: ModelRunner, rows: torch.Tensor, pos: torch.Tensor, max_seq_len: int
    ) -> CommonAttentionMetadata:
        """Metadata for one single-token draft step at positions `pos` [B]."""
        B = pos.shape[0]
        bs = runner.block_size
        bt = runner.states.block_table[rows]
        in_range = pos < runner.max_model_len
        safe = pos.clamp_max(runner.max_model_len - 1)
        blk = bt.gather(1, (safe // bs)[:, None]).squeeze(1).long()
        # NOTE: drafts never write KV past max_model_len: such positions get the null slot.
        slot = torch.where(in_range, blk * bs + safe % bs, torch.full_like(pos, -1))
        ar = torch.arange(B + 1, device=pos.device)
        return CommonAttentionMetadata(
            query_start_loc=ar.to(torch.int32),
            seq_lens=(safe + 1).to(torch.int32),
            positions=pos,
            block_table=bt,
            slot_mapping=slot,
            token_req=ar[:B],
            num_reqs=B,
            num_tokens=B,
            max_query_len=1,
            max_seq_len=min(max_seq_len, runner.max_model_len),
        )

    def _sample(
        self,
        runner: ModelRunner,
        h: torch.Tensor,
        st: SamplingTensors,
        rows: torch.Tensor,
        write_pos: torch.Tensor,
        samples: torch.Tensor,
        step: int,
    ) -> None:
        logits = self.model.draft_logits(h).float()
        tokens, probs = sample_draft(logits, st, write_pos, self.greedy_draft)
        tokens = self.model.to_target_ids(tokens)
        tok = runner.states.token_ids
        col = torch.where(samples > 0, write_pos, torch.full_like(write_pos, tok.shape[1] - 1))
        tok[rows, col] = tokens
        if probs is not None:
            if self._draft_probs is None:
                vocab = runner.model.config.vocab_size
                self._draft_probs = torch.zeros(
                    runner.states.max_num_seqs, self.k, vocab, device=self.device
                )
            if self.model.d2t is not None:
                full = probs.new_zeros(probs.shape[0], self._draft_probs.shape[2])
                full[
                    :, self.model.to_target_ids(torch.arange(probs.shape[1], device=self.device))
                ] = probs
                probs = full
            self._draft_probs[rows, step] = probs

    def propose(
        self,
        runner: ModelRunner,
        inp: StepInputs,
        common: CommonAttentionMetadata,
        ctx: ForwardContext,
        # [T, hidden] target hidden states (final norm)
        hidden: torch.Tensor,
        aux: list[torch.Tensor],
        # [B]
        num_acc: torch.Tensor,
        st: SamplingTensors,
    ) -> None:
        d = self.model
        rows = inp.idx_mapping
        tok = runner.states.token_ids
        # ---- draft prefill: same tokens, positions and metadata as the target --------------
        ids = tok[rows[inp.token_req], inp.positions + d.shift]
        h_in = d.combine_hidden(hidden, aux) if d.uses_hidden else None
        out, carry = d(ids, inp.positions, h_in, ctx)
        # Last valid (verified) token of each request: rejected drafts after it are padding.
        last = inp.query_start_loc[1:] - 1 - inp.num_draft + num_acc
        P = inp.positions[last]
        num_steps = self.k
        if d.shift == 1:
            self._sample(runner, out[last], st, rows, P + 2, inp.samples, 0)
            num_steps -= 1
        h = carry[last] if carry is not None else None
        # ---- draft decode: one token per request per step ---------------------------------
        for j in range(num_steps):
            pos = P + 1 + (j if self.advance_draft_positions else 0)
            common_j = self.decode_metadata(runner, rows, pos, inp.max_seq_len + j + 1)
            ctx_j = runner.forward_context(common_j)
            ids = tok[rows, pos + d.shift]
            out, carry = d(ids, pos, h, ctx_j)
            step = j + (1 if d.shift == 1 else 0)
            self._sample(runner, out, st, rows, pos + d.shift + 1, inp.samples, step)
            h = carry
