"""Fused mixture-of-experts: the experts of an MoE layer applied to routed tokens.

The router (softmax top-k, sigmoid group-limited, ...) belongs to the model; this op takes its
choice (`topk_ids`, `topk_weights`) and runs the chosen SwiGLU experts:

    out[t] = sum_j topk_weights[t, j] * W2[e] @ (silu(W1[e] x[t]) * W3[e] x[t]),  e = topk_ids[t, j]

`fused_moe` dispatches to Triton on CUDA tensors outside autograd (ops/moe_triton.py: decode
kernels for a few tokens, a grouped GEMM over expert-sorted pairs above) and to `fused_moe_ref`
elsewhere; the reference is what CPU and interpreter tests compare the kernels against.
`fused_moe_mxfp4` is the same op over experts kept in MXFP4 (ops/moe_mxfp4.py: the same two
paths, the weights dequantized in registers).

gpt-oss experts (keyword arguments; the Triton kernels take them as constexpr switches):
biases on both projections (`w13_bias`, `w2_bias`) and activation "swiglu_oai", the clamped
SwiGLU of transformers' GptOssExperts._apply_gate:
    gate = min(gate, limit); up = clamp(up, -limit, limit)
    act  = (up + 1) * gate * sigmoid(alpha * gate)
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specserve.ops.fused import _use_triton

PATHS = ("auto", "decode", "gemm")  # which Triton kernels fused_moe runs (CUDA)

ACTIVATIONS = ("silu", "swiglu_oai")


def _act(
    # [n, 2 * intermediate]: gate columns, then up columns
    gate_up: torch.Tensor,
    activation: str,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


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
    *,
    # [num_experts, 2 * intermediate] or None
    w13_bias: torch.Tensor | None = None,
    # [num_experts, hidden] or None
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """Loops over the experts that received tokens (as transformers does), so CPU cost follows
    the routed tokens, not num_experts x num_tokens."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe activation must be one of {ACTIVATIONS}, got {activation!r}")
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
        b13 = None if w13_bias is None else w13_bias[e]
        b2 = None if w2_bias is None else w2_bias[e]
        h = _act(F.linear(x[tokens], w13[e], b13), activation, alpha, limit)
        y = F.linear(h, w2[e], b2)
        weight = topk_weights.reshape(-1)[pairs].to(y.dtype)[:, None]
        out.index_add_(0, tokens, y * weight)
    return out


def _check_options(path: str, activation: str) -> None:
    """One clear line for a bad `path` or `activation` (fused_moe and fused_moe_mxfp4)."""
    if path not in PATHS:
        raise ValueError(f"fused_moe path must be one of {', '.join(PATHS)}; got {path!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe activation must be one of {ACTIVATIONS}, got {activation!r}")


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
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    path: str = "auto",
) -> torch.Tensor:
    """[num_tokens, hidden] in x's dtype. `path` picks the Triton kernels ("auto": decode
    kernels up to moe_triton.DECODE_MAX_TOKENS tokens, the grouped GEMM above; "decode";
    "gemm"); the reference ignores it."""
    _check_options(path, activation)
    if _use_triton(x):
        from specserve.ops.moe_triton import Epilogue, fused_moe_triton

        epilogue = Epilogue(w13_bias, w2_bias, activation, alpha, limit)
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, path=path, epilogue=epilogue)
    return fused_moe_ref(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        activation=activation,
        alpha=alpha,
        limit=limit,
    )


def fused_moe_mxfp4(
    # [num_tokens, hidden]
    x: torch.Tensor,
    # [num_experts, 2 * intermediate, hidden / 32, 16] uint8, gate rows first, then up rows
    w13_blocks: torch.Tensor,
    # [num_experts, 2 * intermediate, hidden / 32] uint8 (E8M0)
    w13_scales: torch.Tensor,
    # [num_experts, hidden, intermediate / 32, 16] uint8
    w2_blocks: torch.Tensor,
    # [num_experts, hidden, intermediate / 32] uint8
    w2_scales: torch.Tensor,
    # [num_tokens, top_k], float32
    topk_weights: torch.Tensor,
    # [num_tokens, top_k]
    topk_ids: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    path: str = "auto",
) -> torch.Tensor:
    """`fused_moe` with 4-bit experts (ops/mxfp4.py's layout, rows as `fused_moe`'s w13 and
    w2). Triton (ops/moe_mxfp4.py) on CUDA outside autograd, and on CPU tensors under
    TRITON_INTERPRET=1 (tests); elsewhere `fused_moe_mxfp4_ref`, which dequantizes every
    expert on each call (a fallback: the CPU default dequantizes once, at load)."""
    _check_options(path, activation)
    from specserve.ops.moe_mxfp4 import fused_moe_mxfp4_ref, fused_moe_mxfp4_triton
    from specserve.ops.moe_triton import Epilogue

    epilogue = Epilogue(w13_bias, w2_bias, activation, alpha, limit)
    args = (x, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids)
    interpret = os.environ.get("TRITON_INTERPRET") == "1" and not torch.is_grad_enabled()
    if _use_triton(x) or interpret:
        return fused_moe_mxfp4_triton(*args, path=path, epilogue=epilogue)
    return fused_moe_mxfp4_ref(*args, epilogue=epilogue)
