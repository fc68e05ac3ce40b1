"""Qwen3-MoE: the Qwen3 decoder (GQA, qk-norm) with sparse MoE feed-forward blocks.

A layer is MoE when it is not in `mlp_only_layers` and (index + 1) % decoder_sparse_step == 0
(transformers' Qwen3MoeDecoderLayer); the others keep a dense MLP of `intermediate_size`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from specserve.models.layers import RotaryEmbedding
from specserve.models.llama import ArchConfig, DecoderLayer, LlamaForCausalLM
from specserve.models.moe import MoeConfig, moe_or_dense, num_experts


@dataclass
class Qwen3MoeArchConfig(ArchConfig):
    moe: MoeConfig | None = None
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Qwen3MoeArchConfig:
        base = ArchConfig.from_dict({**cfg, "sliding_window": None})
        n = base.num_hidden_layers
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        base.sliding_windows = [window] * n
        base.qk_norm = True
        base.o_bias = base.qkv_bias
        moe = MoeConfig(
            num_experts=num_experts(cfg, "num_experts", "num_local_experts"),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )
        return cls(
            **vars(base),
            moe=moe,
            sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )

    def is_moe_layer(self, index: int) -> bool:
        return index not in self.mlp_only_layers and (index + 1) % self.sparse_step == 0


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    config: Qwen3MoeArchConfig

    @classmethod
    def from_config_dict(cls, cfg: dict[str, Any], max_position: int) -> Qwen3MoeForCausalLM:
        return cls(Qwen3MoeArchConfig.from_dict(cfg), max_position)

    def make_layer(
        self, index: int, rope: RotaryEmbedding, sliding_window: int | None
    ) -> nn.Module:
        c = self.config
        mlp = moe_or_dense(c.moe, c.is_moe_layer(index), c.hidden_size, c.intermediate_size)
        return DecoderLayer(c, rope, sliding_window, mlp=mlp)
