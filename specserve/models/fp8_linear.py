"""Block-scaled fp8 linear layers kept 8-bit (EngineConfig.fp8_weights).

A DeepSeek-V3-style checkpoint (models/fp8.py) stores most linear weights as float8_e4m3fn with
a float32 scale per [bn, bk] block. With `fp8_weights` "keep" the model's
nn.Linear layers whose checkpoint weights are fp8 become `Fp8Linear` before loading: weight
[N, K] fp8 and weight_scale_inv [ceil(N / bn), ceil(K / bk)] float32 load as stored (the
loader's strict accounting covers both), and forward runs ops/fp8_matmul.py (W8A16).

Stay dequantized (dense, model dtype), whatever the mode:
  - layers whose weight is read as a tensor, not through forward (MLA's kv_b_proj: absorbed
    into W_UK / W_UV); they carry `keep_dense = True`;
  - fused projections (qkv_proj, gate_up_proj, MLA's fused_qkv_a_proj) unless every part is
    fp8 and each starts on a scale-block row boundary (then the parts' scales stack like their
    weights);
  - MoE experts (StackedExperts: the fused MoE kernels read bf16 weights);
  - the drafter of `speculative_config` (it loads through its own path).
Fp8Linear is not an nn.Linear: the decode-matmul planner (ops/gemv.py `use_decode_gemv_`)
replaces plain nn.Linear only, so it leaves these layers alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from specserve.models.loader import (
    SCALE_SUFFIX,
    ModelLoadError,
    checkpoint_names,
    fused_parts,
    fused_rows,
    stacked_target,
)
from specserve.ops.fp8_matmul import fp8_block_matmul
from specserve.ops.linear_swap import plain_attributes

FP8_WEIGHTS_MODES = ("auto", "keep", "dequantize")


def keep_fp8(mode: str, device: torch.device) -> bool:
    """EngineConfig.fp8_weights resolved: "keep" keeps fp8 linear weights 8-bit. "auto"
    dequantizes for now, on every device: the kept path passes its GPU tests (graph == eager,
    kept == dequantized in float32: benchmarks/RESULTS.md) but its speed against the planned
    bf16 gemv at batch 1 is not measured; it becomes "keep on CUDA" once it is."""
    if mode not in FP8_WEIGHTS_MODES:
        raise ModelLoadError(
            f"fp8_weights must be one of {', '.join(FP8_WEIGHTS_MODES)}, got {mode!r}"
        )
    del device  # NOTE: "auto" -> keep on CUDA once the kernel is measured on a GPU
    return mode == "keep"


class Fp8Linear(nn.Module):
    """y = x @ (weight * block scale)^T + bias in x's dtype, the weight kept float8_e4m3fn."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        block: tuple[int, int],
        device: torch.device | None = None,
        bias_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        bn, bk = block
        w = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty(-(-out_features // bn), -(-in_features // bk), device=device)
        # NOTE: parameters (not buffers) so the loader's strict accounting and state_dict see
        # them; no grad: fp8 has no autograd here.
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(s.float(), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device))
            if bias
            else None
        )

    @classmethod
    def replacing(cls, linear: nn.Linear, block: tuple[int, int]) -> Fp8Linear:
        """An empty Fp8Linear of `linear`'s shape, bias and plain attributes (norm_fed ...)."""
        has_bias = linear.bias is not None
        dtype = linear.bias.dtype if has_bias else None
        new = cls(
            linear.in_features, linear.out_features, has_bias, block, linear.weight.device, dtype
        )
        for k, v in plain_attributes(linear).items():
            setattr(new, k, v)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_block_matmul(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, block={list(self.block)}"


def _aligned(parent: nn.Module, fused: str, parts: int, bn: int) -> bool:
    return all(fused_rows(parent, fused, i)[0] % bn == 0 for i in range(parts))


def keep_fp8_linears_(
    model: nn.Module,
    model_dir: str,
    block: tuple[int, int],
    rename: Callable[[str], str | None] | None,
) -> Callable[[str], bool]:
    """Replace the nn.Linear layers of `model` whose checkpoint weights are fp8 (they have a
    `_scale_inv`) by Fp8Linear; returns the predicate over checkpoint weight names that
    iter_weights' `keep_fp8` takes (True: load it 8-bit, as stored)."""
    fp8 = [
        n.removesuffix(SCALE_SUFFIX)
        for n in checkpoint_names(model_dir)
        if n.endswith(SCALE_SUFFIX)
    ]
    params: dict[str, Any] = dict(model.named_parameters())
    modules = dict(model.named_modules())
    shards: dict[str, dict[int | None, str]] = {}
    for hf in fp8:
        name = rename(hf) if rename is not None else hf
        if name is None or not name.endswith(".weight"):
            continue
        target, shard = stacked_target(name, params)
        if target in params:
            shards.setdefault(target.removesuffix(".weight"), {})[shard] = hf
    kept: set[str] = set()
    for mod_name, parts in shards.items():
        linear = modules[mod_name]
        if type(linear) is not nn.Linear or getattr(linear, "keep_dense", False):
            continue
        parent_name, _, attr = mod_name.rpartition(".")
        sizes = fused_parts(modules[parent_name], attr) if None not in parts else None
        if sizes is not None and (
            len(parts) != len(sizes)
            or not _aligned(modules[parent_name], attr, len(sizes), block[0])
        ):
            continue
        setattr(modules[parent_name], attr, Fp8Linear.replacing(linear, block))
        kept.update(parts.values())
    return kept.__contains__
