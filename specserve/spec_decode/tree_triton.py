"""A tree step's token layout, and the drafter's top-k children, as Triton kernels (CUDA; the
torch references are `target_tree_metadata`, `chain_order` and `topk_logprobs` in tree.py,
which dispatch here).

Both run eagerly around the captured target graph, once a tree step: the references are about
20 and 12 small torch ops, each a launch on the host's critical path at batch 1. Here each is
one launch over the step's tokens. Token t of request b (whose tree is its last num_draft + 1
tokens, starting at `first`) is node m = t - first when 0 <= m; every other token (prefill
chunks) is plain causal. Integer math only: equal to the references.

`topk_logprobs_triton` replaces a log-softmax, a full-vocabulary torch.topk (a radix select:
~40 us a launch on an H100 at 4 x 8k, the costliest kernel of a tree draft step) and a gather
at every tree level: chunks of the vocabulary give their k best logits and their softmax
partial sums, and one program a row merges them.
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


TOPK_CHUNK = 4096


@jit_any_shape
def _topk_chunk_kernel(
    logits_ptr,  # [n, V] any float dtype, row stride `stride`
    val_ptr,  # [n, C, K] float32 out: the chunk's K best logits, best first
    idx_ptr,  # [n, C, K] int64 out: their vocabulary indices
    max_ptr,  # [n, C] float32 out: the chunk's max logit
    sum_ptr,  # [n, C] float32 out: sum over the chunk of exp(logit - max)
    V,
    stride,
    C,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride + offs, mask=offs < V, other=float("-inf"))
    x = x.to(tl.float32)
    m = tl.max(x, 0)
    tl.store(max_ptr + row * C + c, m)
    tl.store(sum_ptr + row * C + c, tl.sum(tl.exp(x - m), 0))
    out = (row * C + c) * K
    for i in tl.static_range(K):
        # ties: the lowest index first
        v, j = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(val_ptr + out + i, v)
        tl.store(idx_ptr + out + i, (c * CHUNK + j).to(tl.int64))
        x = tl.where(tl.arange(0, CHUNK) == j, float("-inf"), x)


@jit_any_shape
def _topk_merge_kernel(
    val_ptr,  # [n, C, K] float32
    idx_ptr,  # [n, C, K] int64
    max_ptr,  # [n, C] float32
    sum_ptr,  # [n, C] float32
    top_ptr,  # [n, K] int64 out
    lp_ptr,  # [n, K] float32 out
    C,
    K: tl.constexpr,
    CK: tl.constexpr,  # next power of two of C * K
    CP: tl.constexpr,  # next power of two of C
):
    row = tl.program_id(0).to(tl.int64)
    cc = tl.arange(0, CP)
    m = tl.load(max_ptr + row * C + cc, mask=cc < C, other=float("-inf"))
    sm = tl.load(sum_ptr + row * C + cc, mask=cc < C, other=0.0)
    mx = tl.max(m, 0)
    lse = mx + tl.log(tl.sum(sm * tl.exp(m - mx), 0))
    o = tl.arange(0, CK)
    ok = o < C * K
    # Candidates in chunk order, each chunk's best first: a tie goes to the lowest index.
    v = tl.load(val_ptr + row * C * K + o, mask=ok, other=float("-inf"))
    ix = tl.load(idx_ptr + row * C * K + o, mask=ok, other=0)
    for i in tl.static_range(K):
        best, j = tl.max(v, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(top_ptr + row * K + i, tl.sum(tl.where(o == j, ix, 0), 0))
        tl.store(lp_ptr + row * K + i, best - lse)
        v = tl.where(o == j, float("-inf"), v)


def topk_logprobs_triton(
    # [n, V] logits (any float dtype; rows may be strided)
    logits: Tensor,
    k: int,
) -> tuple[Tensor, Tensor]:
    """-> (tokens [n, k] int64, best first, their log-probabilities [n, k] float32), as
    topk_logprobs; two launches."""
    n, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunk = min(TOPK_CHUNK, triton.next_power_of_2(V))
    C = triton.cdiv(V, chunk)
    dev = logits.device
    val = torch.empty(n, C, k, dtype=torch.float32, device=dev)
    idx = torch.empty(n, C, k, dtype=torch.int64, device=dev)
    mx = torch.empty(n, C, dtype=torch.float32, device=dev)
    sm = torch.empty(n, C, dtype=torch.float32, device=dev)
    top = torch.empty(n, k, dtype=torch.int64, device=dev)
    lp = torch.empty(n, k, dtype=torch.float32, device=dev)
    if n:
        _topk_chunk_kernel[(n, C)](
            logits, val, idx, mx, sm, V, logits.stride(0), C, K=k, CHUNK=chunk
        )
        _topk_merge_kernel[(n,)](
            val, idx, mx, sm, top, lp, C, K=k,
            CK=triton.next_power_of_2(C * k), CP=triton.next_power_of_2(C),
        )  # fmt: skip
    return top, lp
