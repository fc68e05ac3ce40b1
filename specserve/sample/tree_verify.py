"""Verification of a draft tree in one pass over the target's logits at every node.

A request's tree has nodes 0..N (node 0 the root: the last verified token; nodes 1..num_draft
drafts, each after its parent in index order, depth = parent's depth + 1). The target forward
gives logits at every node: the next-token distribution after the root-to-node path. The walk
starts at the root and at each level moves to the child whose token is the target's token there:

  greedy rows   the argmax at the current node
  "coupled"     the target's own Gumbel-max draw at the position the token takes
                (gumbel(seed, out_pos0 + depth, SALT_SAMPLE), what plain decoding draws there)
  "strict" / "probabilistic", sampled rows
                recursive rejection over the siblings (SpecInfer, EAGLE-2): tree children are
                the drafter's top-k (deterministic), so each is a one-hot draft; child i is
                accepted with probability p_i(c_i), p_1 = p and p_{i+1} = p_i without c_i,
                renormalized (uniform keyed by (seed, (position << 6) + node, SALT_TREE_ACCEPT));
                when every child is rejected the token is drawn from p without them. The output
                is distributed exactly as p at every level.

The walk stops at the first level without a match and emits the target's token there (the
recovered or bonus token). Outputs: the chain layout of `rejection_sample` ([B, K + 1]
accepted tokens, then the final one, then -1; [B] accepted count) plus the accepted path's
node indices, which the runner uses to move the accepted nodes' KV into chain slots. On CUDA
the walk of greedy and coupled rows is one Triton launch (tree_verify_triton.py; this
function is its reference).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specserve.sample.gumbel import SALT_SAMPLE, uniform
from specserve.sample.rejection import _repeat_rows
from specserve.sample.sampler import SamplingTensors, gumbel_argmax, process_logits

# Independent of the chain's salts (gumbel.py: 0..3).
SALT_TREE_ACCEPT = 5


def tree_verify(
    # [B, K + 1, V] float32 target logits at nodes 0..K
    target_logits: Tensor,
    # [B, K] int64 draft tokens of nodes 1..K (past num_draft: padding)
    draft_tokens: Tensor,
    # [B, K + 1] int64 parent node of each node (node 0: any)
    parent: Tensor,
    # [B, K + 1] int64 depth of each node (node 0: 0)
    depth: Tensor,
    # [B] int64 valid drafts per request
    num_draft: Tensor,
    st: SamplingTensors | None,
    # [B] int64 position of output slot 0 (the root's next token)
    out_pos0: Tensor,
    # the deepest a tree may be (host int: the walk's number of levels)
    max_depth: int,
    method: str = "coupled",
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (out_tokens [B, K + 1], num_accepted [B], path [B, K + 1]: node index at each
    accepted depth, path[:, 0] = 0, path[:, j] = j past the accepted depth)."""
    b, k1, vocab = target_logits.shape
    dev = target_logits.device
    logits = target_logits.float()
    node = torch.arange(k1, device=dev)
    valid = (node[None, :] >= 1) & (node[None, :] <= num_draft[:, None])
    tokens = torch.cat([draft_tokens.new_zeros(b, 1), draft_tokens.long()], 1)
    tokens = tokens.clamp(0, vocab - 1)
    # Position each node's next token takes: out_pos0 + the node's depth.
    slot_pos = out_pos0.long()[:, None] + depth
    sampled = st is not None and not st.all_greedy
    target = logits.argmax(dim=-1)
    logw = None
    if sampled:
        st_rep = _repeat_rows(st, k1)
        logw = process_logits(logits.reshape(b * k1, vocab), st_rep).view(b, k1, vocab)
        if method == "coupled":
            draw = gumbel_argmax(
                logw.view(b * k1, vocab), st_rep, slot_pos.reshape(-1), SALT_SAMPLE
            )
            target = torch.where(st.greedy[:, None], target, draw.view(b, k1))
    recursive = sampled and method != "coupled"
    if not recursive and dev.type == "cuda":
        from specserve.sample.tree_verify_triton import tree_walk_triton

        return tree_walk_triton(target, tokens, parent, num_draft, max_depth)
    if recursive:
        p = logw.softmax(dim=-1)
        # [B, K + 1] p(parent's distribution) of each node's token
        p_tok = p[torch.arange(b, device=dev)[:, None], parent.clamp(0, k1 - 1), tokens]
        seeds = st.seeds[:, None].expand(b, k1).reshape(-1)
        u_pos = (out_pos0.long()[:, None] + depth - 1) * 64 + node[None, :]
        u = uniform(seeds, u_pos.reshape(-1), SALT_TREE_ACCEPT).view(b, k1)
    rows = torch.arange(b, device=dev)
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    path = node[None, :].repeat(b, 1)
    num_acc = torch.zeros(b, dtype=torch.long, device=dev)
    # [B, K + 1] children of the current node rejected so far (recursive rejection)
    rejected = torch.zeros(b, k1, dtype=torch.bool, device=dev)
    for level in range(1, max_depth + 1):
        child = valid & (parent == cur[:, None]) & ~done[:, None]
        match = child & (tokens == target[rows, cur][:, None])
        if recursive:
            # Rejected mass before each sibling (index order), then p_i(c_i) per sibling.
            mass = torch.where(child, p_tok, 0.0)
            before = mass.cumsum(1) - mass
            ratio = mass / (1.0 - before).clamp_min(1e-20)
            acc_r = child & (u < ratio)
            first = torch.where(acc_r, node[None, :], k1).min(1).values
            rej_now = child & (node[None, :] < first[:, None])
            greedy = st.greedy[:, None]
            match = torch.where(greedy, match, acc_r)
            has = match.any(1)
            rejected = torch.where((~has & ~done)[:, None], rej_now, rejected)
        has = match.any(1)
        idx = torch.where(match, node[None, :], k1).min(1).values.clamp_max(k1 - 1)
        path[:, level] = torch.where(has, idx, path[:, level])
        cur = torch.where(has, idx, cur)
        num_acc = num_acc + has.long()
        done = done | ~has
    final = target[rows, cur]
    if recursive:
        # The residual: p at the final node without the siblings rejected there.
        lw = logw[rows, cur]
        hits = torch.zeros(b, vocab, dtype=torch.long, device=dev)
        hits.scatter_add_(1, tokens, rejected.long())
        kept = lw.masked_fill(hits > 0, float("-inf"))
        kept = torch.where((kept == float("-inf")).all(1, keepdim=True), lw, kept)
        draw = gumbel_argmax(kept, st, out_pos0.long() + num_acc, SALT_SAMPLE)
        final = torch.where(st.greedy, final, draw)
    acc_tokens = tokens.gather(1, path)[:, 1:]  # [B, K]
    j = node[None, :]
    out = torch.cat([acc_tokens, acc_tokens.new_zeros(b, 1)], 1)
    out = torch.where(j < num_acc[:, None], out, final[:, None])
    out = out.masked_fill(j > num_acc[:, None], -1)
    return out, num_acc, path
