"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash), as transformers'
modeling_deepseek_v3.py / modeling_glm4_moe_lite.py define it:

    q          = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))      [T, H, nope + R]
    c, k_pe    = kv_a_proj_with_mqa(x) split [L, R];  c = kv_a_layernorm(c)
    (q_a_proj or q_proj and kv_a_proj_with_mqa read the same x: they run as one matmul,
    `fused_qkv_a_proj`, as vLLM's; the loader stacks the two checkpoint tensors into it)
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
from specserve.distributed import tp_reduce
from specserve.models.layers import (
    KVCacheLayer,
    RMSNorm,
    RotaryEmbedding,
    feeds_from_norm,
    norm_linear,
    yarn_mscale,
)

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
    # Tensor parallelism: this rank's heads; o_proj's partial sums all-reduced over `tp`.
    tp = None

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
        # (q_proj's rows [H * qk] or q_a_proj's [q_lora_rank], kv_a_proj_with_mqa's [L + R]):
        # one launch instead of two at decode, and no re-read of the normed input (GLM-4.7-Flash
        # on an H100: the two gemvs took 3.9 + 3.6 us a layer, benchmarks/RESULTS.md).
        self.qkv_a_sizes = (
            H * qk if m.q_lora_rank is None else m.q_lora_rank,
            m.kv_lora_rank + m.qk_rope_head_dim,
        )
        if bias and m.q_lora_rank is None:
            # transformers gives kv_a_proj_with_mqa a bias there but q_proj none: half a fused
            # bias (no such checkpoint is published; DeepSeek-V2-Lite has no attention bias)
            raise ValueError(
                "config.json: attention_bias with q_lora_rank null is not supported (the fused "
                "q_proj + kv_a_proj_with_mqa would have a bias on one part only)"
            )
        self.fused_qkv_a_proj = nn.Linear(m.hidden_size, sum(self.qkv_a_sizes), bias=bias)
        if m.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * qk, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), False)
        # NOTE: read as a tensor (absorbed(): W_UK / W_UV), never called: an fp8 checkpoint's
        # kv_b_proj stays dequantized (models/fp8_linear.py).
        self.kv_b_proj.keep_dense = True
        self.o_proj = nn.Linear(H * m.v_head_dim, m.hidden_size, bias=bias)
        # norm_forward / _attend run these with an RMSNorm fused in: the decode plan times that
        feeds_from_norm(self.fused_qkv_a_proj)
        if m.q_lora_rank is not None:
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
            self.m.rope_interleave, self.scale, self.kv_scales,
        )  # fmt: skip

    def forward(
        self,
        # [num_tokens]
        positions: torch.Tensor,
        # [num_tokens, hidden]: the input-normed hidden states
        x: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        return self._attend(positions, self.fused_qkv_a_proj(x), ctx)

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
        """(self(norm(x + residual)), x + residual): where the decode plan runs the fused input
        projection in Triton, the norm runs inside its gemv (`norm_linear`)."""
        qkv_a, residual = norm_linear(norm, self.fused_qkv_a_proj, x, residual)
        return self._attend(positions, qkv_a, ctx), residual

    def _attend(
        self,
        # [num_tokens]
        positions: torch.Tensor,
        # [num_tokens, sum(qkv_a_sizes)]: fused_qkv_a_proj's output, q_a_proj's (or q_proj's)
        # columns then kv_a_proj_with_mqa's
        qkv_a: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        m = self.m
        # [T, q_lora_rank or H * (nope + R)], [T, L + R]: views
        q_in, kv_a = qkv_a.split(self.qkv_a_sizes, dim=-1)
        T, H = q_in.shape[0], m.num_heads
        q = q_in
        if m.q_lora_rank is not None:
            # q_a_layernorm runs inside q_b_proj's decode gemv where the plan takes Triton.
            q, _ = norm_linear(self.q_a_layernorm, self.q_b_proj, q_in, None)
        w = self.weights()
        w.calc_kv_scale = self.wants_kv_scales(ctx)
        out = ctx.backend.forward_mla(
            positions,
            q.view(T, H, -1),
            kv_a,
            w,
            ctx.kv_caches[self.kv_index],
            ctx.meta(None),
        )
        return tp_reduce(self.tp, self.o_proj(out.reshape(T, H * m.v_head_dim)))
