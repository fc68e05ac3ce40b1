"""MXFP4 weights in gpt-oss checkpoints: loading them (the format itself: ops/mxfp4.py).

`dequantize_mxfp4` is the CPU reference path and the fallback: experts become dense at load.
On CUDA the experts stay 4-bit (models/moe.py Mxfp4Experts, ops/moe_mxfp4.py's kernels).
`dummy_mxfp4_` writes random 4-bit weights (load_format="dummy").
"""

from __future__ import annotations

from typing import Any

import torch

from specserve.models.loader import ModelLoadError
from specserve.ops.mxfp4 import SCALE_BIAS, dequantize_mxfp4

MXFP4_EXPERTS_MODES = ("auto", "mxfp4", "dequantize")


def is_mxfp4(cfg: dict[str, Any]) -> bool:
    """config.json asks for MXFP4-stored weights (gpt-oss's published checkpoints)."""
    return (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def keep_mxfp4(mode: str, device: torch.device) -> bool:
    """EngineConfig.mxfp4_experts resolved: "auto" keeps MXFP4 experts 4-bit on CUDA and
    dequantizes them elsewhere (the CPU reference path); "mxfp4" keeps them 4-bit anywhere
    (on CPU the Triton kernels run under TRITON_INTERPRET=1, else a dequantize-per-call
    fallback); "dequantize" always dequantizes at load."""
    if mode not in MXFP4_EXPERTS_MODES:
        raise ValueError(
            f"mxfp4_experts must be one of {', '.join(MXFP4_EXPERTS_MODES)}, got {mode!r}"
        )
    return mode == "mxfp4" or (mode == "auto" and device.type == "cuda")


class Mxfp4Pairs:
    """Collects `<name>_blocks` / `<name>_scales` from a checkpoint stream and hands them on once
    both halves have arrived (a shard boundary may split them): dequantized as `<name>`, or
    (`dequantize=False`: experts kept 4-bit) as the two halves, unchanged."""

    def __init__(self, dtype: torch.dtype, dequantize: bool = True) -> None:
        self.dtype = dtype
        self.dequantize = dequantize
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The (name, tensor)s to load now: none while a pair is incomplete."""
        for kind in ("blocks", "scales"):
            suffix = f"_{kind}"
            if name.endswith(suffix):
                base = name.removesuffix(suffix)
                half = self.pending.setdefault(base, {})
                half[kind] = tensor
                if len(half) < 2:
                    return []
                del self.pending[base]
                if not self.dequantize:
                    return [(f"{base}_blocks", half["blocks"]), (f"{base}_scales", half["scales"])]
                dense = dequantize_mxfp4(half["blocks"], half["scales"], self.dtype)
                # transformers' orientation for experts: [E, cols, rows]
                return [(base, dense.mT)]
        return [(name, tensor)]

    def check_complete(self) -> None:
        if self.pending:
            name, half = next(iter(self.pending.items()))
            missing = "scales" if "blocks" in half else "blocks"
            raise ModelLoadError(f"MXFP4 tensor {name}_{missing} is missing from the checkpoint")


# E8M0 exponents of random MXFP4 weights (load_format="dummy"): uniform random codes have an RMS
# of ~2.9, so 2^-7 gives values of ~0.023 RMS, the dense dummy weights' 0.02 scale.
DUMMY_SCALES = (SCALE_BIAS - 8, SCALE_BIAS - 7, SCALE_BIAS - 6)


@torch.no_grad()
def dummy_mxfp4_(name: str, p: torch.Tensor, generator: torch.Generator) -> None:
    """Random 4-bit weights in place: random code bytes in `*_blocks`, scales around 2^-7 in
    `*_scales`, so benchmarks stream the bytes real checkpoints would."""
    if name.endswith("_blocks"):
        p.random_(0, 256, generator=generator)
    elif name.endswith("_scales"):
        lo, hi = DUMMY_SCALES[0], DUMMY_SCALES[-1] + 1
        p.copy_(torch.randint(lo, hi, p.shape, generator=generator, device=p.device))
    else:
        raise ValueError(f"{name}: a uint8 parameter that is not MXFP4 blocks or scales")
