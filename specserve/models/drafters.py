"""Draft models: a separate causal LM, EAGLE-1, EAGLE-3 and DeepSeek-style MTP heads.

Every drafter exposes the same small surface used by the drafting loop:
  shift            1: input at position p is token p+1 paired with the target's hidden at p
                   (EAGLE/MTP); 0: input at position p is token p (a separate draft model)
  uses_hidden      whether forward() takes hidden states
  combine_hidden() target hidden (+ EAGLE-3 aux taps) -> drafter hidden input
  forward()        -> (hidden for logits, hidden carried to the next draft step)
  write_kv()       forward()'s KV writes alone (a k = 0 step that keeps the drafter's KV
                   complete: the last layer stops after its KV write, no MLP, no logits)
  draft_logits()   logits over the drafter's vocabulary; `to_target_ids` maps its ids
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from specserve.attention.backend import ForwardContext
from specserve.models.layers import MLP, Attention, KVCacheLayer, RMSNorm, RotaryEmbedding
from specserve.models.llama import (
    ArchConfig,
    DecoderLayer,
    LlamaForCausalLM,
    make_rope,
    write_kv_through,
)


class Drafter(nn.Module):
    shift = 1
    uses_hidden = True
    # Parallel drafting (PTD, spec_decode/parallel.py): the target token id fed at mask slots;
    # None for a drafter that was not trained for it.
    ptd_token_id: int | None = None

    def __init__(self) -> None:
        super().__init__()
        # EAGLE-3 style reduced vocabulary: draft id + d2t[draft id] = target id (None: same vocab).
        self.register_buffer("d2t", None)
        # PTD: [hidden] fused hidden input at mask slots (EAGLE / EAGLE-3 heads; None otherwise).
        self.register_buffer("mask_hidden", None)

    def combine_hidden(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        return hidden

    def aux_layers(self) -> tuple[int, ...]:
        return ()

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.d2t is None else ids + self.d2t[ids]

    def write_kv(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> None:
        """The KV `forward` writes at `positions`, without the rest of its work."""
        raise NotImplementedError

    def sliding_windows(self) -> set[int | None]:
        return {m.sliding_window for m in self.modules() if isinstance(m, KVCacheLayer)}


class DraftModelDrafter(Drafter):
    """A separate small causal LM with the target's tokenizer; K autoregressive steps."""

    shift = 0
    uses_hidden = False

    def __init__(self, lm: LlamaForCausalLM) -> None:
        super().__init__()
        self.lm = lm
        if hasattr(lm, "convert_weights"):
            self.convert_weights = lm.convert_weights

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, _ = self.lm(input_ids, positions, ctx)
        return h, None

    def write_kv(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> None:
        self.lm.model.write_kv(input_ids, positions, ctx)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm.compute_logits(h)


class Eagle1Drafter(Drafter):
    """EAGLE-1: fc([embed(x); h]) -> decoder layer(s) (no input norm on the first) -> lm_head."""

    def __init__(
        self, c: ArchConfig, max_position: int, fc_bias: bool, target: LlamaForCausalLM
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=fc_bias)
        rope = make_rope(c, max_position)
        self.layers = nn.ModuleList(DecoderLayer(c, rope, None) for _ in range(c.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        # Shared with the target unless the checkpoint brings its own (see loading).
        self.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._input(input_ids, hidden)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        out = x + residual
        return out, out

    def write_kv(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> None:
        write_kv_through(self.layers, positions, self._input(input_ids, hidden), ctx)

    def _input(self, input_ids: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        assert hidden is not None
        return self.fc(
            torch.cat([self.embed_tokens(input_ids), hidden.to(self.fc.weight.dtype)], -1)
        )

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention over [input_norm(embed); hidden_norm(h)] (2x hidden).
    `norm_before_residual` (speculators / vLLM): the residual branch carries hidden_norm(h)
    instead of h."""

    def __init__(
        self, c: ArchConfig, rope: RotaryEmbedding, norm_before_residual: bool = False
    ) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            rope,
            c.rms_norm_eps,
            c.qkv_bias,
            False,
            None,
            input_size=2 * c.hidden_size,
            o_bias=c.o_bias,
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.mlp_bias, c.hidden_act)

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], -1)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def write_kv(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        ctx: ForwardContext,
    ) -> None:
        """`forward`'s KV write alone: no o_proj, no MLP (most of the head's weights)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        self.self_attn.attend_heads(positions, self.self_attn.qkv_proj(x), ctx)


class Eagle3Drafter(Drafter):
    def __init__(
        self,
        c: ArchConfig,
        max_position: int,
        target: LlamaForCausalLM,
        draft_vocab: int,
        aux_layers: tuple[int, ...],
        target_hidden: int,
        fc_bias: bool = False,
        norm_before_residual: bool = False,
    ) -> None:
        """fc maps the 3 target taps (3 x target_hidden) to the head's hidden size, which may
        differ from the target's (the head then brings its own embed_tokens)."""
        super().__init__()
        self._aux = aux_layers
        self.fc = nn.Linear(3 * target_hidden, c.hidden_size, bias=fc_bias)
        rope = make_rope(c, max_position)
        self.midlayer = Eagle3Layer(c, rope, norm_before_residual)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, draft_vocab, bias=False)
        self.embed_tokens = target.model.embed_tokens
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))

    def aux_layers(self) -> tuple[int, ...]:
        return self._aux

    def combine_hidden(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat(aux, -1).to(self.fc.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.midlayer(positions, self.embed_tokens(input_ids), hidden, ctx)
        normed, prenorm = self.norm(x, residual)
        return normed, prenorm

    def write_kv(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> None:
        assert hidden is not None
        self.midlayer.write_kv(positions, self.embed_tokens(input_ids), hidden, ctx)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)


class MTPDrafter(Drafter):
    """DeepSeek-style MTP: eh_proj([enorm(embed(x)); hnorm(h)]) -> decoder layer -> shared head.
    One module reused for all K steps. `make_layer(rope)` builds the decoder layer: the target
    architecture's own for MTP layers stored in the target checkpoint (an MoE layer for GLM),
    a dense Llama layer by default."""

    def __init__(
        self,
        c: ArchConfig,
        max_position: int,
        target: LlamaForCausalLM,
        make_layer: Callable[[RotaryEmbedding], nn.Module] | None = None,
        mask_position0: bool = True,
    ) -> None:
        super().__init__()
        self.mask_position0 = mask_position0
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        rope = make_rope(c, max_position)
        self.layer = make_layer(rope) if make_layer else DecoderLayer(c, rope, None)
        self.shared_head_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.embed_tokens = target.model.embed_tokens
        self.head = target.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.layer(positions, self._input(input_ids, positions, hidden), None, ctx)
        out = x + residual
        return out, out

    def write_kv(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> None:
        self.layer.write_kv(positions, self._input(input_ids, positions, hidden), None, ctx)

    def _input(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        assert hidden is not None
        e = self.embed_tokens(input_ids)
        if self.mask_position0:
            # vLLM's DeepSeek MTP sees no token embedding at position 0; GLM's (transformers,
            # vLLM) does: the target class says which (`mtp_mask_position0`).
            e = torch.where((positions == 0)[:, None], torch.zeros_like(e), e)
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.to(e.dtype))], -1))

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared_head_norm(h))


