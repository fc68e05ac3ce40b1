"""GLM-4.5 / 4.6 MoE (Glm4MoeForCausalLM): GQA with attention bias on q/k/v, partial rotary,
optional qk-norm; sigmoid group-limited routing with a correction bias, routed_scaling_factor
and shared experts; the first `first_k_dense_replace` layers dense.

Its checkpoints carry `num_nextn_predict_layers` MTP layers after the decoder layers
(`model.layers.{num_hidden_layers + i}.*`); the target skips them (checkpoint_rename) and the
MTP drafter (speculative_config method "mtp" without a model) builds their decoder layer from
`make_layer`, an MoE layer as every MTP layer is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from specserve.models.layers import RotaryEmbedding
from specserve.models.llama import ArchConfig, DecoderLayer, LlamaForCausalLM
from specserve.models.moe import MoeConfig, moe_or_dense, sigmoid_moe_config


@dataclass
class Glm4MoeArchConfig(ArchConfig):
    moe: MoeConfig | None = None
    first_k_dense_replace: int = 0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Glm4MoeArchConfig:
        if "partial_rotary_factor" not in (cfg.get("rope_parameters") or {}):
            # transformers' Glm4MoeConfig default, also for configs that leave it out.
            cfg = {"partial_rotary_factor": 0.5, **cfg}
        base = ArchConfig.from_dict({**cfg, "sliding_window": None})
        base.qk_norm = bool(cfg.get("use_qk_norm", False))
        base.o_bias = False
        moe = sigmoid_moe_config(cfg)
        return cls(
            **vars(base), moe=moe, first_k_dense_replace=int(cfg.get("first_k_dense_replace", 1))
        )


class Glm4MoeForCausalLM(LlamaForCausalLM):
    config: Glm4MoeArchConfig
    # GLM's MTP layer embeds the token at position 0 like any other (transformers' MtpLayer);
    # DeepSeek-style MTP in vLLM zeroes it.
    mtp_mask_position0 = False

    @classmethod
    def from_config_dict(cls, cfg: dict[str, Any], max_position: int) -> Glm4MoeForCausalLM:
        return cls(Glm4MoeArchConfig.from_dict(cfg), max_position)

    def make_layer(
        self, index: int, rope: RotaryEmbedding, sliding_window: int | None
    ) -> nn.Module:
        c = self.config
        is_moe = index >= c.first_k_dense_replace
        mlp = moe_or_dense(c.moe, is_moe, c.hidden_size, c.intermediate_size)
        return DecoderLayer(c, rope, sliding_window, mlp=mlp)
