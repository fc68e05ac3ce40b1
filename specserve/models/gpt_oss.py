"""gpt-oss (GptOssForCausalLM): GQA with biases on q/k/v/o and a learned sink logit per head,
`layer_types` alternating sliding-window and full attention, YaRN rotary, and an MoE
feed-forward in every layer: a biased router whose k best logits are softmaxed among
themselves, experts with biases and the clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`).
Formulas as in transformers' modeling_gpt_oss.py.

Checkpoint layout (transformers' GptOssExperts, and the published MXFP4 checkpoints):
  mlp.router.weight [E, H], mlp.router.bias [E]
  mlp.experts.gate_up_proj [E, H, 2I], gate and up columns interleaved (gate = 0::2), or
      gate_up_proj_blocks [E, 2I, H/32, 16] uint8 + gate_up_proj_scales [E, 2I, H/32] (MXFP4)
  mlp.experts.gate_up_proj_bias [E, 2I], interleaved the same way
  mlp.experts.down_proj [E, I, H] (or down_proj_blocks [E, H, I/32, 16] + down_proj_scales)
  mlp.experts.down_proj_bias [E, H]
`convert_weights` turns them into StackedExperts' layout: w13 [E, 2I, H] with gate rows then up
rows, w2 [E, H, I]. It transposes explicitly: the real models have H == I, where a shape check
cannot tell [E, I, H] from [E, H, I]. Where the experts stay MXFP4 (`mxfp4_experts`: on CUDA
by default) the blocks and scales keep their bytes and only their rows move: gate/up
de-interleaving is a row permutation, applied to blocks and scales alike (-> Mxfp4Experts'
w13_blocks / w13_scales / w2_blocks / w2_scales).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specserve.models.layers import RotaryEmbedding
from specserve.models.llama import ArchConfig, DecoderLayer, LlamaForCausalLM
from specserve.models.moe import MoeConfig, SparseMoE, num_experts
from specserve.models.mxfp4 import Mxfp4Pairs, is_mxfp4

# transformers' GptOssConfig defaults for configs that leave them out.
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@dataclass
class GptOssArchConfig(ArchConfig):
    moe: MoeConfig | None = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> GptOssArchConfig:
        n = int(cfg["num_hidden_layers"])
        defaults: dict[str, Any] = {
            # Even layers slide, odd layers see everything (GptOssConfig's default).
            "layer_types": [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
            ],
            "head_dim": 64,
            "attention_bias": True,
            "rms_norm_eps": 1e-5,
        }
        if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
            theta = cfg.get("rope_theta", 150000.0)
            defaults["rope_parameters"] = {**_DEFAULT_ROPE, "rope_theta": theta}
        cfg = {**defaults, **{k: v for k, v in cfg.items() if v is not None}}
        quant = (cfg.get("quantization_config") or {}).get("quant_method")
        if quant not in (None, "mxfp4"):
            raise ValueError(
                f"config.json: gpt-oss quantization_config.quant_method {quant!r} is not "
                "supported (mxfp4, or none for bf16 experts)"
            )
        base = ArchConfig.from_dict(cfg)
        base.o_bias = base.qkv_bias = bool(cfg["attention_bias"])
        base.qk_norm = False
        base.attn_sinks = True
        moe = MoeConfig(
            num_experts=num_experts(cfg, "num_local_experts", "num_experts"),
            top_k=int(cfg.get("num_experts_per_tok", 4)),
            intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=False,
            scoring="softmax_topk",
            router_bias=True,
            expert_bias=True,
            activation="swiglu_oai",
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        )
        return cls(**vars(base), moe=moe)


class GptOssForCausalLM(LlamaForCausalLM):
    config: GptOssArchConfig
    # models/registry.py passes `keep_mxfp4` (EngineConfig.mxfp4_experts resolved).
    supports_mxfp4 = True

    @classmethod
    def from_config_dict(
        cls, cfg: dict[str, Any], max_position: int, keep_mxfp4: bool = False
    ) -> GptOssForCausalLM:
        """`keep_mxfp4`: an MXFP4 checkpoint's experts stay 4-bit (Mxfp4Experts); otherwise
        they are dequantized at load. No effect on bf16-stored checkpoints."""
        arch = GptOssArchConfig.from_dict(cfg)
        assert arch.moe is not None
        arch.moe.mxfp4 = keep_mxfp4 and is_mxfp4(cfg)
        return cls(arch, max_position)

    def make_layer(
        self, index: int, rope: RotaryEmbedding, sliding_window: int | None
    ) -> nn.Module:
        c = self.config
        return DecoderLayer(c, rope, sliding_window, mlp=SparseMoE(c.moe, c.hidden_size))

    def checkpoint_rename(self, name: str) -> str | None:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        return super().checkpoint_rename(name)

    def convert_weights(
        self, weights: Iterator[tuple[str, torch.Tensor, str]]
    ) -> Iterator[tuple[str, torch.Tensor, str]]:
        """Checkpoint experts -> StackedExperts' layout (see the module docstring); MXFP4
        experts are dequantized to the model's dtype here (the CPU path and the fallback) or
        kept 4-bit for Mxfp4Experts."""
        assert self.config.moe is not None
        pairs = Mxfp4Pairs(self.model.embed_tokens.weight.dtype, not self.config.moe.mxfp4)
        for name, t, path in weights:
            for ready in pairs.add(name, t):
                name, t = _convert_expert(*ready)
                yield name, t, path
        pairs.check_complete()


def _deinterleave(
    # [..., 2I, ...] along `dim`: gate, up, gate, up, ...
    t: torch.Tensor,
    dim: int,
) -> torch.Tensor:
    """-> gate rows, then up rows (the layout fused_moe reads)."""
    x = t.movedim(dim, 0)
    return torch.cat([x[0::2], x[1::2]]).movedim(0, dim)


def _convert_expert(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(name the loader knows, tensor in StackedExperts' layout) for one checkpoint tensor."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".mlp.experts"):
        return name, t
    if leaf == "gate_up_proj":  # [E, H, 2I] interleaved -> [E, 2I, H], gate rows then up rows
        return name, _deinterleave(t.mT, 1).contiguous()
    if leaf == "down_proj":  # [E, I, H] -> [E, H, I]
        return name, t.mT.contiguous()
    if leaf == "gate_up_proj_bias":
        return f"{prefix}.w13_bias", _deinterleave(t, 1)
    if leaf == "down_proj_bias":
        return f"{prefix}.w2_bias", t
    # MXFP4 kept 4-bit: [E, 2I, H / 32, 16] blocks and [E, 2I, H / 32] scales, rows interleaved
    if leaf in ("gate_up_proj_blocks", "gate_up_proj_scales"):
        return f"{prefix}.w13_{leaf.rpartition('_')[2]}", _deinterleave(t, 1).contiguous()
    if leaf in ("down_proj_blocks", "down_proj_scales"):
        return f"{prefix}.w2_{leaf.rpartition('_')[2]}", t
    return name, t
