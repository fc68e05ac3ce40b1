"""CUDA graphs for uniform decode batches (every request feeds 1 + K tokens).

Captured at batch sizes 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, up to
max_num_seqs, for query length 1 (plain decode) and 1 + K (verification) for every K the engine
may verify (`graph_query_lens`: all of 0..K under dynamic speculation). Each graph owns fixed
input buffers; a step's input preparation writes into them (ids, slots, block-table rows)
or copies into them (positions, seq_lens) and replays. Metadata building is
captured too (it only reads the buffers), so the backend's derived state is rebuilt per replay.
Padded rows are inert: slot -1 (KV goes to the null block), outputs ignored.

Draft trees: every verification graph (1 + K tokens a request, K > 0) verifies a tree. Its
metadata carries three more buffers, the tree fields of CommonAttentionMetadata (rotary
positions, tree start, ancestor mask: worker/tree_step.py), copied in before a replay; padded
rows are outside any tree. Plain decode (query length 1) stays a chain.
"""

from __future__ import annotations

import gc
import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch

from specserve.attention.backend import CommonAttentionMetadata
from specserve.ops.graph_rows import uniform_batch
from specserve.spec_decode.tree import NO_TREE

if TYPE_CHECKING:
    from specserve.config.speculative import SpeculativeConfig
    from specserve.step_inputs import StepInputs
    from specserve.worker.model_runner import ModelRunner
    from specserve.worker.tree_step import TreeFields


def graph_query_lens(spec: SpeculativeConfig | None) -> list[int]:
    """Tokens per request of the uniform decode batches to capture: 1 (plain decode, and the
    first step after a prefill) and 1 + K for every K the engine may verify. With dynamic
    speculation (the adaptive budget, or a batch-size schedule) that is several K: a K without
    graphs would run its whole target forward eagerly."""
    if spec is None:
        return [1]
    k = spec.num_speculative_tokens
    schedule = spec.num_speculative_tokens_per_batch_size
    if spec.adaptive_budget:
        ks = set(range(k + 1))
    elif isinstance(schedule, dict) and schedule:
        ks = {0, k, *(min(int(v), k) for v in schedule.values())}
    else:
        ks = {0, k}
    return sorted(1 + x for x in ks)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, 1025, 16))
    out = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
    return sorted(set(out))


def padded_size(num_reqs: int, max_num_seqs: int) -> int:
    """The capture size a uniform batch of `num_reqs` requests replays: the smallest >= it."""
    return next((s for s in capture_sizes(max_num_seqs) if s >= num_reqs), num_reqs)


