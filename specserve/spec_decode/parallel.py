"""Parallel token drafting (PTD): all K drafts from ONE drafter forward.

A PTD head (EAGLE / EAGLE-3, or a PARD-style draft model) was trained with K-1 mask slots after
the last known token: mask slot j, with input id `ptd_token_id` and (EAGLE heads) the learned
fused hidden `mask_hidden`, predicts the token j + 1 places past what the slot at the last
verified position predicts. So drafting cost stays nearly flat in K.

Per request the drafter forward sees `num_sched + E` slots (E = K - shift extra slots):

  EAGLE (shift 1)   the target's scheduled slots (input at position p: token p+1, hidden p);
                    rejected ones stay as padding (slot -1, output ignored); then K-1 mask slots
                    at P+1 .. P+K-1. The slot at the last verified position P predicts d1 (the
                    token at P+2), mask slot j predicts d_{j+1}.
  draft model       the scheduled slots (input at position p: token p), rejected ones padding;
  (shift 0)         then the newest token at P+1 (the bonus, which predicts d1) and K-1 mask
                    slots at P+2 .. P+K.

Mask slots write KV like any token and attend causally to everything before them; the next
step's draft prefill overwrites those positions. Positions at or past max_model_len get slot -1
(no KV write) and their drafts go to the scratch column: the request proposes fewer drafts
(`_plan_drafts` never verifies them), positions never wrap.

NOTE: rejected tokens stay in the batch as padding, so the layout depends only on host-known
sizes: request r's slots start at query_start_loc[r] + r * E on the host and on the device alike,
and the forward needs no device-to-host sync. Buffers hold max_num_batched_tokens +
max_num_seqs * K slots. So the whole proposal (`draft_prefill`) is captured as one CUDA graph per
target graph (DraftGraphRunner's "prefill" graph; PTD has no decode steps) over the target
graph's buffers: b * (q + E) slots for a padded uniform batch of b requests with q tokens.

Input preparation is one Triton kernel (`prepare_parallel_inputs`) with a torch reference
(`prepare_parallel_inputs_ref`, used on CPU), both in parallel_inputs.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from specserve.attention.backend import CommonAttentionMetadata, ForwardContext
from specserve.config.speculative import SpeculativeConfig
from specserve.models.drafters import Drafter, DraftModelDrafter
from specserve.sample.sampler import SamplingTensors
from specserve.spec_decode.drafting import OneShotSpeculator
from specserve.spec_decode.parallel_inputs import (
    ParallelDraftBuffers,
    ParallelDraftInputs,
    prepare_parallel_inputs,
    prepare_parallel_inputs_ref,
)

try:
    import triton
except ImportError:  # CPU-only installs without triton use the torch reference
    triton = None

if TYPE_CHECKING:
    from specserve.spec_decode.interface import DraftRunner
    from specserve.step_inputs import StepInputs


def configure_parallel_drafter(
    drafter: Drafter, cfg: dict[str, Any], names: set[str] | None, draft_dir: str
) -> None:
    """Check the checkpoint was trained for PTD and give the drafter its mask token / hidden
    (`mask_hidden` is then loaded like any weight). `names`: the checkpoint's tensor names
    (None: a bare config.json for random weights, benchmarks only)."""

    def error(msg: str) -> ValueError:
        return ValueError(f"speculative_config.parallel_draft: {draft_dir}/config.json {msg}")

    if cfg.get("parallel_draft") is not True:
        raise error(
            'lacks "parallel_draft": true (the drafter was not trained for parallel drafting); '
            "drop parallel_draft or pass a PTD checkpoint"
        )
    tid = cfg.get("ptd_token_id")
    vocab = cfg.get("vocab_size", 0)
    if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab:
        raise error(f"needs an integer ptd_token_id in [0, {vocab}), got {tid!r}")
    drafter.ptd_token_id = tid
    if isinstance(drafter, DraftModelDrafter):
        return  # PARD style: mask slots carry only the mask token
    if names is not None and "mask_hidden" not in names:
        raise error(
            "declares parallel_draft, but the checkpoint has no mask_hidden tensor (the fused "
            "hidden input of EAGLE heads at mask slots)"
        )
    # The fused hidden input of both EAGLE heads is fc's output (EAGLE-1: fc's second input).
    hidden = drafter.fc.out_features
    drafter.mask_hidden = torch.zeros(hidden, dtype=torch.get_default_dtype())


class ParallelDraftSpeculator(OneShotSpeculator):
    """PTD speculator: same surface as AutoregressiveSpeculator, one drafter forward per step."""

    def __init__(self, spec: SpeculativeConfig, drafter: Drafter, device: torch.device) -> None:
        if drafter.ptd_token_id is None:
            raise ValueError("speculative_config.parallel_draft: the drafter has no ptd_token_id")
        super().__init__(spec, drafter, device)
        self.extra = self.k - drafter.shift  # E: slots added per request
        self._bufs: ParallelDraftBuffers | None = None

    @property
    def uses_kernel(self) -> bool:
        return self.device.type == "cuda" and triton is not None

    @staticmethod
    def max_slots(max_num_batched_tokens: int, max_num_seqs: int, k: int) -> int:
        """Slots of the largest enlarged batch: T target tokens + E <= K per request, where T is
        bounded by the token budget (eager steps) and by max_num_seqs * (K + 1) (the captured
        uniform batches, which may exceed a small token budget)."""
        return max(max_num_batched_tokens, max_num_seqs * (k + 1)) + max_num_seqs * k

    def _lazy_buffers(self, runner: DraftRunner) -> None:
        c = runner.config
        if self.uses_kernel and self._bufs is None:
            n = self.max_slots(c.max_num_batched_tokens, c.max_num_seqs, self.k)
            self._bufs = ParallelDraftBuffers(n, c.max_num_seqs, self.k, self.device)

    def prepare(
        self, runner: DraftRunner, inp: StepInputs, num_acc: torch.Tensor
    ) -> ParallelDraftInputs:
        """The enlarged batch: the Triton kernel into persistent buffers on CUDA, else the
        torch reference."""
        self._lazy_buffers(runner)
        args = (
            inp.query_start_loc,
            inp.positions,
            inp.idx_mapping,
            inp.num_draft,
            num_acc,
            inp.samples,
            inp.seq_lens,
            runner.states.token_ids,
            runner.states.block_table,
        )
        kw = dict(
            k=self.k,
            shift=self.model.shift,
            mask_token_id=self.model.ptd_token_id,
            max_model_len=runner.max_model_len,
            block_size=runner.block_size,
        )
        if self.uses_kernel:
            return prepare_parallel_inputs(self._bufs, *args, **kw, max_query_len=inp.max_query_len)
        return prepare_parallel_inputs_ref(*args, **kw)

    # ---- the surface DraftGraphRunner captures (see worker/draft_graphs.py) ----------
    def draft_prefill(
        self,
        runner: DraftRunner,
        inp: StepInputs,
        ctx: ForwardContext | None,
        # [T, hidden] target hidden states (final norm)
        hidden: torch.Tensor,
        aux: list[torch.Tensor],
        # [B]
        num_acc: torch.Tensor,
        st: SamplingTensors,
    ) -> tuple[None, None]:
        """The whole proposal: one drafter forward over the enlarged batch, all K drafts
        sampled and stored. Graph-safe: every size comes from the host (`inp`), nothing is
        read back. `ctx` (the target's) is unused: the enlarged batch has its own metadata."""
        d, E = self.model, self.extra
        B, T = inp.num_reqs, inp.num_tokens
        pin = self.prepare(runner, inp, num_acc)
        meta = CommonAttentionMetadata(
            query_start_loc=pin.query_start_loc.to(torch.int32),
            seq_lens=pin.seq_lens.to(torch.int32),
            positions=pin.positions,
            block_table=runner.states.block_table[inp.idx_mapping],
            slot_mapping=pin.slot_mapping,
            token_req=pin.token_req,
            num_reqs=B,
            num_tokens=T + B * E,
            max_query_len=inp.max_query_len + E,
            max_seq_len=min(inp.max_seq_len + E, runner.max_model_len),
        )
        h_in = None
        if d.uses_hidden:
            fused = d.combine_hidden(hidden, aux)
            # Row T is the mask hidden: one gather serves scheduled and mask slots alike.
            h_in = torch.cat([fused, d.mask_hidden[None].to(fused.dtype)])[pin.hidden_src]
        out, _ = d(pin.input_ids, pin.positions, h_in, runner.forward_context(meta))
        logits = d.draft_logits(out[pin.draft_index.reshape(-1)]).float()
        jj = torch.arange(self.k, device=self.device)
        # Random draws are keyed by the draft's real position, even where the write is dropped.
        last = inp.query_start_loc[1:] - 1 - inp.num_draft + num_acc
        draft_pos = inp.positions[last][:, None] + 2 + jj
        self.store_drafts(runner, d, logits, st, inp.idx_mapping, draft_pos, pin.draft_col, 0)
        return None, None
