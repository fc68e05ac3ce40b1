"""Building blocks shared by every architecture: norm, rotary embedding, attention, MLP."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve import ops
from specserve.attention.backend import ForwardContext
from specserve.attention.kv_quant import compute_kv_scales_, is_fp8
from specserve.distributed import tp_reduce
from specserve.ops import pdl
from specserve.ops.gemv import DecodeLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With a residual: add first, return (normed, new residual), as vLLM does."""
        out, new_residual = ops.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, new_residual)


def rope_parameters(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either transformers 4 (`rope_theta`, `rope_scaling`) or 5
    (`rope_parameters`) config layouts."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        kind = params.get("rope_type", params.get("type", "default"))
        return theta, (params if kind not in (None, "default") else None)
    theta = float(cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return theta, scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor (DeepSeek's `yarn_get_mscale`)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    inv_freq: torch.Tensor, s: dict[str, Any], theta: float, dim: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq, cos/sin factor) of YaRN as transformers' `_compute_yarn_parameters`:
    interpolated low frequencies, extrapolated high ones, a linear ramp between; DeepSeek's
    `mscale` / `mscale_all_dim` set the cos/sin factor."""
    factor, old_len = float(s["factor"]), s["original_max_position_embeddings"]
    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else None
        attn = yarn_mscale(factor) if attn is None else attn
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return dim * math.log(old_len / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(fast), corr_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp  # 1: keep the original frequency (extrapolate)
    return inv_freq / factor * (1 - extra) + inv_freq * extra, float(attn)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed cos/sin table.

    `rotary_dim` < head_dim (partial rotary, `partial_rotary_factor`: GLM-4.x MoE): only the
    first rotary_dim channels of each head rotate; the rest pass through, as in transformers.
    YaRN scaling multiplies cos/sin by its attention factor (as transformers)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        dim = self.rotary_dim = rotary_dim or head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        attn_factor = 1.0
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif kind == "linear":
                inv_freq = inv_freq / scaling["factor"]
            elif kind in ("yarn", "deepseek_yarn"):
                inv_freq, attn_factor = _yarn_inv_freq(inv_freq, scaling, theta, dim)
            else:
                raise ValueError(
                    f"unsupported rope scaling type {kind!r} (default, linear, llama3, yarn)"
                )
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq).float()
        cos, sin = freqs.cos() * attn_factor, freqs.sin() * attn_factor
        # [max_position, rotary_dim] as cat(cos, cos) / cat(sin, sin), matching HF's layout.
        self.register_buffer("cos", torch.cat([cos, cos], -1), persistent=False)
        self.register_buffer("sin", torch.cat([sin, sin], -1), persistent=False)

    def forward(
        self,
        # [num_tokens]
        positions: torch.Tensor,
        # [num_tokens, heads, head_dim]
        x: torch.Tensor,
    ) -> torch.Tensor:
        return ops.fused.rope_ref(positions, x, self.cos, self.sin)


class KVCacheLayer(nn.Module):
    """A layer that owns one tensor of the paged KV pool. The KV layout belongs to the
    attention variant: GQA caches per-head K and V, MLA (models/mla.py) a latent per token.
    `kv_index` is its position in ForwardContext.kv_caches (set by the runner)."""

    kv_index: int = -1
    sliding_window: int | None = None

    def __init__(self) -> None:
        super().__init__()
        # [2] fp32: the fp8 KV cache's key and value scales (attention/kv_quant.py; MLA uses
        # the key scale). 1.0 unless the checkpoint has k_scale / v_scale (models/loader.py
        # fills them by those names) or calculate_kv_scales computes them; unused by a cache
        # in the model's dtype.
        self.register_buffer("kv_scales", torch.ones(2, dtype=torch.float32), persistent=False)

    def kv_scale_args(self, ctx: ForwardContext) -> dict[str, torch.Tensor]:
        """The backend's `kv_scales=` keyword for an fp8 cache (none otherwise, so a backend
        without fp8 support fails loudly)."""
        # The training path's caches are None or per-layer lists (attention/dense.py).
        dtype = getattr(ctx.kv_caches[self.kv_index], "dtype", None)
        if dtype is None or not is_fp8(dtype):
            return {}
        return {"kv_scales": self.kv_scales}

    def wants_kv_scales(self, ctx: ForwardContext) -> bool:
        """Whether this forward computes this layer's scales (calculate_kv_scales, once)."""
        todo = ctx.kv_scales_todo
        if not todo or self.kv_index not in todo:
            return False
        todo.discard(self.kv_index)
        return True

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        raise NotImplementedError

    def kv_elems_per_token(self) -> int:
        """Cache elements one token takes in this layer (KV bytes = this x element size)."""
        raise NotImplementedError


class Attention(KVCacheLayer):
    # Tensor parallelism (models/tensor_parallel.py): this rank's heads; o_proj's partial sums
    # are all-reduced over `tp`. None: unsharded, no collective.
    tp = None

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RotaryEmbedding,
        rms_norm_eps: float,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        sliding_window: int | None = None,
        input_size: int | None = None,
        o_bias: bool = False,
        sinks: bool = False,
    ) -> None:
        """`sinks`: a learned logit per query head that joins every softmax denominator and
        attends to nothing (gpt-oss; checkpoint name `self_attn.sinks`)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # EAGLE-3's first layer reads [embed; hidden] (2x hidden) into q/k/v.
        self.qkv_proj = nn.Linear(
            input_size or hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias
        )
        # Where the attention loads its first key tile before its PDL wait (small heads), the
        # qkv gemv lets it launch at the gemv's start, so those loads overlap the projection.
        self.qkv_proj.early_trigger = pdl.early_kv(head_dim)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.rope = rope
        self.sliding_window = sliding_window
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        self.scale = head_dim**-0.5
        self.kv_index = -1  # position of this layer's cache in ForwardContext.kv_caches

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def kv_elems_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def forward(
        self,
        # [num_tokens]
        positions: torch.Tensor,
        # [num_tokens, input_size]
        x: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x), ctx)

    def attend(
        self,
        # [num_tokens]
        positions: torch.Tensor,
        # [num_tokens, q_size + 2 * kv_size]: qkv_proj's output
        qkv: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """Everything after qkv_proj: RoPE, KV write, attention, o_proj."""
        out = self.attend_heads(positions, qkv, ctx)
        return tp_reduce(self.tp, self.o_proj(out.reshape(-1, self.q_size)))

    def attend_heads(
        self,
        # [num_tokens]
        positions: torch.Tensor,
        # [num_tokens, q_size + 2 * kv_size]: qkv_proj's output
        qkv: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """RoPE, KV write and attention -> [num_tokens, num_heads, head_dim], before o_proj.
        Alone, it is a layer's KV write (`DecoderLayer.write_kv`)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        rd = self.rope.rotary_dim
        calc_scales = self.wants_kv_scales(ctx)
        # NOTE: the scales are computed from rotated keys, so that step rotates before the
        # backend (unfused): the one eager prefill calculate_kv_scales runs.
        fused_rope = rd == self.head_dim and ctx.backend.fuses_rope and not calc_scales
        fused_rope = fused_rope and q.stride(-1) == 1 and k.stride(-1) == 1
        # Only sink / qk-norm layers pass `sinks` / `qk_norm`, so other backends keep their
        # signature.
        kw = {} if self.sinks is None else {"sinks": self.sinks}
        kw.update(self.kv_scale_args(ctx))
        if self.q_norm is not None:
            qn, kn = self.q_norm, self.k_norm
            if fused_rope and ctx.backend.fuses_qk_norm:  # normed where RoPE is: one launch less
                kw["qk_norm"] = (qn.weight, kn.weight, qn.eps, kn.eps)
            else:
                q, k = ops.qk_norm_(q, k, qn.weight, kn.weight, qn.eps, kn.eps)
        args = (ctx.kv_caches[self.kv_index], ctx.meta(self.sliding_window), self.scale)
        args = (*args, self.sliding_window)
        if rd < self.head_dim:
            q, k = self._partial_rope(positions, q, k, rd)
            if calc_scales:
                compute_kv_scales_(self.kv_scales, k, v)
            out = ctx.backend.forward(q, k, v, *args, **kw)
        elif fused_rope:
            # RoPE inside the KV write: q rotated in place, rotated k goes to the cache only.
            rope = (positions, self.rope.cos, self.rope.sin)
            out = ctx.backend.forward(q, k, v, *args, rope=rope, **kw)
        else:
            q, k = ops.rope_(positions, q, k, self.rope.cos, self.rope.sin)
            if calc_scales:
                compute_kv_scales_(self.kv_scales, k, v)
            out = ctx.backend.forward(q, k, v, *args, **kw)
        return out

    def _partial_rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rd: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE over the first `rd` channels of each head. On CUDA ops.rope_ rotates the views
        in place (q and k are then done); the CPU reference returns new tensors to splice in."""
        qr, kr = ops.rope_(positions, q[..., :rd], k[..., :rd], self.rope.cos, self.rope.sin)
        if qr.data_ptr() != q.data_ptr():
            q = torch.cat([qr, q[..., rd:]], dim=-1)
        if kr.data_ptr() != k.data_ptr():
            k = torch.cat([kr, k[..., rd:]], dim=-1)
        return q, k


# Gate activations of `act(gate) * up` MLPs, by their Hugging Face `hidden_act` names.
ACTIVATIONS: dict[str, Any] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu2": lambda x: F.relu(x).square(),
}


class MLP(nn.Module):
    # Tensor parallelism: down_proj's partial sums are all-reduced over `tp` (None: no
    # collective; also for an MoE's shared experts, summed with the routed ones).
    tp = None

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"
    ) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r} ({', '.join(ACTIVATIONS)})")
        self.intermediate_size = intermediate_size
        self.act = act
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        # decode_matmul="auto" plans this gate_up with its fused SiLU-and-mul epilogue (the
        # others run their activation after the plain product: ops/gemv_plan.py).
        self.gate_up_proj.silu_gate_up = act == "silu"
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gate_up_act(self.gate_up_proj, x, self.act))

    def down(
        self,
        # [num_tokens, intermediate_size]: act(gate) * up
        act: torch.Tensor,
    ) -> torch.Tensor:
        return tp_reduce(self.tp, self.down_proj(act))


def gate_up_act(gate_up: nn.Linear, x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up of an MLP's fused gate_up projection."""
    if act != "silu":  # NOTE: the fused kernels implement SiLU only: the others run in torch.
        gate, up = gate_up(x).chunk(2, dim=-1)
        return ACTIVATIONS[act](gate) * up
    cfg = gate_up.config(x, silu_mul=True) if isinstance(gate_up, DecodeLinear) else None
    if cfg is not None:  # decode_matmul triton/auto: gate_up and SiLU-and-mul in one kernel
        return gate_up.run(x, cfg, silu_mul=True)
    return ops.silu_and_mul(gate_up(x))


def feeds_from_norm(linear: nn.Module) -> None:
    """Mark `linear` as one the model calls through `norm_linear` (an RMSNorm, with the residual
    add, in front): decode_matmul="auto" times its Triton candidates with that norm fused, as
    they will run (ops/gemv_plan.py), and its cuBLAS candidate after a separate norm kernel."""
    linear.norm_fed = True


def norm_linear(
    norm: nn.Module,
    linear: nn.Linear,
    # [num_tokens, hidden]
    x: torch.Tensor,
    # [num_tokens, hidden] or None (the first layer: x is the residual)
    residual: torch.Tensor | None,
    silu_mul: bool = False,
    act: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual), `silu_mul`: gate_up_act (with `act`) instead
    of linear.
    Where the decode plan runs `linear` in Triton (decode_matmul triton / auto) the norm runs
    inside the matmul's K loop (`gemv_norm`): one launch instead of two."""
    fusable = not silu_mul or act == "silu"
    if fusable and isinstance(linear, DecodeLinear) and isinstance(norm, RMSNorm):
        cfg = linear.config(x, silu_mul)
        if cfg is not None:
            return linear.run_norm(x, norm.weight, norm.eps, residual, cfg, silu_mul)
    if residual is None:
        x, residual = norm(x), x
    else:
        x, residual = norm(x, residual)
    return (gate_up_act(linear, x, act) if silu_mul else linear(x)), residual