class MultiLayerMTPDrafter(Drafter):
    """K DeepSeek-style MTP modules chained: module i (0-based) predicts token t + i + 2 from
    module i-1's output hidden (the target's for i = 0). Driven by spec_decode/multi_layer_mtp.py;
    every module owns its attention layer, hence its own KV layers in the paged pool. With K
    greater than the checkpoint's N MTP layers, module i's parameters are module (i mod N)'s
    (tie_weights_)."""

    def __init__(self, modules: list[MTPDrafter]) -> None:
        super().__init__()
        self.mtp = nn.ModuleList(modules)


def tie_weights_(dst: nn.Module, src: nn.Module) -> None:
    """Make `dst`'s parameters and persistent buffers `src`'s own tensors (same structure
    required). Module objects, non-persistent buffers (rotary tables, kernel counters) and plain
    attributes such as an attention layer's kv_index stay `dst`'s."""
    pairs = zip(
        dst.named_modules(remove_duplicate=False), src.named_modules(remove_duplicate=False)
    )
    for (dname, d), (sname, s) in pairs:
        if dname != sname or type(d) is not type(s):
            raise ValueError(f"tie_weights_: {dname!r} ({type(d).__name__}) is not {sname!r}")
        for name, p in s._parameters.items():
            if p is not None and d._parameters[name].shape != p.shape:
                raise ValueError(f"tie_weights_: {dname}.{name} shapes differ")
            d._parameters[name] = p
        for name, b in s._buffers.items():
            if name not in s._non_persistent_buffers_set:
                d._buffers[name] = b


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE-3 default taps (2, L // 2, L - 3), clamped for shallow targets."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


def eagle3_aux_layers(cfg: dict[str, Any], target_layers: int) -> tuple[int, ...]:
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids or cfg.get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else default_aux_layers(target_layers)