def eager_rows(
    num_reqs: int, num_tokens: int, max_query_len: int, max_num_seqs: int
) -> AbstractContextManager[None]:
    """What an eager target forward runs in: for a uniform batch (every request
    `max_query_len` tokens) `uniform_batch` with the capture size a graph engine pads it to, so
    row-dependent kernel choices (ops/graph_rows.py) match that graph's even without graphs
    (enforce_eager, or a query length with none); else nothing."""
    if num_reqs < 1 or num_tokens != num_reqs * max_query_len:
        return nullcontext()
    return uniform_batch(num_reqs, padded_size(num_reqs, max_num_seqs))


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner) -> None:
        # NOTE: a weak proxy: the runner holds this object, and a strong reference back would make
        # a cycle that only the garbage collector frees, so `del llm` would leave the KV cache
        # and the graphs' memory pool allocated until some later collection.
        self.runner = weakref.proxy(runner)
        self.sizes = capture_sizes(runner.config.max_num_seqs)
        max_b = self.sizes[-1]
        self.query_lens = graph_query_lens(runner.config.spec)
        max_t = max_b * max(self.query_lens)
        dev = runner.device
        self.input_ids = torch.zeros(max_t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_t, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_t,), -1, dtype=torch.int64, device=dev)
        self.token_req = torch.zeros(max_t, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.zeros(max_b + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_b, dtype=torch.int32, device=dev)
        self.block_table = torch.full(
            (max_b, runner.max_blocks_per_req), runner.null_block, dtype=torch.int32, device=dev
        )
        # Draft trees: [max_t] int64 rotary positions, tree start and ancestor mask.
        self.tree = runner.tree is not None
        if self.tree:
            self.tree_rope = torch.zeros(max_t, dtype=torch.int64, device=dev)
            self.tree_start = torch.full((max_t,), NO_TREE, dtype=torch.int64, device=dev)
            self.tree_mask = torch.zeros(max_t, dtype=torch.int64, device=dev)
        # Per query length q, the constant layout of a uniform batch (row i holds tokens
        # i*q .. i*q + q - 1): query_start_loc, token_req and the padded rows' positions.
        ar = torch.arange(max_t + 1, device=dev)
        self._layout = {
            q: (
                (ar[: max_b + 1] * q).to(torch.int32),
                ar[:max_t] // q,
                ar[:max_t] % q,
            )
            for q in self.query_lens
        }
        self._layout_q: int | None = None  # whose layout the buffers hold
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        # (query_len, padded batch) of the graph the current step replayed, else None.
        self.last_replayed: tuple[int, int] | None = None
        self._capture_all()

    def is_tree(self, q: int) -> bool:
        """Whether the graphs of query length q verify trees."""
        return self.tree and q > 1

    def _common(self, b: int, q: int, chain: bool = False) -> CommonAttentionMetadata:
        """The metadata a graph of (q, b) builds from the buffers: with the tree fields where
        it verifies trees, unless `chain` (the draft prefill over the accepted paths)."""
        t = b * q
        tree = {}
        if self.is_tree(q) and not chain:
            tree = dict(
                tree_start=self.tree_start[:t],
                tree_mask=self.tree_mask[:t],
                tree_positions=self.tree_rope[:t],
            )
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            positions=self.positions[:t],
            block_table=self.block_table[:b],
            slot_mapping=self.slot_mapping[:t],
            token_req=self.token_req[:t],
            num_reqs=b,
            num_tokens=t,
            max_query_len=q,
            max_seq_len=self.runner.max_model_len,
            **tree,
        )

    def _fill_dummy(self, b: int, q: int) -> None:
        """Every row of the first `b` a padded row (capture and warm-up)."""
        t = b * q
        self._set_layout(q)
        self.positions[:t] = self._layout[q][2][:t]
        self.slot_mapping[:t] = -1
        self.seq_lens[:b] = q
        self.input_ids[:t] = 0
        if self.tree:
            self._set_tree(t, None)

    def _set_tree(self, t: int, tree: TreeFields | None) -> None:
        """The tree buffers of the first t tokens, their positions already written: the step's
        tree fields for its own tokens, every other token (padded rows; prompt chunks of a
        step without drafts) outside any tree, at its own position."""
        n = 0
        if tree is not None:
            n = tree.tree_start.shape[0]
            self.tree_rope[:n].copy_(tree.rope_positions)
            self.tree_start[:n].copy_(tree.tree_start)
            self.tree_mask[:n].copy_(tree.tree_mask)
        self.tree_rope[n:t].copy_(self.positions[n:t])
        self.tree_start[n:t] = NO_TREE
        self.tree_mask[n:t] = 0

    def _set_layout(self, q: int) -> None:
        if self._layout_q != q:
            qsl, token_req, _ = self._layout[q]
            self.query_start_loc.copy_(qsl)
            self.token_req.copy_(token_req)
            self._layout_q = q

    def _run(self, b: int, q: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        r = self.runner
        ctx = r.forward_context(self._common(b, q))
        t = b * q
        pos = self.tree_rope[:t] if self.is_tree(q) else self.positions[:t]
        # Kernel choices from b x q rows: what the eager step of any B padded to b also uses.
        with uniform_batch(b, b):
            return r.model(self.input_ids[:t], pos, ctx, r.aux_layers)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # NOTE: a garbage collection during capture may free another engine's graphs, which
        # CUDA forbids while a stream captures: collect first, then keep the collector off.
        gc.collect()
        gc.disable()
        try:
            self._capture_loop()
        finally:
            gc.enable()

    def _capture_loop(self) -> None:
        for q in self.query_lens:
            for b in reversed(self.sizes):
                self._fill_dummy(b, q)
                # Warm up on a side stream (Triton compiles, cuBLAS picks kernels) first.
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    self._run(b, q)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = self._run(b, q)
                self.graphs[(q, b)] = g
                self.outputs[(q, b)] = out
        torch.cuda.synchronize()

    def padded_batch(self, inp: StepInputs) -> int | None:
        """The batch size of the graph a step replays (a uniform decode batch that fits), padded
        up to a captured size; None: the step runs eagerly."""
        B, T, q = inp.num_reqs, inp.num_tokens, inp.max_query_len
        if q not in self.query_lens or T != B * q or B > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= B)

    def input_buffers(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where `prepare_target_inputs` writes a replayed step's input ids [T], slot mapping
        [T] and block-table rows [B, max_blocks]: the graph reads them in place."""
        B, T = inp.num_reqs, inp.num_tokens
        return self.input_ids[:T], self.slot_mapping[:T], self.block_table[:B]

    def meta_buffers(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Where `prepare_target_inputs` copies a replayed step's positions [T] int64 and
        seq_lens [B] int32 (its `meta`): in its launch, not as two copies of their own."""
        return self.positions[: inp.num_tokens], self.seq_lens[: inp.num_reqs]

    def replay(
        self, inp: StepInputs, bg: int, tree: TreeFields | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replay the graph of `padded_batch(inp)` == bg, its `input_buffers` and `meta_buffers`
        already written, with the step's tree fields where it verifies a tree;
        -> (hidden [T, H], aux hidden states)."""
        B, T = inp.num_reqs, inp.num_tokens
        q = inp.max_query_len
        # NOTE: a uniform batch's query_start_loc and token_req are constants of q (set only
        # when q changes); padded rows (positions 0.., slot -1, null blocks) are refilled only
        # when there are any. Host time here is GPU idle time at batch 1.
        self._set_layout(q)
        if bg > B:
            tg = bg * q
            self.positions[T:tg] = self._layout[q][2][T:tg]
            self.slot_mapping[T:tg] = -1
            self.seq_lens[B:bg] = q
            self.block_table[B:bg] = self.runner.null_block
        if self.is_tree(q):
            self._set_tree(bg * q, tree)
        self.graphs[(q, bg)].replay()
        self.last_replayed = (q, bg)
        hidden, aux = self.outputs[(q, bg)]
        return hidden[:T], [a[:T] for a in aux]
