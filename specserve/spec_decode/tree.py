"""Draft trees: EAGLE-2 dynamic trees and static token trees, drafted by the autoregressive
drafter, verified in one target forward.

A request's tree: node 0 is the root (the newest verified token), nodes 1..N are drafts in
topological order (a parent's index is below its children's): dynamic trees best first by
cumulative draft log-probability, so the first n nodes are the best tree of n nodes, and the
adaptive budget verifies a prefix of a tree that is always drafted whole (one shape: what a
CUDA graph of the drafting captures). The draft tokens sit in the token buffer after the root
exactly where a chain's drafts sit (node m at column root + m, the KV slot it is verified at);
the structure sits in persistent per-request rows (`TreeState`): parent, depth and the
ancestor-or-self bitmask of every node.

Target step: node m is computed at KV slot root + m with rotary position root + depth(m) and
sees the context plus its ancestors (`target_tree_metadata`: CommonAttentionMetadata's tree
fields). After verification the runner moves the accepted nodes' target KV into chain slots
and the draft prefill runs over the accepted path as over a chain.

Drafting (EAGLE-2): the root's drafter output gives depth 1 (the top k tokens); each of the
next depth - 1 levels runs the drafter over the k best frontier nodes at once (k queries a
request, each seeing the context and its own ancestors among the expansion slots), takes the k
best children of each, and keeps the k best of those k^2 by cumulative draft log-probability
as the next frontier. Every node ever produced is a candidate; the best N by cumulative
log-probability are verified (a child scores strictly below its parent, so they form a
tree). Static trees expand the nodes that have children, taking the child of rank r as the
r-th best token. The expansion queries' drafter KV goes to the slots after the root, which the
scheduler reserves for drafts; the next draft prefill rewrites them.

Nothing here reads back from the device or copies from the host, so `draft` runs inside a CUDA
graph (worker/draft_graphs.py) as it runs eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specserve.attention.backend import CommonAttentionMetadata, ForwardContext
from specserve.config.speculative import SpeculativeConfig
from specserve.sample.gumbel import SALT_SAMPLE, gumbel
from specserve.sample.sampler import SamplingTensors, process_logits

if TYPE_CHECKING:
    from specserve.spec_decode.autoregressive import AutoregressiveSpeculator
    from specserve.spec_decode.interface import DraftRunner
    from specserve.step_inputs import StepInputs

# tree_start of tokens outside any tree: no key index reaches it
NO_TREE = 1 << 40
# Cumulative scores are clamped here so filtered (-inf) tokens still order parents first.
_MIN_SCORE = -1.0e4


class TreeState:
    """Per-request tree structure, [rows, K + 1] each, written by the drafter on the device and
    read by the next target step and its verification. Initialized (`pad_*`: every node a
    child of the root, or the static tree) so that every row is always a valid tree."""

    def __init__(self, num_rows: int, k: int, device: torch.device) -> None:
        m = torch.arange(k + 1, device=device)
        self.k = k
        # Padding nodes: children of the root at depth 1 (node 0 is the root).
        self.parent = torch.zeros(num_rows, k + 1, dtype=torch.int64, device=device)
        self.depth = (m > 0).long().repeat(num_rows, 1)
        self.anc = ((1 << m) | 1).repeat(num_rows, 1)
        self.pad_parent = self.parent[0].clone()
        self.pad_depth = self.depth[0].clone()
        self.pad_anc = self.anc[0].clone()


class TreeDrafter:
    """The tree half of AutoregressiveSpeculator (spec_decode/autoregressive.py)."""

    def __init__(self, spec: SpeculativeConfig, num_rows: int, device: torch.device) -> None:
        self.k = spec.num_speculative_tokens
        self.topk = spec.tree_topk
        self.max_depth = spec.tree_depth
        self.static = spec.tree_paths
        self.state = TreeState(num_rows, self.k, device)
        self.device = device
        if self.static is not None:
            self._plan_static(self.static)

    # ---- static trees ---------------------------------------------------------------------
    def _plan_static(self, paths: list[tuple[int, ...]]) -> None:
        """Host plan of a static tree: per node its parent, depth and rank; per level the nodes
        expanded (those with children) and, per child, which expansion and rank gives it."""
        index = {p: i + 1 for i, p in enumerate(paths)}
        parent = [0] + [index.get(p[:-1], 0) for p in paths]
        depth = [0] + [len(p) for p in paths]
        anc = [1]
        for i in range(1, len(paths) + 1):
            anc.append(anc[parent[i]] | (1 << i))
        st = self.state
        st.pad_parent = torch.tensor(parent, device=self.device)
        st.pad_depth = torch.tensor(depth, device=self.device)
        st.pad_anc = torch.tensor(anc, device=self.device)
        st.parent.copy_(st.pad_parent.expand_as(st.parent))
        st.depth.copy_(st.pad_depth.expand_as(st.depth))
        st.anc.copy_(st.pad_anc.expand_as(st.anc))
        has_child = set(parent[1:])
        # levels[L]: (expanded nodes at depth L, [(child, expansion index, rank)], width)
        self.levels: list[tuple[list[int], list[tuple[int, int, int]], int]] = []
        for d in range(0, self.max_depth):
            nodes = [i for i in range(len(paths) + 1) if depth[i] == d and i in has_child]
            kids = [
                (c, nodes.index(parent[c]), paths[c - 1][-1])
                for c in range(1, len(paths) + 1)
                if depth[c] == d + 1
            ]
            self.levels.append((nodes, kids, max(r for _, _, r in kids) + 1))
        # Device index tensors of each level (no host-to-device copy while drafting): the
        # expanded nodes, and which of the previous level's expansions is each one's parent.
        dev = self.device
        self.level_nodes = [torch.tensor(nodes, device=dev) for nodes, _, _ in self.levels]
        self.level_parents = [torch.zeros(0, dtype=torch.long, device=dev)] + [
            torch.tensor([prev.index(parent[c]) for c in nodes], device=dev)
            for (prev, _, _), (nodes, _, _) in zip(self.levels, self.levels[1:])
        ]

    # ---- drafting -------------------------------------------------------------------------
    def draft(
        self,
        sp: AutoregressiveSpeculator,
        runner: DraftRunner,
        inp: StepInputs,
        ctx: ForwardContext,
        # [T, hidden] target hidden states in chain order (the accepted path's nodes first)
        hidden: Tensor,
        aux: list[Tensor],
        # [B]
        num_acc: Tensor,
        st: SamplingTensors | None,
    ) -> None:
        """The draft prefill (a chain over the accepted path), then the tree of K nodes; writes
        the nodes' tokens into the token buffer and their structure into `state`."""
        rows = inp.idx_mapping
        d = sp.model
        out, carry, last, next_pos, _ = sp.prefill_forward(runner, inp, ctx, hidden, aux, num_acc)
        root_h = carry[last] if carry is not None else None
        if d.shift == 1:
            root_out, base = out[last], next_pos
        else:
            # A draft model's root distribution comes from the new (bonus) token itself.
            meta = sp.decode_metadata(runner, rows, next_pos, inp.max_seq_len + 1)
            x = sp._decode_inputs(runner, rows, next_pos, with_metadata=False)
            root_out, root_h = sp._forward(
                x.input_ids, next_pos, root_h, runner.forward_context(meta)
            )
            base = next_pos + 1
        x = _Expansion(sp, runner, inp, rows, st, next_pos, base)
        if self.static is None:
            tok, parent, depth = self._dynamic(x, root_out, root_h)
        else:
            tok, parent, depth = self._static(x, root_out, root_h)
        self._write(runner, inp, rows, next_pos, tok, parent, depth)

    def _dynamic(
        self, x: _Expansion, root_out: Tensor, root_h: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """EAGLE-2: -> tokens, parents, depths of the K best nodes, [B, K + 1] (node 0 root),
        best first."""
        k, B = self.topk, root_out.shape[0]
        dev = root_out.device
        tok, score = x.children(root_out, 1, k)  # [B, k]
        cand_tok, cand_score = [tok], [score]
        cand_par = [torch.zeros(B, k, dtype=torch.long, device=dev)]
        cand_depth = [1]
        f_ids = torch.arange(1, k + 1, device=dev).expand(B, k)
        f_tok, f_score = tok, score
        f_h = root_h[:, None].expand(B, k, -1) if root_h is not None else None
        f_anc = torch.zeros(B, k, dtype=torch.long, device=dev)
        next_gid, off = k + 1, 0
        bits = 1 << torch.arange(k, device=dev)
        for level in range(1, self.max_depth):
            f_anc = f_anc | (bits << off)
            out, carry = x.expand(f_tok, f_h, level, off, f_anc)
            tok, s = x.children(out, level + 1, k)  # [B * k, k]
            s = (f_score[..., None] + s.view(B, k, k)).flatten(1).clamp_min(_MIN_SCORE * level)
            tok = tok.view(B, k * k)
            par = f_ids[..., None].expand(B, k, k).flatten(1)
            gids = next_gid + torch.arange(k * k, device=dev).expand(B, -1)
            cand_tok.append(tok), cand_score.append(s), cand_par.append(par)
            cand_depth.append(level + 1)
            next_gid += k * k
            if level < self.max_depth - 1:
                top = s.topk(k, dim=1).indices
                f_tok, f_score, f_ids = tok.gather(1, top), s.gather(1, top), gids.gather(1, top)
                pf = top // k
                if carry is not None:
                    h = carry.view(B, k, -1)
                    f_h = h.gather(1, pf[..., None].expand(-1, -1, h.shape[2]))
                f_anc = f_anc.gather(1, pf)
            off += k
        tok = torch.cat(cand_tok, 1)
        par = torch.cat(cand_par, 1)
        depth = torch.cat([torch.full_like(t, dd) for t, dd in zip(cand_tok, cand_depth)], 1)
        # A child scores strictly below its parent: the best n are closed under parents, and
        # in topk's order (best first) each parent comes before its children.
        adj = torch.cat(cand_score, 1).double() - depth.double() * 1e-6
        n = self.k
        sel = adj.topk(n, dim=1).indices  # [B, n] candidate index (global id - 1)
        node_of = torch.zeros(B, tok.shape[1] + 1, dtype=torch.long, device=dev)
        node_of.scatter_(1, sel + 1, torch.arange(1, n + 1, device=dev).expand(B, n))
        zero = torch.zeros(B, 1, dtype=torch.long, device=dev)
        parent = torch.cat([zero, node_of.gather(1, par.gather(1, sel))], 1)
        return (
            torch.cat([zero, tok.gather(1, sel)], 1),
            parent,
            torch.cat([zero, depth.gather(1, sel)], 1),
        )

    def _static(
        self, x: _Expansion, root_out: Tensor, root_h: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        B = root_out.shape[0]
        st = self.state
        tok = torch.zeros(B, self.k + 1, dtype=torch.long, device=root_out.device)
        outs, hs = root_out[:, None], (root_h[:, None] if root_h is not None else None)
        f_anc = torch.zeros(B, 1, dtype=torch.long, device=root_out.device)
        off = 0
        for level, (nodes, kids, width) in enumerate(self.levels):
            if level > 0:
                # Expand this level's nodes with their parents' carried states.
                pidx = self.level_parents[level]
                h = hs[:, pidx] if hs is not None else None
                f = len(nodes)
                f_anc = f_anc[:, pidx] | ((1 << torch.arange(f, device=tok.device)) << off)[None]
                out, carry = x.expand(tok[:, self.level_nodes[level]], h, level, off, f_anc)
                outs = out.view(B, f, -1)
                hs = carry.view(B, f, -1) if carry is not None else None
                off += f
            top, _ = x.children(outs.flatten(0, 1), level + 1, width)
            top = top.view(B, len(nodes), width)
            for c, e, r in kids:
                tok[:, c] = top[:, e, r]
        return tok, st.pad_parent.expand(B, -1), st.pad_depth.expand(B, -1)

    def _write(
        self,
        runner: DraftRunner,
        inp: StepInputs,
        rows: Tensor,
        next_pos: Tensor,
        # [B, K + 1] each (node 0: the root)
        tok: Tensor,
        parent: Tensor,
        depth: Tensor,
    ) -> None:
        st = self.state
        dev = tok.device
        m = torch.arange(self.k + 1, device=dev)
        anc = (1 << m).expand(tok.shape[0], -1).clone()
        anc[:, 0] = 1
        for _ in range(self.max_depth):
            anc = (1 << m) | anc.gather(1, parent)
            anc[:, 0] = 1
        st.parent[rows] = parent
        st.depth[rows] = depth
        st.anc[rows] = anc
        scratch = runner.states.token_ids.shape[1] - 1
        col = next_pos[:, None] + m[1:]
        col = torch.where(inp.samples[:, None] > 0, col.clamp_max(scratch), scratch)
        runner.states.token_ids[rows[:, None], col] = tok[:, 1:]


class _Expansion:
    """One draft step's context for expanding tree levels: the drafter, its inputs' rows and
    sampling tensors, the root's token position and the first expansion slot."""

    def __init__(
        self,
        sp: AutoregressiveSpeculator,
        runner: DraftRunner,
        inp: StepInputs,
        rows: Tensor,
        st: SamplingTensors | None,
        next_pos: Tensor,
        base: Tensor,
    ) -> None:
        self.sp, self.runner, self.rows, self.st = sp, runner, rows, st
        self.next_pos, self.base = next_pos, base
        self.max_seq_len = inp.max_seq_len + 2 * runner.states.token_ids.shape[1]
        d = sp.model
        self.cols = None
        if sp.coupled and d.d2t is not None:
            self.cols = d.to_target_ids(torch.arange(d.d2t.shape[0], device=rows.device))

    def children(self, out: Tensor, depth: int, width: int) -> tuple[Tensor, Tensor]:
        """The `width` best children of each of the [n, hidden] drafter outputs (request-major,
        n a multiple of B), for tokens at depth `depth` -> (target-vocabulary tokens [n, width],
        their draft log-probabilities [n, width]). Sampled rows under coupled verification rank
        by the target's own noise at that position, so the first child is the chain's draft."""
        d = self.sp.model
        st = self.st
        logits = d.draft_logits(out)
        if st is None or st.all_greedy or self.sp.greedy_draft:
            top, lp_top = topk_logprobs(logits, width)
            return d.to_target_ids(top), lp_top.clamp_min(_MIN_SCORE)
        logits = logits.float()
        n, B = logits.shape[0], self.rows.shape[0]
        lp = logits.log_softmax(dim=-1)
        rep = torch.arange(B, device=logits.device).repeat_interleave(n // B)
        st_rows = st.index(rep)
        proc = process_logits(logits, st_rows).log_softmax(dim=-1)
        lp = torch.where(st_rows.greedy[:, None], lp, proc)
        rank = lp
        if self.sp.coupled:
            pos = (self.next_pos + depth)[rep]
            g = gumbel(st_rows.seeds, pos, SALT_SAMPLE, logits.shape[1], self.cols)
            rank = torch.where(st_rows.greedy[:, None], lp, lp + g)
        top = rank.topk(width, dim=-1).indices
        return d.to_target_ids(top), lp.gather(1, top).clamp_min(_MIN_SCORE)

    def expand(
        self,
        # [B, f] target-vocabulary tokens of the nodes at depth `level`
        tok: Tensor,
        # [B, f, hidden] their carried drafter states, or None
        h: Tensor | None,
        level: int,
        # first expansion slot of this level, relative to `base`
        off: int,
        # [B, f] int64 ancestor-or-self bits over the expansion slots
        anc: Tensor,
    ) -> tuple[Tensor, Tensor | None]:
        """One drafter forward over f nodes a request -> (outputs [B * f, hidden], carry)."""
        sp, runner, rows = self.sp, self.runner, self.rows
        B, f = tok.shape
        dev = tok.device
        cap = runner.max_model_len - 1
        seq = (self.base + off)[:, None] + torch.arange(f, device=dev)  # [B, f]
        seq_c = seq.clamp_max(cap)
        rows_t = rows.repeat_interleave(f)
        bs = runner.block_size
        blk = runner.states.block_table[rows_t, (seq_c // bs).flatten()].long()
        slot = blk * bs + (seq_c % bs).flatten()
        slot = torch.where(seq.flatten() > cap, -1, slot)
        rope = (self.next_pos + level - sp.model.shift).clamp_max(cap)
        common = CommonAttentionMetadata(
            query_start_loc=(torch.arange(B + 1, device=dev) * f).to(torch.int32),
            seq_lens=(seq_c[:, -1] + 1).to(torch.int32),
            positions=seq_c.flatten(),
            block_table=runner.states.block_table[rows],
            slot_mapping=slot,
            token_req=torch.arange(B, device=dev).repeat_interleave(f),
            num_reqs=B,
            num_tokens=B * f,
            max_query_len=f,
            max_seq_len=min(self.max_seq_len, runner.max_model_len),
            tree_start=self.base.repeat_interleave(f),
            tree_mask=anc.flatten(),
            tree_positions=rope.repeat_interleave(f),
        )
        ctx = runner.forward_context(common)
        hin = h.flatten(0, 1) if h is not None else None
        return sp._forward(tok.flatten(), rope.repeat_interleave(f), hin, ctx)


def topk_logprobs(
    # [n, V] logits (any float dtype)
    logits: Tensor,
    k: int,
) -> tuple[Tensor, Tensor]:
    """-> (the k most likely tokens [n, k] int64, best first, their log-probabilities [n, k]
    float32). Two Triton launches on CUDA (tree_triton.py) for the three kernels here, the
    full-vocabulary top-k the costliest."""
    if logits.is_cuda:
        from specserve.spec_decode.tree_triton import topk_logprobs_triton

        return topk_logprobs_triton(logits, k)
    top = logits.float().log_softmax(dim=-1).topk(k, dim=-1)
    return top.indices, top.values


def target_tree_metadata(state: TreeState, inp: StepInputs) -> tuple[Tensor, Tensor, Tensor]:
    """A target step's tree fields -> (rotary positions, tree_start, tree_mask), [T] int64 each.
    A request's last num_draft + 1 tokens are its tree (the root and nodes 1..num_draft); every
    other token (prefill chunks) is plain causal. One Triton launch on CUDA (tree_triton.py)."""
    if inp.token_req.is_cuda:
        from specserve.spec_decode.tree_triton import tree_metadata_triton

        return tree_metadata_triton(
            inp.token_req, inp.query_start_loc, inp.num_draft, inp.idx_mapping, inp.positions,
            state.depth, state.anc, NO_TREE,
        )  # fmt: skip
    qsl = inp.query_start_loc.long()
    req = inp.token_req
    t = torch.arange(inp.num_tokens, device=req.device)
    first = (qsl[1:] - 1 - inp.num_draft)[req]
    m = t - first  # node index, negative outside the tree
    node = m >= 0
    mc = m.clamp(0, state.k)
    row = inp.idx_mapping[req]
    root = inp.positions - mc
    rope = torch.where(node, root + state.depth[row, mc], inp.positions)
    start = torch.where(node, root, NO_TREE)
    mask = torch.where(node, state.anc[row, mc], 0)
    return rope, start, mask


def node_tokens(inp: StepInputs, k: int) -> Tensor:
    """[B, K + 1] flattened-token index of each request's nodes 0..K (its root and drafts),
    clamped to its last token (so nodes past num_draft repeat it)."""
    last = inp.query_start_loc[1:].long() - 1
    first = last - inp.num_draft
    return torch.minimum(first[:, None] + torch.arange(k + 1, device=last.device), last[:, None])


def chain_order(inp: StepInputs, path: Tensor, k: int) -> Tensor:
    """[T] index of the token whose state each token's chain slot takes: node path[j] for chain
    slot j of a tree, itself elsewhere. One Triton launch on CUDA (tree_triton.py)."""
    if path.is_cuda:
        from specserve.spec_decode.tree_triton import chain_order_triton

        return chain_order_triton(inp.token_req, inp.query_start_loc, inp.num_draft, path)
    idx = node_tokens(inp, k)
    T = inp.num_tokens
    perm = torch.arange(T + 1, device=idx.device)
    j = torch.arange(k + 1, device=idx.device)
    # Nodes past num_draft alias the last token: they go to a trash entry.
    dst = torch.where(j[None, :] <= inp.num_draft[:, None], idx, T)
    perm[dst.flatten()] = idx.gather(1, path).flatten()
    return perm[:T]
