"""The walk of `tree_verify` (greedy and coupled rows) as one Triton launch (CUDA; the torch
reference is `tree_verify` in tree_verify.py, which dispatches here).

The reference walks the tree level by level in torch: about 18 small ops a level, so a depth-6
tree cost ~110 launches a step, outside the captured graphs, on the host's critical path at
batch 1. Here one program a request holds its K + 1 nodes in registers and walks every level:
at each level the child of the current node whose draft token equals the target's token at the
current node (the first such child in index order) becomes the current node. The accepted
token at level l is the target's token at the node of level l - 1, so the output needs no
second gather of the draft tokens: out[j] = target[path[j]] for j <= accepted, -1 after.
Integer compares only: bit-identical to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specserve.ops.jit import jit_any_shape


@jit_any_shape
def _tree_walk_kernel(
    target_ptr,  # [B, K1] int64 target token at each node (argmax or the coupled draw)
    tokens_ptr,  # [B, K1] int64 node tokens (node 0: any)
    parent_ptr,  # [B, K1] int64
    num_draft_ptr,  # [B] valid drafts a request
    out_ptr,  # [B, K1] int64
    num_acc_ptr,  # [B] int64
    path_ptr,  # [B, K1] int64
    K1: tl.constexpr,
    BLOCK: tl.constexpr,
    MAX_DEPTH: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, BLOCK).to(tl.int64)
    ok = node < K1
    base = b * K1
    nd = tl.load(num_draft_ptr + b).to(tl.int64)
    valid = (node >= 1) & (node <= nd)
    tok = tl.load(tokens_ptr + base + node, mask=ok, other=-1)
    par = tl.load(parent_ptr + base + node, mask=ok, other=-1)
    tgt = tl.load(target_ptr + base + node, mask=ok, other=-2)
    path = node
    cur = nd * 0
    n_acc = nd * 0
    done = nd * 0
    for level in tl.static_range(1, MAX_DEPTH + 1):
        t_cur = tl.sum(tl.where(node == cur, tgt, 0), 0)
        match = valid & (par == cur) & (tok == t_cur) & (done == 0)
        idx = tl.min(tl.where(match, node, BLOCK), 0)
        has = idx < BLOCK
        path = tl.where((node == level) & has, idx, path)
        cur = tl.where(has, idx, cur)
        n_acc += has.to(tl.int64)
        done = tl.where(has, done, 1)
    tl.store(path_ptr + base + node, path, mask=ok)
    tl.store(num_acc_ptr + b, n_acc)
    # path[j] < K1 for every j: the gather stays inside the request's row.
    emitted = tl.load(target_ptr + base + path, mask=ok & (node <= n_acc), other=-1)
    tl.store(out_ptr + base + node, emitted, mask=ok)


def tree_walk_triton(
    # [B, K + 1] int64 the target's token at each node
    target: Tensor,
    # [B, K + 1] int64 node tokens (node 0 any; tree_verify's `tokens`)
    tokens: Tensor,
    # [B, K + 1] int64 parent node of each node
    parent: Tensor,
    # [B] valid drafts per request
    num_draft: Tensor,
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (out_tokens [B, K + 1], num_accepted [B], path [B, K + 1]) as `tree_verify`."""
    b, k1 = target.shape
    out = torch.empty(b, k1, dtype=torch.int64, device=target.device)
    path = torch.empty_like(out)
    num_acc = torch.empty(b, dtype=torch.int64, device=target.device)
    if b == 0:
        return out, num_acc, path
    _tree_walk_kernel[(b,)](
        target.contiguous(), tokens.contiguous(), parent.contiguous(), num_draft.contiguous(),
        out, num_acc, path,
        K1=k1, BLOCK=max(16, triton.next_power_of_2(k1)), MAX_DEPTH=max_depth,
    )  # fmt: skip
    return out, num_acc, path
