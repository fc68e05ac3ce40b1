"""DeepSeek-V3 (DeepseekV3ForCausalLM) and GLM-4.7-Flash (Glm4MoeLiteForCausalLM): MLA attention
(models/mla.py) with MoE feed-forward blocks (models/moe.py: sigmoid group-limited routing with
a correction bias, routed_scaling_factor, shared experts); dense MLPs in the first
`first_k_dense_replace` layers (GLM-4.7-Flash: where `mlp_layer_types` says "dense").

Their checkpoints carry `num_nextn_predict_layers` MTP layers after the decoder layers
(`model.layers.{num_hidden_layers + i}.*`); the target skips them and the MTP drafter builds
their decoder layer from `make_layer` (an MLA + MoE layer, as transformers' get_mtp_config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from specserve.attention.backend import ForwardContext
from specserve.models.layers import RMSNorm, RotaryEmbedding
from specserve.models.llama import ArchConfig, LlamaForCausalLM, norm_ffn
from specserve.models.mla import MLAAttention, MLAConfig
from specserve.models.moe import MoeConfig, moe_or_dense, sigmoid_moe_config


@dataclass
class DeepseekArchConfig(ArchConfig):
    mla: MLAConfig | None = None
    moe: MoeConfig | None = None
    # Indices of the target's layers with a dense MLP (MTP layers past them are MoE).
    dense_layers: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DeepseekArchConfig:
        heads = cfg["num_attention_heads"]
        # The rotary embedding spans qk_rope_head_dim (transformers: head_dim = that).
        base = ArchConfig.from_dict(
            {
                **cfg,
                "sliding_window": None,
                "head_dim": cfg["qk_rope_head_dim"],
                "num_key_value_heads": heads,
                "attention_bias": False,
            }
        )
        if base.rotary_dim != cfg["qk_rope_head_dim"]:
            raise ValueError("config.json: MLA models need partial_rotary_factor 1")
        n = base.num_hidden_layers
        kinds = cfg.get("mlp_layer_types")
        if kinds:
            dense = frozenset(i for i, k in enumerate(kinds[:n]) if k == "dense")
        else:
            dense = frozenset(range(int(cfg.get("first_k_dense_replace") or 0)))
        moe = sigmoid_moe_config(cfg)
        mla = MLAConfig.from_dict(cfg, base.rope_scaling)
        return cls(**vars(base), mla=mla, moe=moe, dense_layers=dense)


class MLADecoderLayer(nn.Module):
    """input norm -> MLA -> residual -> post-attention norm -> MLP or MoE -> residual."""

    def __init__(self, c: DeepseekArchConfig, rope: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAAttention(c.mla, rope)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        # [num_tokens]
        positions: torch.Tensor,
        # [num_tokens, hidden]
        x: torch.Tensor,
        # [num_tokens, hidden] or None for the first layer
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The input norm runs inside the attention's input projections where it can.
        x, residual = self.self_attn.norm_forward(positions, self.input_layernorm, x, residual, ctx)
        return norm_ffn(self.post_attention_layernorm, self.mlp, x, residual)

    def write_kv(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> None:
        """This layer's latent KV at `positions`: the attention (whose backend writes it)
        without the MLP or MoE after it."""
        self.self_attn.norm_forward(positions, self.input_layernorm, x, residual, ctx)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    config: DeepseekArchConfig

    @classmethod
    def from_config_dict(cls, cfg: dict[str, Any], max_position: int) -> DeepseekV3ForCausalLM:
        return cls(DeepseekArchConfig.from_dict(cfg), max_position)

    def make_layer(
        self, index: int, rope: RotaryEmbedding, sliding_window: int | None
    ) -> nn.Module:
        c = self.config
        mlp = moe_or_dense(c.moe, index not in c.dense_layers, c.hidden_size, c.intermediate_size)
        return MLADecoderLayer(c, rope, mlp)


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: the DeepSeek-V3 architecture; its MTP layer embeds the token at
    position 0 like any other, as GLM-4.x MoE's (models/glm4_moe.py)."""

    mtp_mask_position0 = False
