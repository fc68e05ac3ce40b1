"""Fused mixture-of-experts: the experts of an MoE layer applied to routed tokens.

The router (softmax top-k, sigmoid group-limited, ...) belongs to the model; this op takes its
choice (`topk_ids`, `topk_weights`) and runs the chosen SwiGLU experts:

    out[t] = sum_j topk_weights[t, j] * W2[e] @ (silu(W1[e] x[t]) * W3[e] x[t]),  e = topk_ids[t, j]

`fused_moe` dispatches to Triton on CUDA tensors outside autograd (ops/moe_triton.py, when it
exists) and to `fused_moe_ref` elsewhere; the reference is what CPU and interpreter tests
compare the kernels against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_ref(
    # [num_tokens, hidden]
    x: torch.Tensor,
    # [num_experts, 2 * intermediate, hidden]: gate rows first, then up rows
    w13: torch.Tensor,
    # [num_experts, hidden, intermediate]
    w2: torch.Tensor,
    # [num_tokens, top_k], float32
    topk_weights: torch.Tensor,
    # [num_tokens, top_k], int32 or int64
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Loops over the experts that received tokens (as transformers does), so CPU cost follows
    the routed tokens, not num_experts x num_tokens."""
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1).long()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    top_k = topk_ids.shape[1]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        weight = topk_weights.reshape(-1)[pairs].to(y.dtype)[:, None]
        out.index_add_(0, tokens, y * weight)
    return out


def fused_moe(
    # [num_tokens, hidden]
    x: torch.Tensor,
    # [num_experts, 2 * intermediate, hidden]
    w13: torch.Tensor,
    # [num_experts, hidden, intermediate]
    w2: torch.Tensor,
    # [num_tokens, top_k], float32
    topk_weights: torch.Tensor,
    # [num_tokens, top_k]
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
