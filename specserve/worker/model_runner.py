"""The model runner: one target forward per step, verification, sampling, drafting.

Per step: prepare inputs (host numpy -> one upload) -> gather input ids from the persistent
token buffer -> target forward (eager or CUDA graph) -> verify drafts / sample -> write accepted
tokens back on the device -> drafter proposes the next drafts from the device state -> ONE
device-to-host copy of (tokens, accept counts, logprobs). `launch` queues all of it and starts
the copy; `finish` waits for it, so the engine may schedule and launch the next step in between
(async scheduling).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from specserve import ops
from specserve.attention.backend import (
    CommonAttentionMetadata,
    ForwardContext,
    build_forward_context,
)
from specserve.attention.registry import get_attn_backend
from specserve.config import EngineConfig
from specserve.ops import greedy_head
from specserve.ops.spec_kernels import (
    place_on_device_,
    prepare_target_inputs,
    write_verified_tokens_,
)
from specserve.request import Request
from specserve.sample.logits_processors import (
    apply_logits_processors,
    build_logits_processor_inputs,
)
from specserve.sample.rejection import rejection_sample
from specserve.sample.sampler import SamplingTensors, compute_logprobs, sample
from specserve.scheduler_output import SchedulerOutput
from specserve.spec_decode.drafting import TargetStep
from specserve.spec_decode.interface import NO_DRAFTER, Speculator
from specserve.spec_decode.tree import chain_order
from specserve.step_inputs import StepInputs
from specserve.structured.bitmask import apply_grammar_bitmask_, build_grammar_step
from specserve.worker.cudagraph import eager_rows
from specserve.worker.input_batch import prepare_inputs
from specserve.worker.request_states import RequestStates
from specserve.worker.step_results import HostPacket, PendingStep, StepOutput, unpack_step
from specserve.worker.tree_step import (
    TreeFields,
    chain_metadata,
    check_tree_support,
    move_accepted_kv,
    tree_fields,
    verify_tree,
    with_tree,
)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        max_model_len: int,
        num_blocks: int,
        speculator: Speculator | None = None,
    ) -> None:
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        # The KV cache's element type: the model's dtype, or fp8 (attention/kv_quant.py).
        self.kv_dtype = config.kv_cache_torch_dtype
        # calculate_kv_scales: kv_index of the layers whose fp8 scales the next eager forwards
        # compute (ForwardContext.kv_scales_todo); the engine fills it after the warm-up, so
        # the scales come from the first real prefill, not from warm-up's dummy tokens.
        self.kv_scales_todo: set[int] = set()
        self.model = model
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.vocab_size: int = model.config.vocab_size
        self.speculator = speculator
        # EOS ids masked (with stop_token_ids) until min_tokens; the engine sets them.
        self.eos_token_ids: frozenset[int] = frozenset()
        spec = config.spec
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.backend = get_attn_backend(config.attention_backend, self.device, max_model_len)
        self.null_block = num_blocks
        self.max_blocks_per_req = (max_model_len + self.block_size - 1) // self.block_size
        self.states = RequestStates(
            config.max_num_seqs,
            max_model_len,
            self.max_blocks_per_req,
            self.null_block,
            self.num_spec_tokens,
            self.device,
        )
        self.kv_caches = self._allocate_kv(num_blocks)
        # Draft trees (worker/tree_step.py): the speculator's tree drafter, or None.
        self.tree = None
        if speculator is not None:
            speculator.bind_rows(self.states.num_rows)
            self.tree = speculator.tree
        self.num_target_kv = len(self._target_layers())  # first in kv_caches
        # A greedy step's tokens from the lm_head gemv's argmax epilogue (ops/greedy_head.py).
        self.greedy_keys = greedy_head.new_keys(config.max_num_seqs, self.device)
        self.windows = set(model.sliding_windows())
        if speculator is not None:
            self.windows |= speculator.sliding_windows()
        self.aux_layers = speculator.aux_layers() if speculator is not None else ()
        if self.tree is not None:
            check_tree_support(self.backend, self.windows, self.num_spec_tokens)
        self.cudagraphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            from specserve.worker.cudagraph import CudaGraphRunner

            self.cudagraphs = CudaGraphRunner(self)
        self.draft_graphs = None
        # Set to a list by benchmarks: (start, end) CUDA events around each step's drafting.
        self.draft_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        if self.cudagraphs is not None and config.draft_graph_mode != "eager":
            # The shared loop, PTD's one forward and the multi-layer MTP module chain.
            if speculator is not None and speculator.graph_capturable:
                from specserve.worker.draft_graphs import DraftGraphRunner

                self.draft_graphs = DraftGraphRunner(
                    self, speculator, self.cudagraphs, config.draft_graph_mode
                )

    def close(self) -> None:
        """Drop the captured graphs (and with them their private memory pool), the KV cache and
        the persistent request buffers now, whoever still holds the runner; it is unusable
        afterwards. `del llm` frees the same without it (no reference cycles)."""
        self.draft_graphs = None
        self.cudagraphs = None
        self.kv_caches = []
        self.target_kv = None

    # ---- KV cache -------------------------------------------------------------------------
    def _target_layers(self) -> list[torch.nn.Module]:
        from specserve.models.layers import KVCacheLayer

        return [m for m in self.model.modules() if isinstance(m, KVCacheLayer)]

    def attention_layers(self) -> list[torch.nn.Module]:
        from specserve.models.layers import KVCacheLayer

        mods = self._target_layers()
        if self.speculator is not None and self.speculator.model is not None:
            mods += [m for m in self.speculator.model.modules() if isinstance(m, KVCacheLayer)]
        return mods

    def _allocate_kv(self, num_blocks: int) -> list[torch.Tensor]:
        """One cache a layer, the target's first. Target layers of one shape are views of one
        tensor (`target_kv`, [layers, *shape]), so that moving a tree's accepted KV is one
        gather and one scatter for all of them (worker/tree_step.py), not two a layer."""
        layers = self.attention_layers()
        n = len(self._target_layers())
        # +1: the null block (see BlockPool). The layer says its layout (MLA: a latent).
        shapes = [m.kv_cache_shape(num_blocks + 1, self.block_size) for m in layers]
        kw = {"dtype": self.kv_dtype, "device": self.device}
        self.target_kv: torch.Tensor | None = None
        if n and len({tuple(x) for x in shapes[:n]}) == 1:
            self.target_kv = torch.zeros(n, *shapes[0], **kw)
        caches = []
        for i, (layer, shape) in enumerate(zip(layers, shapes)):
            layer.kv_index = i
            own = i < n and self.target_kv is not None
            caches.append(self.target_kv[i] if own else torch.zeros(shape, **kw))
        return caches

    @staticmethod
    def kv_bytes_per_block(
        layers: list[torch.nn.Module], block_size: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(block_size * m.kv_elems_per_token() * elem for m in layers)

    # ---- request rows ---------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.states.add(req)

    def remove_request(self, req: Request) -> None:
        self.states.remove(req)

    # ---- one step -------------------------------------------------------------------------
    def common_metadata(
        self,
        inp: StepInputs,
        # [T] int64 and [B, max_blocks] int32, from prepare_target_inputs
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
    ) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=inp.query_start_loc.to(torch.int32),
            seq_lens=inp.seq_lens.to(torch.int32),
            positions=inp.positions,
            block_table=block_table,
            slot_mapping=slot_mapping,
            token_req=inp.token_req,
            num_reqs=inp.num_reqs,
            num_tokens=inp.num_tokens,
            max_query_len=inp.max_query_len,
            max_seq_len=inp.max_seq_len,
        )

    def forward_context(self, common: CommonAttentionMetadata) -> ForwardContext:
        ctx = build_forward_context(self.backend, common, self.kv_caches, self.windows)
        if self.kv_scales_todo:
            ctx.kv_scales_todo = self.kv_scales_todo
        return ctx

    def execute(
        self, sched: SchedulerOutput, reqs_logprobs: list[int], num_drafts: int | None = None
    ) -> StepOutput:
        """`num_drafts`: drafts to propose for the next step (None: all K; dynamic K; 0: the
        draft prefill only, keeping the drafter's KV; NO_DRAFTER: the drafter does not run)."""
        return self.finish(self.launch(sched, reqs_logprobs, num_drafts))

    @torch.inference_mode()
    def launch(
        self, sched: SchedulerOutput, reqs_logprobs: list[int], num_drafts: int | None = None
    ) -> PendingStep:
        """Queue the whole step on the device, its results copied to the host asynchronously;
        `finish` waits for them. Nothing here waits for the device.

        Phases: inputs -> forward -> verify / sample -> propose -> copy out."""
        inp = self._prepare_inputs(sched)
        fwd = self._forward(inp)
        # Structured requests: their masks are filled on the host now, while the device runs
        # the forward just queued (CUDA), and uploaded asynchronously. None: no grammar here.
        k1 = self.num_spec_tokens + 1
        gs = build_grammar_step(sched.scheduled, k1, self.vocab_size, self.device)
        ver = self._verify_and_sample(sched, inp, fwd, gs)
        # NOTE: before drafting, which may reuse the target graph's output buffers.
        prompt_lp = self._prompt_logprobs(sched, inp, fwd.hidden)
        # NOTE: NO_DRAFTER (the adaptive budget's 0 when the drafter's KV is not kept) runs no
        # drafter: its KV keeps holes at these positions, which only lowers acceptance after a
        # switch back. 0 runs the draft prefill only: the drafter's KV stays complete.
        skip = num_drafts == NO_DRAFTER
        if self.speculator is not None and not skip:
            self._propose(inp, fwd, ver, num_drafts)
        next_drafts = next_parents = None
        if gs is not None and self.speculator is not None and not self.speculator.proposes_on_host:
            next_drafts = self._next_drafts(inp, ver.num_acc)
            if self.tree is not None:  # a tree's masks follow each node's path: its parents
                next_parents = self.tree.state.parent[inp.idx_mapping]
        return self._start_copy(inp, ver, reqs_logprobs, prompt_lp, next_drafts, next_parents)

    def finish(self, pending: PendingStep) -> StepOutput:
        """Wait for a launched step's results and unpack them."""
        return unpack_step(pending)

    # ---- phase 1: inputs ------------------------------------------------------------------
    def _prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """New requests take their rows, block tables are synced and uploaded, the step's
        inputs go up in one copy, and host-proposed drafts land in the token buffer."""
        for s in sched.scheduled:
            if s.req.row < 0:
                self.add_request(s.req)
            self.states.sync_blocks(s.req)
        self.states.upload_block_table()
        inp = prepare_inputs(sched, self.num_spec_tokens, self.device)
        if inp.start_on_device is not None:
            self._place_on_device(inp)
        if inp.host_drafts.shape[1] > 0:
            hd = inp.host_drafts
            self.states.token_ids[hd[0], hd[1]] = hd[2]
        return inp

    # ---- phase 2: the target forward ------------------------------------------------------
    def _forward(self, inp: StepInputs) -> TargetForward:
        """The target forward: a CUDA graph replay where the batch has one, else eager."""
        graphs = self.cudagraphs
        tf = tree_fields(self.tree, inp)
        bg = graphs.padded_batch(inp) if graphs is not None else None
        if graphs is not None:
            graphs.last_replayed = None
        # One launch on CUDA: input ids, slot mapping and block-table rows (into the graph's
        # input buffers when it replays, with its positions and seq_lens).
        input_ids, slot_mapping, block_table = prepare_target_inputs(
            self.states.token_ids, self.states.block_table, inp.idx_mapping, inp.token_req,
            inp.positions, self.block_size,
            graphs.input_buffers(inp) if bg is not None else None,
            (inp.seq_lens, *graphs.meta_buffers(inp)) if bg is not None else None,
        )  # fmt: skip
        fwd = TargetForward(slot_mapping, block_table, tree=tf)
        if bg is not None:
            fwd.hidden, fwd.aux = graphs.replay(inp, bg, tf)
            fwd.replayed = graphs.last_replayed
        else:
            ctx = self._context(inp, fwd)
            # A uniform batch chooses its kernels as its graph would (ops/graph_rows.py).
            pos = inp.positions if tf is None else tf.rope_positions
            with self._eager_rows(inp):
                fwd.hidden, fwd.aux = self.model(input_ids, pos, ctx, self.aux_layers)
        return fwd

    def _context(self, inp: StepInputs, fwd: TargetForward) -> ForwardContext:
        """The step's attention metadata, built once, when something runs eagerly."""
        if fwd.ctx is None:
            fwd.common = self.common_metadata(inp, fwd.slot_mapping, fwd.block_table)
            fwd.common = with_tree(fwd.common, fwd.tree)
            fwd.ctx = self.forward_context(fwd.common)
        return fwd.ctx

    # ---- phase 3: verify and sample -------------------------------------------------------
    def _verify_and_sample(
        self, sched: SchedulerOutput, inp: StepInputs, fwd: TargetForward, gs: object | None
    ) -> Verified:
        """Logits of the verified slots, masks and processors, then rejection sampling of the
        drafts (or plain sampling) and the accepted tokens written to the token buffer."""
        k = self.num_spec_tokens
        B, k1 = inp.num_reqs, k + 1
        tok = self.states.token_ids
        d = int(inp.num_draft_np.max()) if k > 0 and B > 0 else 0
        drafted = d > 0
        # Rows of logits a request: 1 + the most drafts any request of the step verifies, not
        # K + 1 (lm_head, processors and sampling over K + 1 rows made a step of the adaptive
        # budget at k = 1 under K = 5 cost 0.4-0.45 ms more than a fixed K = 1 step, 5-6%:
        # Llama-3-8B shape, batch 64, H100 and H200). Trees verify their K + 1 nodes; grammar
        # masks keep K + 1 rows. A uniform batch with `rows - 1` drafts everywhere has its
        # verified slots in token order: no gather.
        verified = fwd.hidden
        rows = k1 if gs is not None or (drafted and fwd.tree is not None) else d + 1
        if rows == 1 and inp.num_tokens != B:
            verified = fwd.hidden[inp.logits_indices[:, 0]]
        elif rows > 1 and (inp.num_tokens != B * rows or (inp.num_draft_np != rows - 1).any()):
            verified = fwd.hidden[inp.logits_indices[:, :rows].flatten()]
        state_rows = np.fromiter((s.req.row for s in sched.scheduled), np.int64, B)
        # Without a speculator only sampling reads the sampling parameters, and greedy
        # sampling reads none: no gathers then.
        greedy_only = self.speculator is None and self.states.all_greedy(state_rows)
        lpi = build_logits_processor_inputs(
            [s.req for s in sched.scheduled], self.eos_token_ids, self.device
        )
        # Greedy tokens of the logits as the lm_head computes them: from its gemv's epilogue
        # where it runs one (ops/greedy_head.py; no speculator, so one row a request).
        fused = None
        if greedy_only and gs is None and lpi is None:
            fused = self.model.greedy_logits(verified, self.greedy_keys)
        # In the model dtype: sampling and logprobs convert what they need (argmax needs no
        # fp32 copy of a 128k-vocabulary row: one kernel less per decode step).
        logits = fused[0] if fused is not None else self.model.compute_logits(verified)
        logits = logits.view(B, rows, -1)
        if gs is not None:
            # The grammar step: forbidden tokens -> -inf at every slot, before verification and
            # sampling read the logits (logprobs too, as in vLLM). Masking before the logits
            # processors below is exactly processors-then-mask: -inf stays -inf under each of
            # them (bias added, penalties subtracted, repetition scales by a positive factor)
            # and the mask leaves finite logits alone; this order masks one tensor, which
            # logprobs and sampling then share.
            apply_grammar_bitmask_(logits, gs)
        # Penalties, logit_bias, min_tokens: only when a request of the batch uses them (a new
        # tensor: logprobs keep the unprocessed logits, vLLM's default).
        target_logits = logits
        if lpi is not None:
            target_logits = apply_logits_processors(
                logits, tok, inp.idx_mapping, inp.out_pos0, inp.max_seq_len, lpi
            )
        st = None if greedy_only else self.states.sampling_tensors(state_rows, inp.idx_mapping)
        num_acc = None  # nothing drafted: 0 accepted everywhere
        if not drafted:
            lg = target_logits[:, 0]
            if fused is not None:
                out_tokens = fused[1].view(B, 1)
            else:
                out_tokens = ops.argmax(lg) if st is None else sample(lg, st, inp.out_pos0)
                out_tokens = out_tokens.view(B, 1)
            if k:
                out_tokens = torch.cat([out_tokens, out_tokens.new_full((B, k), -1)], 1)
        elif fwd.tree is not None:
            method = self.config.spec.rejection_sample_method
            out_tokens, num_acc, path = verify_tree(self, inp, target_logits.float(), st, method)
            fwd.chain = chain_order(inp, path, k)
            # Target layers come first in kv_caches (attention_layers); the drafter's KV is
            # rewritten by its prefill over the accepted path.
            target_kv = self.kv_caches[: self.num_target_kv]
            if self.target_kv is not None:
                target_kv = [self.target_kv]
            move_accepted_kv(target_kv, fwd.slot_mapping, fwd.chain)
        else:
            spec = self.config.spec
            kd = rows - 1  # drafts verified a request: d, or K under a grammar
            draft_pos = inp.out_pos0[:, None] + torch.arange(kd, device=self.device)
            draft_tokens = tok[inp.idx_mapping[:, None], draft_pos]
            draft_probs = self.speculator.draft_probs(inp.idx_mapping) if self.speculator else None
            if draft_probs is not None and kd < k:
                draft_probs = draft_probs[:, :kd]
            out_tokens, num_acc = rejection_sample(
                target_logits.float(),
                draft_tokens,
                draft_probs,
                inp.num_draft,
                st,
                inp.out_pos0,
                method=spec.rejection_sample_method,
                synthetic_acceptance_rate=spec.synthetic_acceptance_rate,
            )
            if kd < k:
                out_tokens = torch.cat([out_tokens, out_tokens.new_full((B, k - kd), -1)], 1)
        # With async scheduling the same launch records what this step leaves computed, for a
        # step launched before its results are read.
        computed = self.states.num_computed if self.config.async_scheduling else None
        write_verified_tokens_(
            tok, inp.idx_mapping, inp.out_pos0, out_tokens, num_acc, inp.samples, computed,
            inp.seq_lens, inp.num_draft,
        )  # fmt: skip
        return Verified(logits, out_tokens, num_acc, st)

    # ---- phase 4: propose the next drafts -------------------------------------------------
    def _propose(
        self, inp: StepInputs, fwd: TargetForward, ver: Verified, num_drafts: int | None
    ) -> None:
        """The drafter writes the next step's drafts into the token buffer: the captured
        drafting loop where the target replayed a graph, else eagerly."""
        assert self.speculator is not None
        if self.draft_events is not None:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        num_acc = ver.num_acc
        if num_acc is None:
            num_acc = torch.zeros(inp.num_reqs, dtype=torch.int64, device=self.device)
        if self.draft_graphs is not None and fwd.replayed and self.draft_graphs.can_run(ver.st):
            self.draft_graphs.run(
                inp, num_acc, ver.st, *fwd.replayed, num_drafts=num_drafts, chain=fwd.chain
            )
        else:
            ctx = self._context(inp, fwd)  # eager drafting needs the metadata
            kw = {"num_drafts": num_drafts} if num_drafts is not None else {}
            common, hidden, aux = fwd.common, fwd.hidden, fwd.aux
            if fwd.tree is not None:  # the drafter sees the accepted paths as chains
                common = chain_metadata(common)
                ctx = self.forward_context(common)
                if fwd.chain is not None:
                    hidden, aux = hidden[fwd.chain], [a[fwd.chain] for a in aux]
            t = TargetStep(inp, common, ctx, hidden, aux, num_acc, ver.st)
            # Drafter forwards of a uniform batch (B x rows each) choose their kernels as
            # the draft graphs of its padded batch do (DraftGraphRunner).
            with self._eager_rows(inp):
                self.speculator.propose(self, t, **kw)
        if self.draft_events is not None:
            ev[1].record()
            self.draft_events.append(ev)

    def _prompt_logprobs(
        self,
        sched: SchedulerOutput,
        inp: StepInputs,
        # [T, hidden] the target's hidden states of every scheduled token
        hidden: torch.Tensor,
    ) -> tuple[list[tuple[int, int, int]], int, dict[str, torch.Tensor]] | None:
        """Logprobs of the prompt tokens this step's prefill chunks cover, for requests that
        ask (`prompt_logprobs`): from the chunk's own hidden states, no second forward.

        The hidden state at position t predicts token t + 1, so a chunk [start, start + n)
        covers prompt tokens start + 1 .. min(start + n + 1, prompt_len) - 1. Tokens already
        covered (a request recomputed after preemption) are skipped."""
        spans, idx, ids = [], [], []
        n_top = 0
        q0 = 0
        for b, s in enumerate(sched.scheduled):
            req, n = s.req, s.num_tokens
            want = req.sampling_params.prompt_logprobs
            first = max(s.start + 1, len(req.prompt_logprobs))
            last = min(s.start + n + 1, req.num_prompt_tokens)  # exclusive
            if want is not None and first < last and not s.start_on_device:
                spans.append((b, first, last - first))
                idx.extend(range(q0 + first - 1 - s.start, q0 + last - 1 - s.start))
                ids.extend(req.prompt_token_ids[first:last])
                n_top = max(n_top, want)
            q0 += n
        if not spans:
            return None
        sel = torch.tensor(idx + ids, dtype=torch.int64).to(self.device, non_blocking=True)
        h_idx, tok_ids = sel[: len(idx)], sel[len(idx) :]
        logits = self.model.compute_logits(hidden[h_idx])
        # The rank (vLLM's: 1 + tokens more likely) comes with the logprobs: one sum per row.
        lp, ranks, top_ids, top_lp = compute_logprobs(logits, tok_ids, max(n_top, 1))
        fields = {
            "prompt_lp": lp,
            "prompt_ids": tok_ids,
            "prompt_ranks": ranks,
            "prompt_top_ids": top_ids,
            "prompt_top_lp": top_lp,
        }
        return spans, n_top, fields

    def _eager_rows(self, inp: StepInputs) -> AbstractContextManager[None]:
        """`cudagraph.eager_rows` for this step's batch: a uniform batch's row bound."""
        return eager_rows(inp.num_reqs, inp.num_tokens, inp.max_query_len, self.config.max_num_seqs)

    def _next_drafts(self, inp: StepInputs, num_acc: torch.Tensor | None) -> torch.Tensor:
        """[B, K] the drafts just proposed (after each request's newest token): structured
        requests need them on the host to fill the next step's masks."""
        k = self.num_spec_tokens
        tok = self.states.token_ids
        newest = inp.out_pos0 if num_acc is None else inp.out_pos0 + num_acc  # None: 0 accepted
        pos = (newest + 1)[:, None] + torch.arange(k, device=self.device)
        return tok[inp.idx_mapping[:, None], pos.clamp_max(tok.shape[1] - 1)]

    def _place_on_device(self, inp: StepInputs) -> None:
        """Rows scheduled behind a step whose accept counts the host has not read: correct
        their host-side start on the device (`place_on_device_`)."""
        place_on_device_(
            self.states.num_computed,
            inp.idx_mapping,
            inp.start_on_device,
            inp.query_start_loc,
            inp.positions,
            inp.seq_lens,
            inp.out_pos0,
        )

    # ---- phase 5: copy out ---------------------------------------------------------------
    def _start_copy(
        self,
        inp: StepInputs,
        ver: Verified,
        reqs_logprobs: list[int],
        prompt_lp: tuple[list[tuple[int, int, int]], int, dict[str, torch.Tensor]] | None,
        # [B, K] int64 next-step drafts to read back, or None
        next_drafts: torch.Tensor | None = None,
        # [B, K + 1] int64 parents of the next step's tree nodes to read back, or None
        next_parents: torch.Tensor | None = None,
    ) -> PendingStep:
        """Start the step's one device-to-host copy of everything the host needs."""
        out_tokens = ver.out_tokens
        B, k1 = out_tokens.shape
        n_top = max(reqs_logprobs) if reqs_logprobs else -1
        fields = {"tokens": out_tokens}
        if ver.num_acc is not None:
            fields["num_accepted"] = ver.num_acc
        if n_top >= 0:
            r = ver.logits.shape[1]  # 1 in a step without drafts: slot 0 only
            lp, _, top_ids, top_lp = compute_logprobs(
                ver.logits.reshape(B * r, -1), out_tokens[:, :r].clamp_min(0).flatten(),
                max(n_top, 1),
            )  # fmt: skip
            pad = (0, 0, 0, k1 - r)
            fields |= {
                "lp": F.pad(lp.view(B, r), pad[2:]),
                "top_ids": F.pad(top_ids.view(B, r, -1), pad),
                "top_lp": F.pad(top_lp.view(B, r, -1), pad),
            }
        spans, p_top = None, 0
        if prompt_lp is not None:
            spans, p_top, prompt_fields = prompt_lp
            fields |= prompt_fields
        if next_drafts is not None:
            fields["next_drafts"] = next_drafts
        if next_parents is not None:
            fields["next_parents"] = next_parents
        return PendingStep(HostPacket.send(fields), B, k1, n_top, spans, p_top)


@dataclass
class TargetForward:
    """What the target forward leaves for verification and drafting."""

    # [T] and [B, max_blocks]: the step's KV slots and block-table rows
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    # [T, hidden] final-norm hidden states; EAGLE-3's taps of the residual stream, each [T, hidden]
    hidden: torch.Tensor | None = None
    aux: list[torch.Tensor] = field(default_factory=list)
    # attention metadata, built only when something runs eagerly
    common: CommonAttentionMetadata | None = None
    ctx: ForwardContext | None = None
    # the graph the target replayed (the draft graphs run behind it), else None
    replayed: tuple[int, int] | None = None
    # draft trees: the step's tree metadata, and [T] the token each chain slot takes its
    # state from after verification (worker/tree_step.py)
    tree: TreeFields | None = None
    chain: torch.Tensor | None = None


@dataclass
class Verified:
    """The step's verification and sampling."""

    # [B, K + 1, vocab] logits of the verified slots (masked; before logits processors)
    logits: torch.Tensor
    # [B, K + 1] accepted drafts then the recovered / bonus token; -1 past them
    out_tokens: torch.Tensor
    # [B] drafts accepted, or None when nothing was drafted
    num_acc: torch.Tensor | None
    st: SamplingTensors | None
