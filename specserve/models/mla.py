"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash), as transformers'
modeling_deepseek_v3.py / modeling_glm4_moe_lite.py define it:

    q          = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))      [T, H, nope + R]
    c, k_pe    = kv_a_proj_with_mqa(x) split [L, R];  c = kv_a_layernorm(c)
    k[h], v[h] = kv_b_proj(c) split per head [nope, v];  k[h] = [k_nope[h]; k_pe]

The cache holds c and the rotated k_pe per token (L + R values, not H * (nope + R + v)). The
key and value up-projections are absorbed (vLLM's MLA): q_latent[h] = q_nope[h] W_UK[h] reads
c directly, and the attention output in latent space goes through W_UV[h] before o_proj.

`rope_interleave`: the checkpoint's rotary channels are interleaved pairs (x0, x1), (x2, x3)
...; transformers rotates them in place and returns them de-interleaved, which equals
de-interleaving first and applying rotate-half rotary (attention/mla.py does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specserve.attention.backend import ForwardContext
from specserve.attention.mla import MLAWeights
from specserve.models.layers import (
    KVCacheLayer,
    RMSNorm,
    RotaryEmbedding,
    feeds_from_norm,
    norm_linear,
    yarn_mscale,
)
from specserve.ops import gemv as gemv_ops
from specserve.ops.gemv import DecodeLinear

# transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps.
_LORA_NORM_EPS = 1e-6


@dataclass
class MLAConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    attention_bias: bool
    # Softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN.
    scale: float

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], rope_scaling: dict[str, Any] | None) -> MLAConfig:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not cfg.get(key):
                raise ValueError(f"config.json: MLA needs a positive {key}")
        qk_head_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        scale = qk_head_dim**-0.5
        if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
            m = yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
            scale = scale * m * m
        return cls(
            hidden_size=cfg["hidden_size"],
            num_heads=cfg["num_attention_heads"],
            q_lora_rank=cfg.get("q_lora_rank") or None,
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            scale=scale,
        )

    @property
    def full_kv_elems_per_token(self) -> int:
        """What a per-head K/V cache of this layer would hold per token (for comparison)."""
        return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)


class MLAAttention(KVCacheLayer):
    def __init__(self, m: MLAConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        if rope.rotary_dim != m.qk_rope_head_dim:
            raise ValueError(
                f"MLA rotates all {m.qk_rope_head_dim} qk_rope_head_dim channels; the rotary "
                f"embedding has {rope.rotary_dim} (partial_rotary_factor must be 1)"
            )
        self.m = m
        H, qk = m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
        bias = m.attention_bias
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(m.hidden_size, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(m.hidden_size, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            m.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), False)
        # NOTE: read as a tensor (absorbed(): W_UK / W_UV), never called: an fp8 checkpoint's
        # kv_b_proj stays dequantized (models/fp8_linear.py).
        self.kv_b_proj.keep_dense = True
        self.o_proj = nn.Linear(H * m.v_head_dim, m.hidden_size, bias=bias)
        # norm_forward / forward run these with an RMSNorm fused in: the decode plan times that
        for lin in (self.kv_a_proj_with_mqa, getattr(self, "q_proj", None)):
            if lin is not None:
                feeds_from_norm(lin)
        if m.q_lora_rank is not None:
            feeds_from_norm(self.q_a_proj)
            feeds_from_norm(self.q_b_proj)
        self.rope = rope
        self.scale = m.scale
        self.kv_index = -1
        self.sliding_window = None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.m.kv_lora_rank + self.m.qk_rope_head_dim)

    def kv_elems_per_token(self) -> int:
        return self.m.kv_lora_rank + self.m.qk_rope_head_dim

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, L], W_UV [H, v, L]): views of kv_b_proj's weight."""
        m = self.m
        w = self.kv_b_proj.weight.view(m.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def weights(self) -> MLAWeights:
        w_uk, w_uv = self.absorbed()
        norm = self.kv_a_layernorm
        return MLAWeights(
            w_uk, w_uv, norm.weight, norm.eps, self.rope.cos, self.rope.sin,
            self.m.rope_interleave, self.scale,
        )  # fmt: skip

    def forward(
        self,
        # [num_tokens]
        positions: torch.Tensor,
        # [num_tokens, hidden]: the input-normed hidden states
        x: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        a = self.q_proj if self.m.q_lora_rank is None else self.q_a_proj
        return self._attend(positions, a(x), self.kv_a_proj_with_mqa(x), ctx)

    def norm_forward(
        self,
        # [num_tokens]
        positions: torch.Tensor,
        norm: nn.Module,
        # [num_tokens, hidden]: the hidden states before the input norm
        x: torch.Tensor,
        # [num_tokens, hidden] or None (the first layer: x is the residual)
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual). Where the decode plan runs both input
        projections (q_a / q_proj and kv_a_proj_with_mqa) in Triton, the norm runs inside their
        gemvs (`gemv_norm`): the first adds the residual, the second reads that sum; no
        separate norm launch."""
        a, b = self.q_proj if self.m.q_lora_rank is None else self.q_a_proj, self.kv_a_proj_with_mqa
        fusable = isinstance(norm, RMSNorm) and gemv_ops.FUSE_NORM
        if fusable and isinstance(a, DecodeLinear) and isinstance(b, DecodeLinear):
            cfg_a, cfg_b = a.config(x), b.config(x)
            if cfg_a is not None and cfg_b is not None:
                q_in, h = a.run_norm(x, norm.weight, norm.eps, residual, cfg_a)
                kv_a, _ = b.run_norm(h, norm.weight, norm.eps, None, cfg_b)
                return self._attend(positions, q_in, kv_a, ctx), h
        if residual is None:
            x, residual = norm(x), x
        else:
            x, residual = norm(x, residual)
        return self(positions, x, ctx), residual

    def _attend(
        self,
        # [num_tokens]
        positions: torch.Tensor,
        # [num_tokens, q_lora_rank] (q_a_proj's output) or [num_tokens, H * (nope + R)] (q_proj's)
        q_in: torch.Tensor,
        # [num_tokens, L + R]: kv_a_proj_with_mqa's output
        kv_a: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        m = self.m
        T, H = q_in.shape[0], m.num_heads
        q = q_in
        if m.q_lora_rank is not None:
            # q_a_layernorm runs inside q_b_proj's decode gemv where the plan takes Triton.
            q, _ = norm_linear(self.q_a_layernorm, self.q_b_proj, q_in, None)
        out = ctx.backend.forward_mla(
            positions,
            q.view(T, H, -1),
            kv_a,
            self.weights(),
            ctx.kv_caches[self.kv_index],
            ctx.meta(None),
        )
        return self.o_proj(out.reshape(T, H * m.v_head_dim))
