"""Mixture-of-experts block shared by every MoE family: router variants, stacked experts over the
fused kernel (`ops.moe.fused_moe`), optional shared experts.

Routers (formulas as in transformers' modeling_qwen3_moe.py / modeling_glm4_moe.py):
  softmax   Qwen3-MoE (and Mixtral, gpt-oss): top-k of softmax(x W^T) in float32, optionally
            renormalized over the chosen k (`norm_topk_prob`).
  sigmoid   DeepSeek-V3 / GLM-4.x: s = sigmoid(x W^T) in float32; the choice ranks s + bias
            (`e_score_correction_bias`) among the `topk_group` best of `n_group` groups (a
            group's score: the sum of its two best); the weights are the chosen s, optionally
            renormalized, times `routed_scaling_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.layers import MLP
from specserve.ops.moe import fused_moe


@dataclass
class MoeConfig:
    num_experts: int
    top_k: int
    # Per expert.
    intermediate_size: int
    norm_topk_prob: bool
    scoring: str = "softmax"  # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    # Shared experts run on every token as one dense MLP of n_shared * intermediate_size.
    n_shared_experts: int = 0
    # GLM / DeepSeek keep the router in float32 even in a bf16 model (their checkpoints do).
    router_fp32: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE scoring must be softmax or sigmoid, got {self.scoring!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in 1..num_experts {self.num_experts}"
            )
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"n_group {self.n_group} must divide the {self.num_experts} experts and "
                f"topk_group {self.topk_group} must be in 1..n_group"
            )


class Router(nn.Module):
    """x -> (topk_weights float32 [T, k], topk_ids int64 [T, k]). Checkpoint names:
    `mlp.gate.weight` [E, H] and, for sigmoid routers, `mlp.gate.e_score_correction_bias`."""

    def __init__(self, m: MoeConfig, hidden_size: int) -> None:
        super().__init__()
        self.m = m
        dtype = torch.float32 if m.router_fp32 else None
        self.weight = nn.Parameter(torch.empty(m.num_experts, hidden_size, dtype=dtype))
        bias = torch.zeros(m.num_experts, dtype=torch.float32) if m.correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)

    def forward(
        self,
        # [num_tokens, hidden]
        x: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.m
        if m.scoring == "softmax":
            probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
            weights, ids = probs.topk(m.top_k, dim=-1)
        else:
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
            ids = self._grouped_choice(scores)
            weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            # NOTE: 1e-20 as transformers' sigmoid router (softmax weights never sum to 0).
            eps = 1e-20 if m.scoring == "sigmoid" else 0.0
            weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
        if m.routed_scaling_factor != 1.0:
            weights = weights * m.routed_scaling_factor
        return weights, ids

    def _grouped_choice(
        self,
        # [num_tokens, num_experts] float32
        scores: torch.Tensor,
    ) -> torch.Tensor:
        m = self.m
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias
        if m.topk_group < m.n_group:
            per_group = choice.view(-1, m.n_group, m.num_experts // m.n_group)
            group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)
            groups = group_scores.topk(m.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
            keep = keep[:, :, None].expand_as(per_group).reshape(-1, m.num_experts)
            choice = choice.masked_fill(~keep, float("-inf"))
        return choice.topk(m.top_k, dim=-1, sorted=False)[1]


class StackedExperts(nn.Module):
    """The routed experts' SwiGLU weights stacked over experts, the layout `fused_moe` reads.
    Loading (models/loader.py) fills them from per-expert tensors
    (`experts.<e>.gate_proj/up_proj/down_proj.weight`) or fused ones
    (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I])."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # [E, 2I, H]: gate rows, then up rows
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        # [E, H, I]
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoE(nn.Module):
    """The MoE feed-forward block: router -> fused experts (+ shared experts on every token)."""

    def __init__(self, m: MoeConfig, hidden_size: int) -> None:
        super().__init__()
        self.gate = Router(m, hidden_size)
        self.experts = StackedExperts(m.num_experts, hidden_size, m.intermediate_size)
        self.shared_experts = (
            MLP(hidden_size, m.n_shared_experts * m.intermediate_size)
            if m.n_shared_experts
            else None
        )

    def forward(
        self,
        # [num_tokens, hidden]: the post-attention-normed input
        x: torch.Tensor,
    ) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def num_experts(cfg: dict[str, Any], *keys: str) -> int:
    """The routed-expert count under the first of `keys` present (configs disagree on the
    name: `num_experts`, `num_local_experts` as transformers 5 writes, `n_routed_experts`)."""
    for k in keys:
        if cfg.get(k):
            return int(cfg[k])
    raise ValueError(f"config.json: MoE config needs one of {', '.join(keys)}")
