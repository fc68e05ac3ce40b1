"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) and the generic decoder other families
build on: `LlamaModel` stacks whatever layers `LlamaForCausalLM.make_layer` makes, so an MoE
family (qwen3_moe.py, glm4_moe.py) subclasses the causal LM and overrides the layer's MLP."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specserve.attention.backend import ForwardContext
from specserve.models.layers import (
    ACTIVATIONS,
    MLP,
    Attention,
    RMSNorm,
    RotaryEmbedding,
    feeds_from_norm,
    norm_linear,
    rope_parameters,
)
from specserve.models.loader import ModelLoadError
from specserve.models.moe import SparseMoE
from specserve.ops.greedy_head import greedy_logits


@dataclass
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    qk_norm: bool
    mlp_bias: bool
    hidden_act: str
    # One entry per layer: None = full attention.
    sliding_windows: list[int | None]
    raw: dict[str, Any]
    # Channels of a head that rotate (partial_rotary_factor * head_dim); the rest pass through.
    rotary_dim: int = 0
    o_bias: bool = False
    # gpt-oss: a learned sink logit per query head in every attention softmax.
    attn_sinks: bool = False

    def __post_init__(self) -> None:
        self.rotary_dim = self.rotary_dim or self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        n_layers = cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
        theta, scaling = rope_parameters(cfg)
        _reject_unsupported_math(cfg)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # transformers 5 keeps partial_rotary_factor in rope_parameters, 4 at the top level.
        factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
        factor = float(factor or cfg.get("partial_rotary_factor") or 1.0)
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            # transformers reads mlp_bias for Llama only (Qwen and Mistral MLPs have no bias).
            mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            hidden_act=_hidden_act(cfg),
            sliding_windows=_sliding_windows(cfg, arch, n_layers),
            raw=cfg,
            rotary_dim=int(head_dim * factor),
            # Llama and Qwen3 put attention_bias on o_proj too; Qwen2 and Mistral never do.
            o_bias=attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
        )


# Config fields that change the math, with the value that leaves it unchanged: a checkpoint
# asking for anything else fails to load instead of giving wrong tokens.
_NEUTRAL_MATH_FIELDS: dict[str, Any] = {
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": None,
    "logits_scaling": 1.0,
    "query_pre_attn_scalar": None,
}


def _reject_unsupported_math(cfg: dict[str, Any]) -> None:
    for name, neutral in _NEUTRAL_MATH_FIELDS.items():
        value = cfg.get(name, neutral)
        if value is not None and value != neutral:
            raise ModelLoadError(
                f"config.json: {name} = {value!r} is not supported by specserve "
                f"(only {neutral!r}); refusing to load a model it would run wrongly"
            )


def _hidden_act(cfg: dict[str, Any]) -> str:
    field = "hidden_act" if "hidden_act" in cfg else "hidden_activation"
    act = cfg.get(field, "silu")
    if act not in ACTIVATIONS:
        raise ModelLoadError(
            f"config.json: {field} = {act!r} is not supported by specserve "
            f"(supported: {', '.join(ACTIVATIONS)})"
        )
    return act


