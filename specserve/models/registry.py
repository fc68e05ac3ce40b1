"""Maps a config's `architectures` entry to the class that implements it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specserve.models.loader import ModelLoadError

if TYPE_CHECKING:
    from specserve.distributed import TensorParallel

_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "specserve.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "specserve.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "specserve.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "specserve.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "specserve.models.qwen3_moe:Qwen3MoeForCausalLM",
    "Glm4MoeForCausalLM": "specserve.models.glm4_moe:Glm4MoeForCausalLM",
    "GptOssForCausalLM": "specserve.models.gpt_oss:GptOssForCausalLM",
    "DeepseekV3ForCausalLM": "specserve.models.deepseek:DeepseekV3ForCausalLM",
    "Glm4MoeLiteForCausalLM": "specserve.models.deepseek:Glm4MoeLiteForCausalLM",
}


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in `dtype` (an 8B model never exists in fp32)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def resolve_architecture(cfg: dict[str, Any], path: str) -> type[nn.Module]:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in _REGISTRY:
            module, cls = _REGISTRY[arch].split(":")
            return getattr(__import__(module, fromlist=[cls]), cls)
    raise ModelLoadError(
        f"{path}/config.json: unsupported architecture {archs or '(none given)'}; "
        f"specserve supports {', '.join(supported_architectures())}"
    )


def load_model(
    model_dir: str,
    dtype: Any,
    device: Any,
    max_position: int,
    load_format: str = "auto",
    mxfp4_experts: str = "auto",
    fp8_weights: str = "auto",
    tp: TensorParallel | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Build the target from config.json and load its safetensors, checking every shape.

    load_format="dummy" skips the safetensors and fills weights with small random values (as
    vLLM's `--load-format dummy`): speed benchmarks of real shapes without real checkpoints.
    mxfp4_experts: whether an MXFP4 checkpoint's experts stay 4-bit (models/mxfp4.py
    keep_mxfp4; "auto": on CUDA). fp8_weights: whether a block-scaled fp8 checkpoint's linear
    layers stay 8-bit (models/fp8_linear.py keep_fp8; "keep" only, for now). `tp`: this
    rank's shard only (models/tensor_parallel.py), each tensor sliced as it is read."""
    from specserve.models.loader import dummy_weights_, iter_weights, load_weights, read_config
    from specserve.models.mxfp4 import keep_mxfp4

    cfg = read_config(model_dir)
    cls = resolve_architecture(cfg, model_dir)
    if tp is not None and mxfp4_experts == "auto":
        mxfp4_experts = "dequantize"  # NOTE: no sharded 4-bit experts yet
    keep = keep_mxfp4(mxfp4_experts, torch.device(device))
    kw = {"keep_mxfp4": keep} if getattr(cls, "supports_mxfp4", False) else {}
    from specserve.models.tensor_parallel import params_on_meta

    # Under TP each rank allocates only its shard (shard_model_ below).
    with torch.device(device), default_dtype(dtype), params_on_meta(tp is not None):
        model = cls.from_config_dict(cfg, max_position, **kw)
    if tp is not None:
        from specserve.models.tensor_parallel import shard_model_

        if fp8_weights == "keep":
            raise ModelLoadError(
                "tensor parallelism keeps no fp8 weights yet: pass fp8_weights='dequantize'"
            )
        fp8_weights = "dequantize"
        shard_model_(model, tp)
    if load_format == "dummy":
        dummy_weights_(model)
    else:
        from specserve.models.fp8 import fp8_block_size
        from specserve.models.fp8_linear import keep_fp8, keep_fp8_linears_

        block = fp8_block_size(cfg)
        keep = None
        if block is not None and keep_fp8(fp8_weights, torch.device(device)):
            keep = keep_fp8_linears_(model, model_dir, block, model.checkpoint_rename)
        weights = iter_weights(model_dir, keep)
        # A family whose stored layout differs from its parameters' (gpt-oss: transposed,
        # interleaved or MXFP4 experts) converts tensors on their way in.
        if hasattr(model, "convert_weights"):
            weights = model.convert_weights(weights)
        load_weights(model, weights, model.checkpoint_rename)
    return model.eval(), cfg
