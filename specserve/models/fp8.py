"""Block-scaled fp8 checkpoints (DeepSeek-V3's format), dequantized at load time.

config.json: `quantization_config: {quant_method: fp8, weight_block_size: [bn, bk], ...}`.
A quantized linear weight `X.weight` [N, K] is float8_e4m3fn with `X.weight_scale_inv`
[ceil(N / bn), ceil(K / bk)] float32 beside it: the real weight is
weight[n, k] * weight_scale_inv[n // bn, k // bk] (the name says "inv" because quantizing
divided by it). Everything else (embeddings, norms, router, lm_head) is stored as is.

`dequantize_weights` dequantizes as the weights stream in, except the linear weights that
models/fp8_linear.py keeps 8-bit (EngineConfig.fp8_weights "keep"; "auto" dequantizes until measured on a GPU): those pass
through with their scales to Fp8Linear (ops/fp8_matmul.py's W8A16 kernel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from specserve.models.loader import SCALE_SUFFIX, ModelLoadError


def fp8_block_size(cfg: dict[str, Any]) -> tuple[int, int] | None:
    """(bn, bk) for a block-scaled fp8 checkpoint's config, None for any other checkpoint."""
    q = cfg.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise ModelLoadError(
            "config.json: quantization_config (fp8) needs weight_block_size [rows, cols]; "
            "per-tensor fp8 checkpoints are not supported"
        )
    return int(block[0]), int(block[1])


def dequantize_block_fp8(
    # [N, K] float8_e4m3fn
    weight: torch.Tensor,
    # [ceil(N / bn), ceil(K / bk)] float32
    scale_inv: torch.Tensor,
    block: tuple[int, int],
) -> torch.Tensor:
    """The float32 weight [N, K]."""
    n, k = weight.shape
    bn, bk = block
    want = ((n + bn - 1) // bn, (k + bk - 1) // bk)
    if tuple(scale_inv.shape) != want:
        raise ModelLoadError(
            f"weight [{n}, {k}] with weight_block_size [{bn}, {bk}] needs a scale of shape "
            f"{list(want)}, got {list(scale_inv.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float() * scale


def dequantize_weights(
    weights: Iterator[tuple[str, torch.Tensor, str]],
    block: tuple[int, int],
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Pass tensors through, pairing each fp8 weight with its scale (in whichever order they
    come) and yielding the dequantized float32 weight in their place; weights `keep` names
    pass through as they are, with their scales."""
    fp8: dict[str, tuple[torch.Tensor, str]] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, t, path in weights:
        if keep is not None and keep(name.removesuffix(SCALE_SUFFIX)):
            yield name, t, path
        elif name.endswith(SCALE_SUFFIX):
            base = name.removesuffix(SCALE_SUFFIX)
            if base in fp8:
                w, wpath = fp8.pop(base)
                yield base, dequantize_block_fp8(w, t, block), wpath
            else:
                scales[base] = t
        elif t.dtype == torch.float8_e4m3fn:
            if name in scales:
                yield name, dequantize_block_fp8(t, scales.pop(name), block), path
            else:
                fp8[name] = (t, path)
        else:
            yield name, t, path
    if fp8 or scales:
        orphans = sorted(fp8) + [n + SCALE_SUFFIX for n in sorted(scales)]
        shown = ", ".join(orphans[:4]) + (" ..." if len(orphans) > 4 else "")
        raise ModelLoadError(f"fp8 checkpoint: weights and *_scale_inv do not pair up: {shown}")