def _sliding_windows(cfg: dict[str, Any], arch: str, n_layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    if window is None:
        return [None] * n_layers
    if "layer_types" in cfg and cfg["layer_types"]:
        return [window if t == "sliding_attention" else None for t in cfg["layer_types"]]
    if arch.startswith("Qwen"):
        # Qwen uses the window only when asked, and only from max_window_layers on.
        if not cfg.get("use_sliding_window", False):
            return [None] * n_layers
        start = cfg.get("max_window_layers", n_layers)
        return [window if i >= start else None for i in range(n_layers)]
    return [window] * n_layers


class DecoderLayer(nn.Module):
    def __init__(
        self,
        c: ArchConfig,
        rope: RotaryEmbedding,
        sliding_window: int | None,
        attn_input_size: int | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        """`mlp`: the feed-forward block (default: the dense MLP; an MoE family passes its
        SparseMoE)."""
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            rope,
            c.rms_norm_eps,
            c.qkv_bias,
            c.qk_norm,
            sliding_window,
            attn_input_size,
            c.o_bias,
            c.attn_sinks,
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = (
            mlp
            if mlp is not None
            else MLP(c.hidden_size, c.intermediate_size, c.mlp_bias, c.hidden_act)
        )
        # forward runs these through norm_linear: the decode plan times them with the norm fused
        feeds_from_norm(self.self_attn.qkv_proj)
        if isinstance(self.mlp, MLP):
            feeds_from_norm(self.mlp.gate_up_proj)

    def forward(
        self,
        positions: torch.Tensor,
        # [num_tokens, hidden]
        x: torch.Tensor,
        # [num_tokens, hidden] or None for the first layer
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, x, residual)
        x = attn.attend(positions, qkv, ctx)
        if not isinstance(mlp, MLP):
            return norm_ffn(self.post_attention_layernorm, mlp, x, residual)
        act, residual = norm_linear(
            self.post_attention_layernorm, mlp.gate_up_proj, x, residual, True, mlp.act
        )
        return mlp.down(act), residual

    def write_kv(
        self,
        positions: torch.Tensor,
        # [num_tokens, hidden]
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> None:
        """This layer's KV at `positions` and nothing after it: input norm, qkv, RoPE, the KV
        write (and the backend's attention, which a draft step's one token a request makes
        cheap); no o_proj, no MLP or MoE, most of the layer's weights."""
        qkv, _ = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        self.self_attn.attend_heads(positions, qkv, ctx)


def norm_ffn(
    norm: RMSNorm,
    mlp: nn.Module,
    # [num_tokens, hidden]: the attention output
    x: torch.Tensor,
    # [num_tokens, hidden]
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mlp(norm(x + residual)), x + residual) for a feed-forward block other than the dense
    MLP (whose norm DecoderLayer fuses into gate_up)."""
    if isinstance(mlp, SparseMoE):  # the norm runs inside the router's decode kernel
        return mlp.norm_forward(norm, x, residual)
    x, residual = norm(x, residual)
    return mlp(x), residual


# (layer index, shared rotary embedding, sliding window) -> decoder layer
LayerFactory = Callable[[int, RotaryEmbedding, "int | None"], nn.Module]


class LlamaModel(nn.Module):
    def __init__(
        self, c: ArchConfig, max_position: int, make_layer: LayerFactory | None = None
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        rope = make_rope(c, max_position)
        make = make_layer or (lambda i, r, w: DecoderLayer(c, r, w))
        self.layers = nn.ModuleList(
            make(i, rope, c.sliding_windows[i]) for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self,
        # [num_tokens]
        input_ids: torch.Tensor,
        # [num_tokens]
        positions: torch.Tensor,
        ctx: ForwardContext,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final-norm hidden states [num_tokens, hidden] and, for EAGLE-3, the
        residual-stream inputs of the layers in `aux_layers`."""
        x = self.embed_tokens(input_ids)
        residual = None
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                taps[i] = x if residual is None else x + residual
            x, residual = layer(positions, x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x, [taps[i] for i in aux_layers]

    def write_kv(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> None:
        """Every layer's KV at `positions`, nothing else (`write_kv_through`)."""
        write_kv_through(self.layers, positions, self.embed_tokens(input_ids), ctx)


def write_kv_through(
    layers: nn.ModuleList,
    positions: torch.Tensor,
    # [num_tokens, hidden]: the first layer's input
    x: torch.Tensor,
    ctx: ForwardContext,
) -> None:
    """Every layer's KV at `positions`: the layers before the last run in full (the next one
    reads their output), the last stops at its KV write (`DecoderLayer.write_kv`)."""
    residual = None
    for layer in layers[:-1]:
        x, residual = layer(positions, x, residual, ctx)
    layers[-1].write_kv(positions, x, residual, ctx)


def make_rope(c: ArchConfig, max_position: int) -> RotaryEmbedding:
    return RotaryEmbedding(c.head_dim, max_position, c.rope_theta, c.rope_scaling, c.rotary_dim)


class LlamaForCausalLM(nn.Module):
    """The causal LM every family shares: embed -> layers -> norm -> lm_head. A family
    subclasses it with its own config parsing (`from_config_dict`) and `make_layer`."""

    # MTP layers stored in this checkpoint zero the token embedding at position 0 (DeepSeek
    # style, as vLLM); a family whose MTP layers do not (GLM) sets False.
    mtp_mask_position0 = True

    def __init__(self, c: ArchConfig, max_position: int) -> None:
        super().__init__()
        self.config = c
        self.model = LlamaModel(c, max_position, self.make_layer)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_config_dict(cls, cfg: dict[str, Any], max_position: int) -> LlamaForCausalLM:
        return cls(ArchConfig.from_dict(cfg), max_position)

    def make_layer(
        self, index: int, rope: RotaryEmbedding, sliding_window: int | None
    ) -> nn.Module:
        """Decoder layer `index` (indices past num_hidden_layers: the checkpoint's MTP layers,
        whose decoder layer an MTP drafter takes from here)."""
        return DecoderLayer(self.config, rope, sliding_window)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model(input_ids, positions, ctx, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def greedy_logits(
        self,
        # [M, H]
        hidden: torch.Tensor,
        # [>= M] int64 greedy keys (ops/greedy_head.new_keys)
        keys: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(compute_logits(hidden), their argmax [M] int64) from the lm_head's gemv where it
        runs one, else None (ops/greedy_head.py)."""
        return greedy_logits(self.lm_head, hidden, keys)

    def checkpoint_rename(self, name: str) -> str | None:
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return None
        # MTP layers stored after the decoder layers belong to the MTP drafter, not the target.
        if name.startswith("model.layers."):
            idx = int(name.split(".")[2])
            if idx >= self.config.num_hidden_layers:
                return None
        return name

    def sliding_windows(self) -> set[int | None]:
        return set(self.config.sliding_windows)
