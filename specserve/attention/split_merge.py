"""The split-KV (flash-decoding) merge of paged attention: each key split of a row left its
partial softmax state (m, l, unnormalized acc; log2 domain) in a workspace, and one program a
(token, head) rescales them to the common max and normalizes once (torch reference:
`combine_splits_ref`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.ops import pdl


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    ws_acc_ptr,
    ws_m_ptr,
    ws_l_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t, h] from the SPLITS partial (m, l, acc) of row (t, h): rescale each to the global
    max (log2 domain, as the attention kernel) and normalize once. Empty splits have m = -inf."""
    pdl.start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = (t * num_heads + h) * SPLITS
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    m = tl.load(ws_m_ptr + row + sp)
    lse = tl.load(ws_l_ptr + row + sp)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_safe)
    denom = tl.sum(lse * w, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    acc = tl.load(ws_acc_ptr + (row + sp)[:, None] * HEAD_DIM + d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def combine_splits(
    # [num_tokens, num_heads, head_dim]: written
    out: torch.Tensor,
    # [num_tokens, num_heads, num_splits, head_dim] fp32, contiguous
    ws_acc: torch.Tensor,
    # [num_tokens, num_heads, num_splits] fp32: each split's running max (log2 domain)
    ws_m: torch.Tensor,
    # [num_tokens, num_heads, num_splits] fp32: each split's sum of exp2(score - m)
    ws_l: torch.Tensor,
) -> None:
    num_tokens, num_heads, num_splits, head_dim = ws_acc.shape
    _combine_splits_kernel[(num_tokens, num_heads)](
        out,
        ws_acc,
        ws_m,
        ws_l,
        num_heads,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        SPLITS=num_splits,
        **pdl.launch_kwargs(out.device),
    )


def combine_splits_ref(
    # [num_tokens, num_heads, num_splits, head_dim]
    ws_acc: torch.Tensor,
    # [num_tokens, num_heads, num_splits]
    ws_m: torch.Tensor,
    ws_l: torch.Tensor,
) -> torch.Tensor:
    """`combine_splits` in torch: [num_tokens, num_heads, head_dim] fp32."""
    m_max = ws_m.amax(dim=-1, keepdim=True)
    w = torch.exp2(ws_m - m_max.masked_fill(m_max == float("-inf"), 0.0))
    denom = (ws_l * w).sum(-1, keepdim=True)
    denom = denom.masked_fill(denom == 0.0, 1.0)
    return (ws_acc * w[..., None]).sum(-2) / denom
