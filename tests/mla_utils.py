"""Tiny random MLA checkpoints (DeepSeek-V3, GLM-4.7-Flash) written by transformers."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from .conftest import TINY_DECODER

_COMMON: dict[str, Any] = dict(
    TINY_DECODER,
    num_hidden_layers=3,
    # transformers' DeepSeek attention repeats K/V by heads // num_key_value_heads: MLA has
    # one K/V per query head.
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)

# name -> (transformers class names, overrides)
MLA_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # YaRN with mscale != mscale_all_dim: both the cos/sin factor and the softmax scale move.
    "deepseek_v3": (
        "DeepseekV3",
        dict(
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            rope_interleave=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=128,
                mscale=1.0,
                mscale_all_dim=0.8,
                beta_fast=32,
                beta_slow=1,
            ),
        ),
    ),
    "deepseek_v3_no_q_lora": (
        "DeepseekV3",
        dict(
            q_lora_rank=None,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            rope_interleave=False,
        ),
    ),  # fmt: skip
    "glm4_moe_lite": ("Glm4MoeLite", dict(mlp_layer_types=["dense", "sparse", "sparse"])),
}


def make_mla_checkpoint(path: str, name: str, seed: int = 0) -> str:
    import transformers as tf

    prefix, over = MLA_ARCHS[name]
    torch.manual_seed(seed)
    cfg = getattr(tf, f"{prefix}Config")(**{**_COMMON, **over})
    model = getattr(tf, f"{prefix}ForCausalLM")(cfg).eval()
    _randomize_correction_bias(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _randomize_correction_bias(model: torch.nn.Module) -> None:
    """transformers initializes e_score_correction_bias to zeros; a nonzero one checks that the
    bias steers the choice but not the weights."""
    g = torch.Generator().manual_seed(1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.rand(buf.shape, generator=g) * 0.2)


@pytest.fixture(scope="session")
def mla_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Factory: mla_ckpt(name) -> path of a tiny checkpoint (cached per session)."""
    root = tmp_path_factory.mktemp("mla_ckpts")
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = make_mla_checkpoint(os.path.join(root, name), name)
        return cache[name]

    return get
