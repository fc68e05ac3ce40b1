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

from specserve.models.layers import MLP, RotaryEmbedding
from specserve.models.llama import ArchConfig, DecoderLayer, LlamaForCausalLM
from specserve.models.moe import MoeConfig, SparseMoE, num_experts


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
        moe = MoeConfig(
            num_experts=num_experts(cfg, "n_routed_experts", "num_local_experts"),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            scoring="sigmoid",
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            correction_bias=True,
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            router_fp32=True,
        )
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
        mlp = (
            SparseMoE(c.moe, c.hidden_size)
            if index >= c.first_k_dense_replace
            else MLP(c.hidden_size, c.intermediate_size)
        )
        return DecoderLayer(c, rope, sliding_window, mlp=mlp)
