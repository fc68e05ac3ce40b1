"""A tree step's token layout as Triton kernels (CUDA; the torch references are
`target_tree_metadata` and `chain_order` in tree.py, which dispatch here).

Both run eagerly around the captured target graph, once a tree step: the references are about
20 and 12 small torch ops, each a launch on the host's critical path at batch 1. Here each is
one launch over the step's tokens. Token t of request b (whose tree is its last num_draft + 1
tokens, starting at `first`) is node m = t - first when 0 <= m; every other token (prefill
chunks) is plain causal. Integer math only: equal to the references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specserve.ops.jit import jit_any_shape

BLOCK_T = 128


@triton.jit
def _node_index(T, token_req_ptr, qsl_ptr, num_draft_ptr, BLOCK: tl.constexpr):
    """This program's tokens t (and t < T), with each one's request, the first token of its
    tree and its node index there (negative outside the tree)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = t < T
    req = tl.load(token_req_ptr + t, mask=ok, other=0).to(tl.int64)
    last = tl.load(qsl_ptr + req + 1, mask=ok, other=0).to(tl.int64) - 1
    first = last - tl.load(num_draft_ptr + req, mask=ok, other=0).to(tl.int64)
    return t, ok, req, first, t - first


@jit_any_shape
def _tree_metadata_kernel(
    token_req_ptr,  # [T]
    qsl_ptr,  # [B + 1]
    num_draft_ptr,  # [B]
    idx_mapping_ptr,  # [B]
    positions_ptr,  # [T]
    depth_ptr,  # [rows, K1] int64
    anc_ptr,  # [rows, K1] int64
    rope_ptr,  # [T] int64 out
    start_ptr,  # [T] int64 out
    mask_ptr,  # [T] int64 out
    T,
    K1: tl.constexpr,
    NO_TREE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, ok, req, first, m = _node_index(T, token_req_ptr, qsl_ptr, num_draft_ptr, BLOCK)
    node = m >= 0
    mc = tl.minimum(tl.maximum(m, 0), K1 - 1)
    row = tl.load(idx_mapping_ptr + req, mask=ok, other=0).to(tl.int64)
    pos = tl.load(positions_ptr + t, mask=ok, other=0).to(tl.int64)
    root = pos - mc
    depth = tl.load(depth_ptr + row * K1 + mc, mask=ok, other=0)
    anc = tl.load(anc_ptr + row * K1 + mc, mask=ok, other=0)
    tl.store(rope_ptr + t, tl.where(node, root + depth, pos), mask=ok)
    tl.store(start_ptr + t, tl.where(node, root, NO_TREE), mask=ok)
    tl.store(mask_ptr + t, tl.where(node, anc, 0), mask=ok)


def tree_metadata_triton(
    # [T] batch row of each token
    token_req: Tensor,
    # [B + 1]
    query_start_loc: Tensor,
    # [B]
    num_draft: Tensor,
    # [B]
    idx_mapping: Tensor,
    # [T]
    positions: Tensor,
    # [rows, K + 1] int64 (TreeState.depth, TreeState.anc)
    depth: Tensor,
    anc: Tensor,
    no_tree: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (rotary positions, tree_start, tree_mask), [T] int64 each, as target_tree_metadata."""
    T = token_req.shape[0]
    rope, start, mask = (torch.empty(T, dtype=torch.int64, device=token_req.device) for _ in "rsm")
    if T:
        _tree_metadata_kernel[(triton.cdiv(T, BLOCK_T),)](
            token_req, query_start_loc, num_draft, idx_mapping, positions,
            depth.contiguous(), anc.contiguous(), rope, start, mask, T,
            K1=depth.shape[1], NO_TREE=no_tree, BLOCK=BLOCK_T,
        )  # fmt: skip
    return rope, start, mask


@jit_any_shape
def _chain_order_kernel(
    token_req_ptr,  # [T]
    qsl_ptr,  # [B + 1]
    num_draft_ptr,  # [B]
    path_ptr,  # [B, K1] int64
    perm_ptr,  # [T] int64 out
    T,
    K1: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, ok, req, first, m = _node_index(T, token_req_ptr, qsl_ptr, num_draft_ptr, BLOCK)
    node = m >= 0
    p = tl.load(path_ptr + req * K1 + tl.maximum(m, 0), mask=ok & node, other=0)
    tl.store(perm_ptr + t, tl.where(node, first + p, t), mask=ok)


def chain_order_triton(
    # [T] batch row of each token
    token_req: Tensor,
    # [B + 1]
    query_start_loc: Tensor,
    # [B]
    num_draft: Tensor,
    # [B, K + 1] int64 accepted path (tree_verify)
    path: Tensor,
) -> Tensor:
    """[T] int64, as chain_order."""
    T = token_req.shape[0]
    perm = torch.empty(T, dtype=torch.int64, device=token_req.device)
    if T:
        _chain_order_kernel[(triton.cdiv(T, BLOCK_T),)](
            token_req, query_start_loc, num_draft, path.contiguous(), perm, T,
            K1=path.shape[1], BLOCK=BLOCK_T,
        )  # fmt: skip
    return perm
