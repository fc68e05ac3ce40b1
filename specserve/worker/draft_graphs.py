"""CUDA graphs of the drafting loop, for batches whose target forward replayed a graph.

Four graph kinds per padded batch size b (the target's capture sizes):
  prefill (q, b)  draft prefill over the target graph's own buffers and outputs (q = 1 or K + 1
                  tokens per request), d1 sampled for shift-1 drafters; leaves the first decode
                  step's inputs (positions, carried hidden) in this runner's buffers
  step b          ONE single-token draft step: metadata built from the position buffer (so it is
                  rebuilt on every replay), forward, logits, sample into the token buffer at the
                  column `current_draft_step` names, then positions and the step advance in place;
                  replayed K-1 times
  loop b          the whole K-1 step loop in one graph: metadata built once, then advanced in
                  place between steps by the backend (`advance_context_`); only when the backend
                  supports it (`supports_inplace_advance`)
  kv (1, b)       the draft prefill's KV writes alone (`prefill_kv`): a k = 0 step that keeps
                  the drafter's KV (`tracks_kv_at_zero`) drafts nothing, as the eager path does not
Draft trees (spec_decode/tree.py) capture one graph kind instead, per (q, b):
  tree (q, b)     the whole tree drafting: the draft prefill over the accepted paths (the target
                  graph's hidden states gathered into chain order through `perm`, which the
                  runner fills from verification), then every expansion level, the selection
                  of K nodes and their writes; a budget of n < K verifies the first n
PTD (ParallelDraftSpeculator) has no decode steps: its "prefill" graph is the whole proposal, one
drafter forward over the enlarged batch (b * (q + E) slots). Multi-layer MTP
(MultiLayerMTPSpeculator) has none either: its "prefill" graph is the whole module chain, module k
over b * (q + k - 1) slots with its metadata built inside the graph (rebuilt between modules on
every replay), so it needs no in-place advance and every mode but eager captures that one graph.
Padded rows point at the scratch row of the request state with samples = 0, so all their writes
are discarded. Every body runs in `uniform_batch(b, b)` (ops/graph_rows.py), as the target's
capture does: its row-dependent kernel choices (decode matmul plan, skinny tile, MoE switches,
attention split counts, MLA's fused path) are those of the eager drafting of any batch B padded
to b, which the runner runs in `uniform_batch(B, b)` (cudagraph.eager_rows), so a draft graph
drafts the eager loop's bits also where q (tokens per request) is not a power of two. Sampling parameters are copied into fixed buffers; a batch that needs top-k, top-p
or min-p for probabilistic drafting falls back to the eager loop.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from specserve.ops.graph_rows import uniform_batch
from specserve.sample.sampler import SamplingTensors

if TYPE_CHECKING:
    from specserve.attention.backend import ForwardContext
    from specserve.spec_decode.autoregressive import AutoregressiveSpeculator
    from specserve.spec_decode.multi_layer_mtp import MultiLayerMTPSpeculator
    from specserve.spec_decode.parallel import ParallelDraftSpeculator
    from specserve.step_inputs import StepInputs
    from specserve.worker.cudagraph import CudaGraphRunner
    from specserve.worker.model_runner import ModelRunner

MODES = ("auto", "fused", "per_step", "eager")


class DraftGraphRunner:
    def __init__(
        self,
        runner: ModelRunner,
        spec: AutoregressiveSpeculator | ParallelDraftSpeculator | MultiLayerMTPSpeculator,
        target: CudaGraphRunner,
        mode: str = "auto",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"draft_graph_mode must be one of {', '.join(MODES)}, got {mode!r}")
        # A weak proxy to the runner, which holds this object (see CudaGraphRunner.__init__).
        self.runner, self.spec, self.target = weakref.proxy(runner), spec, target
        can_fuse = runner.backend.supports_inplace_advance and getattr(
            spec, "advance_draft_positions", False
        )
        if mode == "fused" and not can_fuse and spec.num_decode_steps > 1:
            raise ValueError(
                f"draft_graph_mode=fused needs an attention backend with in-place metadata "
                f"advance; {runner.backend.name} has none"
            )
        self.fused = can_fuse and mode in ("auto", "fused")
        self.sizes = target.sizes
        max_b, dev = self.sizes[-1], runner.device
        self.rows = torch.full((max_b,), runner.states.scratch_row, dtype=torch.int64, device=dev)
        self.num_acc = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self.num_draft = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self.samples = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self.h: torch.Tensor | None = None  # [max_b, hidden], allocated at the first capture
        self.temperature = torch.zeros(max_b, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(max_b, dtype=torch.int64, device=dev)
        # Draft trees: [max_t] the target token whose hidden state each chain slot takes.
        self.tree = getattr(spec, "tree", None)
        if self.tree is not None:
            self.ident = torch.arange(max_b * max(target.query_lens), device=dev)
            self.perm = self.ident.clone()
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        # NOTE: allocated before capture: a captured graph must not allocate it.
        spec.ensure_draft_probs(runner)
        self._capture_all()

    # ---- bodies (run eagerly for warm-up, then captured) ----------------------------------
    def _st(self, b: int) -> SamplingTensors:
        # Temperature and seed only: other filters fall back to eager (see can_run).
        return SamplingTensors(
            temperature=self.temperature[:b],
            top_k=torch.zeros_like(self.seeds[:b]),
            top_p=torch.ones_like(self.temperature[:b]),
            min_p=torch.zeros_like(self.temperature[:b]),
            seeds=self.seeds[:b],
            all_greedy=False,
            any_top_k=False,
            any_top_p=False,
            any_min_p=False,
        )

    def _prefill(self, q: int, b: int) -> None:
        with uniform_batch(b, b):
            self._prefill_body(q, b)

    def _target_view(
        self, q: int, b: int, chain: bool = False
    ) -> tuple[SimpleNamespace, ForwardContext, torch.Tensor, list[torch.Tensor]]:
        """(inputs, forward context, hidden, aux) of the target graph (q, b): what the drafter
        reads. `chain`: causal metadata over a tree's accepted paths."""
        ctx = self.runner.forward_context(self.target._common(b, q, chain=chain))
        return (self._inputs(q, b), ctx, *self.target.outputs[(q, b)])

    def _prefill_body(self, q: int, b: int) -> None:
        inp, ctx, hidden, aux = self._target_view(q, b)
        pos, h = self.spec.draft_prefill(
            self.runner, inp, ctx, hidden, aux, self.num_acc[:b], self._st(b)
        )
        if pos is not None:
            self.pos[:b].copy_(pos)
        if h is not None:
            if self.h is None:
                self.h = torch.zeros(self.sizes[-1], h.shape[1], dtype=h.dtype, device=h.device)
            self.h[:b].copy_(h)

    def _kv_only(self, b: int) -> None:
        with uniform_batch(b, b):
            inp, ctx, hidden, aux = self._target_view(1, b)
            self.spec.prefill_kv(self.runner, inp, ctx, hidden, aux, self.num_acc[:b])

    def _tree(self, q: int, b: int) -> None:
        with uniform_batch(b, b):
            # The drafter sees the accepted paths as chains: causal metadata, hidden states
            # in chain order.
            inp, ctx, hidden, aux = self._target_view(q, b, chain=True)
            perm = self.perm[: b * q]
            hidden, aux = hidden[perm], [a[perm] for a in aux]
            st = None if self.spec.greedy_draft else self._st(b)
            self.tree.draft(self.spec, self.runner, inp, ctx, hidden, aux, self.num_acc[:b], st)

    def _inputs(self, q: int, b: int) -> SimpleNamespace:
        """The StepInputs fields the drafting reads, over this runner's and the target graph's
        buffers."""
        t, cg = b * q, self.target
        return SimpleNamespace(
            idx_mapping=self.rows[:b],
            token_req=cg.token_req[:t],
            positions=cg.positions[:t],
            query_start_loc=cg.query_start_loc[: b + 1],
            seq_lens=cg.seq_lens[:b],
            num_draft=self.num_draft[:b],
            samples=self.samples[:b],
            num_reqs=b,
            num_tokens=t,
            max_query_len=q,
            max_seq_len=self.runner.max_model_len,
        )

    def _steps(self, b: int, n: int) -> None:
        with uniform_batch(b, b):
            self._steps_body(b, n)

    def _steps_body(self, b: int, n: int) -> None:
        """`n` draft steps: n = 1 rebuilds metadata from the buffers; n > 1 advances in place."""
        r, spec = self.runner, self.spec
        rows, pos = self.rows[:b], self.pos[:b]
        ctx = r.forward_context(spec.decode_metadata(r, rows, pos, r.max_model_len))
        h = self.h[:b] if self.h is not None else None
        for j in range(n):
            h = spec.draft_step(r, rows, pos, h, self.samples[:b], self._st(b), ctx)
            if j < n - 1:
                # positions (this buffer), seq_lens and slots advance for the next step
                r.backend.advance_context_(ctx, r.block_size)
        if h is not None and self.h is not None:
            self.h[:b].copy_(h)
        if spec.advance_draft_positions:
            pos.add_(1)

    # ---- capture ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _capture_all(self) -> None:
        n = self.spec.num_decode_steps
        gc.collect()
        gc.disable()  # see CudaGraphRunner._capture_all
        try:
            for b in reversed(self.sizes):
                for q in self.target.query_lens:
                    # Consistent dummy inputs for warm-up and capture: the target buffers as
                    # the target graph pads them, every row a padded row.
                    self.target._fill_dummy(b, q)
                    self.num_draft[:b].fill_(q - 1)
                    if self.tree is not None:
                        self._capture(("tree", q, b), lambda q=q, b=b: self._tree(q, b))
                    else:
                        self._capture(("prefill", q, b), lambda q=q, b=b: self._prefill(q, b))
                if self.tree is not None:
                    continue
                if self.spec.tracks_kv_at_zero:
                    self.target._fill_dummy(b, 1)
                    self.num_draft[:b].zero_()
                    self._capture(("kv", 1, b), lambda b=b: self._kv_only(b))
                first = self.num_steps_before_decode
                if n > 0:
                    # A replay always follows the prefill: start warm-up and capture from the
                    # step the prefill leaves, so the probs column stays inside [0, K).
                    self.spec.current_draft_step.fill_(first)
                    self._capture(("step", 1, b), lambda b=b: self._steps(b, 1))
                if n > 1 and self.fused:
                    self.spec.current_draft_step.fill_(first)
                    self._capture(("loop", n, b), lambda b=b: self._steps(b, n))
        finally:
            gc.enable()
        torch.cuda.synchronize()

    @property
    def num_steps_before_decode(self) -> int:
        return self.spec.k - self.spec.num_decode_steps

    def _capture(self, key: tuple[str, int, int], body: object) -> None:
        step = getattr(self.spec, "current_draft_step", None)  # PTD has none
        step0 = step.clone() if step is not None else None
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            body()  # type: ignore[operator]
        torch.cuda.current_stream().wait_stream(s)
        if step is not None:
            step.copy_(step0)  # the warm-up advanced it
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.target.pool):
            body()  # type: ignore[operator]
        self.graphs[key] = g

    # ---- replay ----------------------------------------------------------------------------
    def can_run(self, st: SamplingTensors) -> bool:
        return self.spec.greedy_draft or not (st.any_top_k or st.any_top_p or st.any_min_p)

    def run(
        self,
        inp: StepInputs,
        num_acc: torch.Tensor,
        st: SamplingTensors,
        q: int,
        bg: int,
        num_drafts: int | None = None,
        # [T] draft trees: chain order of the verified tokens (None: the identity)
        chain: torch.Tensor | None = None,
    ) -> None:
        B = inp.num_reqs
        self.rows[:B].copy_(inp.idx_mapping)
        self.rows[B:bg].fill_(self.runner.states.scratch_row)
        for buf, src in (
            (self.num_acc, num_acc),
            (self.num_draft, inp.num_draft),
            (self.samples, inp.samples),
        ):
            buf[:B].copy_(src)
            buf[B:bg].zero_()
        # Padded rows: 0 accepted of q - 1 drafts -> their "last token" is their first slot.
        self.num_draft[B:bg].fill_(q - 1)
        if not self.spec.greedy_draft:
            self.temperature[:B].copy_(st.temperature)
            self.temperature[B:bg].zero_()
            self.seeds[:B].copy_(st.seeds)
        if self.tree is not None:
            # The whole tree even for num_drafts == 0 (one graph; the next step verifies none).
            T, tg = inp.num_tokens, bg * q
            src = chain if chain is not None else self.ident[:T]
            self.perm[:T].copy_(src)
            self.perm[T:tg].copy_(self.ident[T:tg])  # padded rows: themselves
            self.graphs[("tree", q, bg)].replay()
            return
        if num_drafts == 0 and (kv := self.graphs.get(("kv", q, bg))) is not None:
            kv.replay()  # the drafter's KV only: this k = 0 step drafts nothing
            return
        self.graphs[("prefill", q, bg)].replay()
        n = self.spec.decode_steps_for(num_drafts)
        if n > 1 and n == self.spec.num_decode_steps and self.fused:
            self.graphs[("loop", n, bg)].replay()
        else:  # fewer steps (dynamic K) or no fused loop: replay the step graph n times
            for _ in range(n):
                self.graphs[("step", 1, bg)].replay()
