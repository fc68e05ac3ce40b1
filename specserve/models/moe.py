"""Mixture-of-experts block shared by every MoE family: router variants, stacked experts over the
fused kernel (`ops.moe.fused_moe`), optional shared experts.

Shared experts (DeepSeek-V3 / GLM-4.x: an MLP every token runs) are fused into the routed ones
by default, as SGLang's shared-experts fusion: shared expert i is expert E + i of the stacked
weights, chosen for every token with weight exactly 1.0 (the routed weights keep their
renormalization and routed_scaling_factor), so the MoE kernels run top_k + n_shared experts
and no separate MLP or add runs. Same math: down(act(gate(x)) * up(x)) of n * I channels is
the sum of n experts of I channels each (the intermediate channels are independent). Why: at
GLM-4.7-Flash batch 1 (H100) the separate MLP and add were three launches, ~16 us a layer,
where streaming its 19 MB inside the MoE kernels costs ~6 us. `fuse_shared_experts=False`
(`tunables().moe_fuse_shared_experts` off for sigmoid_moe_config) keeps the separate MLP (tests
compare the two); MXFP4 and gpt-oss-style experts keep it too.

Routers (formulas as in transformers' modeling_qwen3_moe.py / modeling_glm4_moe.py):
  softmax   Qwen3-MoE (and Mixtral, gpt-oss): top-k of softmax(x W^T) in float32, optionally
            renormalized over the chosen k (`norm_topk_prob`).
  softmax_topk  gpt-oss: the k best logits of x W^T + b, softmaxed among themselves
            (transformers' GptOssTopKRouter); the router has a bias (`router_bias`).
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

from specserve.distributed import tp_reduce
from specserve.models.layers import MLP, RMSNorm
from specserve.ops.moe import fused_moe, fused_moe_mxfp4
from specserve.ops.moe_router import fusable, norm_route, select_experts_ref
from specserve.ops.mxfp4 import BLOCK
from specserve.tunables import tunables


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
    # Shared experts run on every token: as routed experts E.. with weight 1.0 (fused, see the
    # module docstring), or unfused as one dense MLP of n_shared * intermediate_size.
    n_shared_experts: int = 0
    fuse_shared_experts: bool = True
    # GLM / DeepSeek keep the router in float32 even in a bf16 model (their checkpoints do).
    router_fp32: bool = False
    # gpt-oss: a bias on the router logits and on both expert projections, and the clamped
    # SwiGLU ("swiglu_oai", ops/moe.py) with its alpha and limit.
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # gpt-oss MXFP4 checkpoints on CUDA: the experts stay 4-bit (Mxfp4Experts).
    mxfp4: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid", "softmax_topk"):
            raise ValueError(
                f"MoE scoring must be softmax, sigmoid or softmax_topk, got {self.scoring!r}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in 1..num_experts {self.num_experts}"
            )
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"n_group {self.n_group} must divide the {self.num_experts} experts and "
                f"topk_group {self.topk_group} must be in 1..n_group"
            )

    @property
    def n_fused_shared(self) -> int:
        """Shared experts that run as routed experts E.. (none for MXFP4 or gpt-oss-style
        experts: the shared MLP is a plain SwiGLU without biases)."""
        plain = not (self.mxfp4 or self.expert_bias) and self.activation == "silu"
        return self.n_shared_experts if self.fuse_shared_experts and plain else 0


class Router(nn.Module):
    """x -> (topk_weights float32 [T, k + s], topk_ids int64 [T, k + s]), s = the fused shared
    experts (ids E.., weight 1.0, after the k chosen). Checkpoint names: `mlp.gate.weight`
    [E, H] and, for sigmoid routers, `mlp.gate.e_score_correction_bias`."""

    def __init__(self, m: MoeConfig, hidden_size: int) -> None:
        super().__init__()
        self.m = m
        dtype = torch.float32 if m.router_fp32 else None
        self.weight = nn.Parameter(torch.empty(m.num_experts, hidden_size, dtype=dtype))
        bias = torch.zeros(m.num_experts, dtype=torch.float32) if m.correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        self.bias = nn.Parameter(torch.empty(m.num_experts, dtype=dtype)) if m.router_bias else None
        # The fused decode router's completion counter (ops/moe_router.py; reset by the kernel).
        self.register_buffer("route_counter", torch.zeros(1, dtype=torch.int32), persistent=False)

    def routing(self) -> dict[str, Any]:
        """select_experts_ref's keywords for this router."""
        m = self.m
        return dict(
            scoring=m.scoring,
            top_k=m.top_k,
            renormalize=m.norm_topk_prob,
            scale=m.routed_scaling_factor,
            n_group=m.n_group,
            topk_group=m.topk_group,
            n_shared=m.n_fused_shared,
        )

    def forward(
        self,
        # [num_tokens, hidden]
        x: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.m.scoring == "sigmoid":
            bias = None if self.bias is None else self.bias.float()
            logits = F.linear(x.float(), self.weight.float(), bias)
        else:
            logits = F.linear(x, self.weight, self.bias)
        return select_experts_ref(logits, self.e_score_correction_bias, **self.routing())

    def norm_forward(
        self,
        norm: RMSNorm,
        # [num_tokens, hidden]: the attention output
        x: torch.Tensor,
        # [num_tokens, hidden]
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(topk_weights, topk_ids, norm(x + residual), x + residual). Decode batches on CUDA:
        norm, router matmul and expert choice in one launch (ops/moe_router.py)."""
        m = self.m
        w, b, counter = self.weight, self.e_score_correction_bias, self.route_counter
        if fusable(x, w, m.scoring, m.n_group, m.topk_group):
            args = (x, residual, norm.weight, norm.eps, w, b, counter, self.bias)
            return norm_route(*args, **self.routing())
        normed, residual = norm(x, residual) if residual is not None else (norm(x), x)
        weights, ids = self(normed)
        return weights, ids, normed, residual


class StackedExperts(nn.Module):
    """The routed experts' SwiGLU weights stacked over experts, the layout `fused_moe` reads.
    Loading (models/loader.py) fills them from per-expert tensors
    (`experts.<e>.gate_proj/up_proj/down_proj.weight`) or fused ones
    (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I])."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # [E, 2I, H]: gate rows, then up rows
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        # [E, H, I]
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # gpt-oss: [E, 2I] (gate, then up) and [E, H]
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(
        self,
        # [num_tokens, hidden]: normed
        x: torch.Tensor,
        # [num_tokens, top_k] float32
        topk_weights: torch.Tensor,
        # [num_tokens, top_k]
        topk_ids: torch.Tensor,
        **kw: Any,
    ) -> torch.Tensor:
        """[num_tokens, hidden]: `fused_moe` (`kw`: its activation keywords)."""
        if self.w13_bias is not None:
            kw = {**kw, "w13_bias": self.w13_bias, "w2_bias": self.w2_bias}
        return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, **kw)


