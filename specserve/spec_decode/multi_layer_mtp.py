"""Multi-layer MTP: K chained DeepSeek-style MTP modules, one draft each (N in the checkpoint).

Module k (1-based) at position i reads the hidden state h^{k-1}_i and the token t_{i+k} and
produces h^k_i, which predicts t_{i+k+1}; h^0 is the target's final-norm hidden state.

Which hidden states each module's KV holds
    Module 1's KV holds states computed from the TARGET's hidden states; module k >= 2's KV holds
    states computed from module k-1's OUTPUT hidden states, at the same position. That is the
    chain the modules were trained on (DeepSeek-V3: h^k_i = M_k(h^{k-1}_i, emb(t_{i+k}))), so
    only these keys are in distribution for module k's attention; and at a verified position
    h^{k-1}_i depends on verified tokens only, so its KV never needs recomputing.

Per step, with L the newest token's position (the bonus / next prompt token) and P = L - 1 the
last position with a verified target hidden state, module k must hold, for positions
0 .. L - k, exactly the KV of a from-scratch run over the accepted sequence: position i is
verified once t_{i+k} is. Its batch is the target's, shifted back by k - 1 positions and grown
by k - 1 slots per request (region slot s <-> position start + s - (k - 1); same token ids as
module 1's slot s: t_{start+s+1}):
    s = 0             position start - k + 1: its hidden h^{k-1} was module k-1's output at
                      ITS last verified position in the previous step, carried in a persistent
                      per-request row (reached through idx_mapping, so it survives requests
                      joining, finishing and being reordered)
    1 <= s <= v       verified positions; hidden = module k-1's output at slot s - 1
    v < s <= v+k-1    chain positions P-k+2 .. P, whose tokens are drafts d1 .. d_{k-1}: module k
                      attends over them and its slot at P predicts d_k (at L + k). Their KV is
                      speculative and is rewritten next step, when the region starts there.
    s > v + k - 1     rejected drafts: padding (slot -1, outputs ignored)
where v = num_sched - 1 - num_draft + num_accepted is the last verified slot: "each module's
inputs are shifted by the number of accepted tokens". Positions below 0 (a fresh request) are
padding too. After module k runs, its output at slot v (position L - k, the next step's s = 0
of module k+1) is carried. All accepted (v = K), all rejected (v = 0), mid-prompt chunks
(v = num_sched - 1, drafts go to the scratch column) and preemption (start = 0: nothing is read
from the carry) follow the same rule. No position here ever passes the target's.

K != N: the loader keeps only the first K modules when K < N (the others get no KV layers).
With K > N, chain step k runs the checkpoint's module ((k - 1) mod N) + 1, as vLLM's DeepSeek
MTP does (`spec_step_idx % num_mtp_layers`): the loader hands this speculator K modules, step
k > N sharing module ((k - 1) mod N) + 1's parameters, and everything here stays per chain step.
In particular each step keeps its OWN KV: the rule above gives step k's KV at position i the
keys of M(h^{k-1}_i, t_{i+k}), and h^{k-1} (step k-1's output) differs from the hidden state
step k - N read at the same position, so a repeated module sharing its KV with its earlier use
would overwrite keys that the earlier step's next proposal still attends over. The carry rows,
the shifted batches and the graph shapes are all per step, so K > N changes nothing else.

CUDA graphs: the whole proposal (`draft_prefill`, all K modules) reads only tensors and
host-known sizes (module k's batch is num_tokens + num_reqs * (k - 1) slots), so
DraftGraphRunner captures it as one graph per target graph, like PTD's one forward. Each
module's attention metadata is built inside that graph from its own shifted batch, i.e. REBUILT
between modules on every replay (no in-place advance needed, so any backend qualifies). Padded
rows (the persistent scratch row) write no KV (slot -1); their drafts and carry land in the
scratch row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.attention.backend import CommonAttentionMetadata, ForwardContext
from specserve.config.speculative import SpeculativeConfig
from specserve.models.drafters import MultiLayerMTPDrafter
from specserve.sample.sampler import SamplingTensors
from specserve.spec_decode.drafting import OneShotSpeculator
from specserve.spec_decode.parallel_inputs import expand_regions

if TYPE_CHECKING:
    from specserve.spec_decode.interface import DraftRunner
    from specserve.step_inputs import StepInputs


class MultiLayerMTPSpeculator(OneShotSpeculator):
    model: MultiLayerMTPDrafter

    def __init__(
        self, spec: SpeculativeConfig, drafter: MultiLayerMTPDrafter, device: torch.device
    ) -> None:
        super().__init__(spec, drafter, device)
        if len(drafter.mtp) != self.k:
            raise ValueError(
                f"speculative_config.num_speculative_tokens: multi-layer MTP needs one module per "
                f"draft, got {len(drafter.mtp)} module(s) for K = {self.k}"
            )
        # [K - 1, rows, hidden]: module k's output at its last verified position, per request row.
        self._carry: torch.Tensor | None = None

    @property
    def kv_lookahead(self) -> int:
        # Chain step k's KV at i reads t_{i+k} and is rewritten until that token is verified.
        return self.k

    def _lazy_carry(self, runner: DraftRunner, hidden: torch.Tensor) -> torch.Tensor:
        if self._carry is None:
            n = runner.states.num_rows  # every persistent row (padding rows included)
            self._carry = hidden.new_zeros(max(self.k - 1, 1), n, hidden.shape[1])
        return self._carry

    def module_inputs(
        self,
        runner: DraftRunner,
        inp: StepInputs,
        # [B, max_blocks] int32: the batch's block-table rows
        block_table: torch.Tensor,
        # [B] last verified slot of each request
        v: torch.Tensor,
        shift: int,
    ) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor]:
        """Batch of the module shifted back by `shift` positions: (metadata, token ids [N],
        region offset s [N]) with N = num_tokens + num_reqs * shift."""
        B, T = inp.num_reqs, inp.num_tokens
        qsl = inp.query_start_loc.long()
        N = T + B * shift
        req, s = expand_regions(qsl, shift, N)
        start = inp.positions[qsl[:-1]][req]
        row = inp.idx_mapping[req]
        pos = start + s - shift
        ids = runner.states.token_ids[row, start + s + 1]
        # Verified and chain slots write KV; rejected padding, positions below 0 and a padded
        # row of a captured batch (the scratch row) do not, nor positions below a prefix-cache
        # hit: their blocks are shared and their KV final for every module (kv_lookahead), and
        # no carry reaches them (the hit was never drafted from here). Positions past the hit
        # read hidden states of positions past it only, so they are exact.
        floor = runner.states.kv_floor[row]
        valid = (s <= v[req] + shift) & (pos >= floor) & (row != runner.states.scratch_row)
        safe = pos.clamp(min=0)
        bs = runner.block_size
        blk = runner.states.block_table[row, safe // bs].long()
        meta = CommonAttentionMetadata(
            query_start_loc=(qsl + torch.arange(B + 1, device=qsl.device) * shift).to(torch.int32),
            seq_lens=inp.seq_lens.to(torch.int32),
            positions=safe,
            block_table=block_table,
            slot_mapping=torch.where(valid, blk * bs + safe % bs, -1),
            token_req=req,
            num_reqs=B,
            num_tokens=N,
            max_query_len=inp.max_query_len + shift,
            max_seq_len=inp.max_seq_len,
        )
        return meta, ids, s

    # ---- the surface DraftGraphRunner captures (see worker/draft_graphs.py) ----------
    def draft_prefill(
        self,
        runner: DraftRunner,
        inp: StepInputs,
        ctx: ForwardContext | None,
        # [T, hidden] target hidden states (final norm)
        hidden: torch.Tensor,
        aux: list[torch.Tensor],
        # [B] drafts accepted per request
        num_acc: torch.Tensor,
        st: SamplingTensors,
    ) -> tuple[None, None]:
        """The whole proposal: every module over its shifted batch, one draft each. Graph-safe:
        sizes come from the host (`inp`), nothing is read back. `ctx` (the target's) is unused:
        each module's batch has its own metadata."""
        B = inp.num_reqs
        rows = inp.idx_mapping
        qsl = inp.query_start_loc.long()
        ar = torch.arange(B, device=qsl.device)
        # [B] last verified slot, and the position P whose target hidden is the newest verified.
        v = qsl[1:] - qsl[:-1] - 1 - inp.num_draft + num_acc
        P = inp.positions[qsl[:-1] + v]
        carry = self._lazy_carry(runner, hidden)
        # NOTE: read every module's carry before this step overwrites any of it.
        carried = carry[:, rows]
        block_table = runner.states.block_table[rows]
        scratch = runner.states.token_ids.shape[1] - 1
        prev, prev_first = hidden, qsl[:-1]
        for i, module in enumerate(self.model.mtp):
            meta, ids, s = self.module_inputs(runner, inp, block_table, v, i)
            req = meta.token_req
            if i == 0:
                h_in = hidden
            else:
                # Slot s reads module i-1's output at slot s - 1; slot 0 its carried output.
                src = torch.where(s == 0, prev.shape[0] + req, prev_first[req] + s - 1)
                h_in = torch.cat([prev, carried[i - 1]])[src]
            out, _ = module(ids, meta.positions, h_in, runner.forward_context(meta))
            first = qsl[:-1] + ar * i
            logits = module.draft_logits(out[first + v + i]).float()
            # Module i (0-based) at position P predicts the token at P + i + 2.
            dpos = P + i + 2
            col = torch.where(inp.samples > 0, dpos, scratch)
            self.store_drafts(runner, module, logits, st, rows, dpos[:, None], col[:, None], i)
            if i + 1 < self.k:
                carry[i, rows] = out[first + v]
            prev, prev_first = out, first
        return None, None