class Mxfp4Experts(nn.Module):
    """StackedExperts' rows kept in MXFP4 (ops/mxfp4.py: 32 E2M1 codes a block, two a byte,
    one E8M0 scale a block, blocked along each row's input dim), read 4-bit by
    `fused_moe_mxfp4`. gpt-oss's checkpoints on CUDA: decode streams ~4.25 bits a weight
    instead of 16. Uint8 parameters (no grad), filled by models/gpt_oss.py's conversion."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False
    ) -> None:
        super().__init__()
        if hidden_size % BLOCK or intermediate_size % BLOCK:
            raise ValueError(
                f"MXFP4 experts need hidden_size ({hidden_size}) and intermediate_size "
                f"({intermediate_size}) to be multiples of {BLOCK}"
            )
        self.intermediate_size = intermediate_size
        E, H, I2 = num_experts, hidden_size, 2 * intermediate_size

        def u8(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)

        # [E, 2I, H / 32, 16] and [E, 2I, H / 32]: gate rows, then up rows
        self.w13_blocks, self.w13_scales = u8(E, I2, H // BLOCK, BLOCK // 2), u8(E, I2, H // BLOCK)
        # [E, H, I / 32, 16] and [E, H, I / 32]
        self.w2_blocks = u8(E, H, intermediate_size // BLOCK, BLOCK // 2)
        self.w2_scales = u8(E, H, intermediate_size // BLOCK)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(E, I2))
            self.w2_bias = nn.Parameter(torch.empty(E, H))

    def forward(
        self,
        # [num_tokens, hidden]: normed
        x: torch.Tensor,
        # [num_tokens, top_k] float32
        topk_weights: torch.Tensor,
        # [num_tokens, top_k]
        topk_ids: torch.Tensor,
        **kw: Any,
    ) -> torch.Tensor:
        """[num_tokens, hidden]: `fused_moe_mxfp4` (`kw`: the activation keywords)."""
        if self.w13_bias is not None:
            kw = {**kw, "w13_bias": self.w13_bias, "w2_bias": self.w2_bias}
        blocks = (self.w13_blocks, self.w13_scales, self.w2_blocks, self.w2_scales)
        return fused_moe_mxfp4(x, *blocks, topk_weights, topk_ids, **kw)


class SparseMoE(nn.Module):
    """The MoE feed-forward block: router -> fused experts (+ shared experts on every token:
    fused, experts E.. of `experts`; unfused, the `shared_experts` MLP)."""

    # Tensor parallelism: experts split by intermediate size; the partial sums of routed and
    # shared experts are all-reduced once over `tp` (None: no collective).
    tp = None

    def __init__(self, m: MoeConfig, hidden_size: int) -> None:
        super().__init__()
        self.gate = Router(m, hidden_size)
        experts = Mxfp4Experts if m.mxfp4 else StackedExperts
        total = m.num_experts + m.n_fused_shared
        self.experts = experts(total, hidden_size, m.intermediate_size, bias=m.expert_bias)
        # Only gpt-oss-style experts pass the extra arguments of fused_moe.
        self.expert_kw: dict[str, Any] = {}
        if m.expert_bias or m.activation != "silu":
            self.expert_kw = dict(
                activation=m.activation, alpha=m.swiglu_alpha, limit=m.swiglu_limit
            )
        self.shared_experts: MLP | None = None
        if m.n_shared_experts and not m.n_fused_shared:
            self.shared_experts = MLP(hidden_size, m.n_shared_experts * m.intermediate_size)

    @property
    def shared_slots(self) -> range:
        """The expert ids of the fused shared experts (empty when unfused); the loader fills
        them from the checkpoint's `mlp.shared_experts.*` tensors."""
        m = self.gate.m
        return range(m.num_experts, m.num_experts + m.n_fused_shared)

    def forward(
        self,
        # [num_tokens, hidden]: the post-attention-normed input
        x: torch.Tensor,
    ) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts_forward(x, weights, ids)

    def norm_forward(
        self,
        norm: RMSNorm,
        # [num_tokens, hidden]: the attention output
        x: torch.Tensor,
        # [num_tokens, hidden]
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(x + residual)), x + residual), the norm fused into the router where
        the router runs its decode kernel."""
        weights, ids, x, residual = self.gate.norm_forward(norm, x, residual)
        return self.experts_forward(x, weights, ids), residual

    def experts_forward(
        self,
        # [num_tokens, hidden]: normed
        x: torch.Tensor,
        # [num_tokens, top_k + fused shared] float32
        weights: torch.Tensor,
        # [num_tokens, top_k + fused shared]
        ids: torch.Tensor,
    ) -> torch.Tensor:
        out = self.experts(x, weights, ids, **self.expert_kw)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tp_reduce(self.tp, out)


def sigmoid_moe_config(cfg: dict[str, Any]) -> MoeConfig:
    """The DeepSeek-V3 / GLM-4.x MoE block from config.json: sigmoid group-limited routing with
    a correction bias, routed_scaling_factor, shared experts, a float32 router."""
    return MoeConfig(
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
        fuse_shared_experts=tunables().moe_fuse_shared_experts,
        router_fp32=True,
    )


def moe_or_dense(m: MoeConfig, is_moe: bool, hidden_size: int, intermediate_size: int) -> nn.Module:
    """A layer's feed-forward block: SparseMoE, or the dense SwiGLU MLP of `intermediate_size`
    in the layers a family keeps dense."""
    return SparseMoE(m, hidden_size) if is_moe else MLP(hidden_size, intermediate_size)


def num_experts(cfg: dict[str, Any], *keys: str) -> int:
    """The routed-expert count under the first of `keys` present (configs disagree on the
    name: `num_experts`, `num_local_experts` as transformers 5 writes, `n_routed_experts`)."""
    for k in keys:
        if cfg.get(k):
            return int(cfg[k])
    raise ValueError(f"config.json: MoE config needs one of {', '.join(keys)}")
