"""The decode gemv (batches of M <= 8 rows) as a Triton kernel, with its torch reference.

Decode is a stream of weight reads: y[M, N] = x[M, K] @ W[N, K]^T (+ b) with M tiny reads N x K
weights once. Each program owns BLOCK_N output columns and walks K in BLOCK_K tiles, so every
weight byte is loaded exactly once, in long contiguous rows; the few activation rows are reloaded
per tile from L2. No split-K: with BLOCK_N <= 32 even N = 4096 gives >= 128 programs, and a
deterministic reduction order keeps results reproducible.

`decode_matmul="auto"` (the default) times it against cuBLAS on the model's own bf16/fp16
weights at start-up and picks per weight shape and row count (ops/gemv_plan.py); `"triton"`
turns every nn.Linear of the models into a `DecodeLinear` that always takes it for decode
batches; `"cublas"` never does.
`benchmarks/gemv.py` compares them on the Llama-3-8B shapes, `benchmarks/decode.py` on a whole
decode step.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.ops import graph_rows, l2, pdl, skinny
from specserve.ops.jit import launcher
from specserve.ops.linear_swap import replace_linears_, sharing

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference only
    triton = None

MAX_M = 8
# The greedy key of a row before any column is folded in (below every packed key), and the
# column field's complement base: a key's low 31 bits hold KEY_COLUMNS - column (gemv's
# ARGMAX epilogue, ops/greedy_head.py).
KEY_EMPTY = -(2**63)
KEY_COLUMNS = 2**31 - 1


def gemv_ref(
    # [M, K]
    x: torch.Tensor,
    # [N, K] (nn.Linear layout)
    w: torch.Tensor,
    # [N] or None
    b: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, N], accumulated in fp32, rounded once to x's dtype."""
    return _matmul_f32(x, w, b).to(x.dtype)


def _matmul_f32(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ w.float().t()
    return y + b.float() if b is not None else y


def gemv_silu_mul_ref(
    # [M, K]
    x: torch.Tensor,
    # [2N, K]: gate rows, then up rows (the MLP's gate_up_proj)
    w: torch.Tensor,
    # [2N] or None
    b: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, N] = silu(gate) * up, in fp32, rounded once to x's dtype."""
    gate, up = _matmul_f32(x, w, b).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def gemv_norm_ref(
    # [M, K]
    x: torch.Tensor,
    # [N, K] or [2N, K] with silu_mul
    w: torch.Tensor,
    b: torch.Tensor | None,
    # [K]
    norm_weight: torch.Tensor,
    eps: float,
    # [M, K] or None
    residual: torch.Tensor | None,
    silu_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemv_ref or gemv_silu_mul_ref of rms_norm(x + residual), x + residual): the sum rounded
    to x's dtype (as the norm kernel), the normalized input kept in fp32 (no rounding between
    norm and matmul: the fused kernel never materializes it)."""
    h = x + residual if residual is not None else x
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = (gemv_silu_mul_ref if silu_mul else gemv_ref)(normed, w, b)  # fp32 in, fp32 out
    return y.to(x.dtype), h


if triton is not None:

    @triton.jit
    def _weight_tiles(w_row, up_row, k, n_ok, K, SILU_MUL: tl.constexpr, W_EVICT: tl.constexpr):
        """[BLOCK_N, BLOCK_K]: the weight tile at columns k (and the up tile), read once
        (W_EVICT: ops/l2.py's policy)."""
        tile_ok = n_ok[:, None] & (k < K)[None, :]
        w = tl.load(w_row + k[None, :], mask=tile_ok, other=0.0, eviction_policy=W_EVICT)
        w_up = w
        if SILU_MUL:
            w_up = tl.load(up_row + k[None, :], mask=tile_ok, other=0.0, eviction_policy=W_EVICT)
        return w, w_up

    @triton.jit
    def _gemv_tile(
        acc,
        acc_up,
        sum_sq,
        # [BLOCK_N, BLOCK_K] weight tile (and the up tile with SILU_MUL), any float dtype
        w,
        w_up,
        k,
        x_ptr,
        res_ptr,
        res_out_ptr,
        norm_w_ptr,
        M,
        K,
        stride_xm,
        write_res,
        SILU_MUL: tl.constexpr,
        NORM: tl.constexpr,
        HAS_RES: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """acc[, acc_up] += x[:, k] @ tile^T (x normed per NORM); sum_sq += sum(x[:, k]^2)."""
        rows = tl.arange(0, BLOCK_M)
        k_ok = k < K
        w = w.to(tl.float32)
        if SILU_MUL:
            w_up = w_up.to(tl.float32)
        if NORM:
            g = tl.load(norm_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        for i in tl.static_range(BLOCK_M):
            xi = tl.load(x_ptr + i * stride_xm + k, mask=k_ok & (i < M), other=0.0)
            if HAS_RES:
                ri = tl.load(res_ptr + i * stride_xm + k, mask=k_ok & (i < M), other=0.0)
                xi = (xi.to(tl.float32) + ri.to(tl.float32)).to(x_ptr.dtype.element_ty)
                tl.store(res_out_ptr + i * stride_xm + k, xi, mask=k_ok & (i < M) & write_res)
            xi = xi.to(tl.float32)
            if NORM:
                sum_sq += tl.where(rows == i, tl.sum(xi * xi, axis=0), 0.0)
                xi = xi * g
            xi = xi[None, :]
            at_i = rows[:, None] == i
            acc += tl.where(at_i, tl.sum(w * xi, axis=1)[None, :], 0.0)
            if SILU_MUL:
                acc_up += tl.where(at_i, tl.sum(w_up * xi, axis=1)[None, :], 0.0)
        return acc, acc_up, sum_sq

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        res_ptr,
        res_out_ptr,
        norm_w_ptr,
        eps,
        keys_ptr,
        HAS_BIAS: tl.constexpr,
        SILU_MUL: tl.constexpr,
        NORM: tl.constexpr,
        HAS_RES: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
        EARLY_TRIGGER: tl.constexpr,
        PRELOAD: tl.constexpr,
        W_EVICT: tl.constexpr = "",
        ARGMAX: tl.constexpr = False,
    ):
        # Each program owns BLOCK_N output columns and walks K in BLOCK_K tiles.
        # SILU_MUL: W is [2N, K] (gate rows, then up rows) and y = silu(gate) * up, so the MLP's
        # [M, 2N] intermediate is never written.
        # NORM: x is the pre-norm hidden state; the product is W @ rms_norm(x (+ res)). Since
        # W @ (x * g * rstd) = rstd * (W @ (x * g)), the K loop accumulates W @ (x * g) and
        # sum(x^2) side by side and scales by rstd at the end: no separate norm kernel, no extra
        # pass over x. HAS_RES: x + res first (rounded to the model dtype, as the norm kernel
        # does); program 0 also writes that sum to res_out (the next residual).
        # PDL: weights never depend on the previous kernel, so with PRELOAD the first weight
        # tile is requested before waiting for it (x is its output); EARLY_TRIGGER (a qkv
        # projection feeding attention that preloads its first key tile, pdl.early_kv) lets the
        # next kernel launch at this one's start. Without it: trigger after the weight stream.
        # ARGMAX: also each row's greedy token, folded into keys_ptr (`argmax_epilogue`).
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        w_row = w_ptr + n.to(tl.int64)[:, None] * stride_wn
        up_row = w_row + N * stride_wn
        k = tl.arange(0, BLOCK_K)
        if PRELOAD:
            w, w_up = _weight_tiles(w_row, up_row, k, n_ok, K, SILU_MUL, W_EVICT)
        pdl.trigger(PDL and EARLY_TRIGGER)
        pdl.wait(PDL)
        if not PRELOAD:
            w, w_up = _weight_tiles(w_row, up_row, k, n_ok, K, SILU_MUL, W_EVICT)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        write_res = pid == 0
        acc, acc_up, sum_sq = _gemv_tile(
            acc, acc_up, sum_sq, w, w_up, k, x_ptr, res_ptr, res_out_ptr, norm_w_ptr, M, K,
            stride_xm, write_res, SILU_MUL, NORM, HAS_RES, BLOCK_M,
        )  # fmt: skip
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w, w_up = _weight_tiles(w_row, up_row, k, n_ok, K, SILU_MUL, W_EVICT)
            acc, acc_up, sum_sq = _gemv_tile(
                acc, acc_up, sum_sq, w, w_up, k, x_ptr, res_ptr, res_out_ptr, norm_w_ptr, M, K,
                stride_xm, write_res, SILU_MUL, NORM, HAS_RES, BLOCK_M,
            )  # fmt: skip
        pdl.trigger(PDL and not EARLY_TRIGGER)
        if NORM:
            rstd = tl.rsqrt(sum_sq / K + eps)[:, None]
            acc = acc * rstd
            acc_up = acc_up * rstd
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if SILU_MUL:
                acc_up += tl.load(b_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        rows = tl.arange(0, BLOCK_M)
        y = y_ptr + rows[:, None] * stride_ym + n[None, :]
        out = acc.to(y_ptr.dtype.element_ty)
        tl.store(y, out, mask=(rows < M)[:, None] & n_ok[None, :])
        if ARGMAX:
            argmax_epilogue(keys_ptr, out, rows, n, M, n_ok)

    @triton.jit
    def argmax_epilogue(
        # [M] int64: each row's best key so far (KEY_EMPTY before the kernel)
        keys_ptr,
        # [BLOCK_M, BLOCK_N]: this program's outputs as stored (model dtype)
        out,
        rows,
        n,
        M,
        n_ok,
    ):
        """Fold this program's columns into each row's greedy key: (value, column) packed in an
        int64 whose signed order is the value's, then the lower column (ties go to the first
        index, as torch.argmax; NaN counts as +inf, as ops.argmax). The key is read first and
        only a better one is written (an atomic max): of the tens of thousands of lm_head
        programs only a few a step find a new best, so they do not queue on one address."""
        v = out.to(tl.float32)
        v = tl.where(v != v, float("inf"), v)
        bits = v.to(tl.int32, bitcast=True)
        # Negative floats order by their magnitude backwards: flip it. -0.0 is +0.0.
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        key = tl.where(v == 0.0, 0, key)
        # (KEY_COLUMNS and KEY_EMPTY as literals: the interpreter keeps constexpr arithmetic
        # with a tensor a constexpr.)
        packed = (key.to(tl.int64) << 32) | (2147483647 - n.to(tl.int64))[None, :]
        ok = (rows < M)[:, None] & n_ok[None, :]
        best = tl.max(tl.where(ok, packed, -9223372036854775807 - 1), axis=1)
        r_ok = rows < M
        cur = tl.load(keys_ptr + rows, mask=r_ok, other=0, volatile=True)
        tl.atomic_max(keys_ptr + rows, best, mask=r_ok & (best > cur), sem="relaxed")


# (BLOCK_N, BLOCK_K, num_warps, num_stages); benchmarks/gemv.py sweeps CONFIGS on the GPU.
CONFIGS = [
    (4, 512, 4, 4),  # twice the programs of (8, ...): small N (o, down) fill more SMs
    (8, 512, 4, 4),
    (8, 1024, 4, 3),
    (16, 256, 4, 4),
    (16, 512, 4, 3),
    (16, 512, 8, 4),
    (32, 256, 8, 3),
    (32, 128, 4, 4),
    (4, 2048, 4, 2),  # one K tile of a 2048-deep row, loaded before the PDL wait (gemv_plan)
    (8, 2048, 4, 2),
    (2, 4096, 4, 1),  # a whole 4096-deep row
    (4, 4096, 8, 1),  # the same, half the programs (all resident: gemv_plan)
    (2, 8192, 8, 1),  # a whole row up to 8192 deep (GLM-4.7-Flash's 5120-deep o)
]
DEFAULT_CONFIG = (16, 512, 4, 3)
Config = tuple[int, int, int, int]


def gemv(
    # [M, K], M <= MAX_M, last dim contiguous
    x: torch.Tensor,
    # [N, K], last dim contiguous
    w: torch.Tensor,
    # [N] or None
    b: torch.Tensor | None = None,
    config: tuple[int, int, int, int] = DEFAULT_CONFIG,
    silu_mul: bool = False,
    early_trigger: bool = False,
    # [>= M] int64 or None: also fold each row's greedy token into these keys (each KEY_EMPTY
    # before the call; ops/greedy_head.py reads and resets them)
    argmax_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ w.T (+ b) for decode-sized M, with the Triton kernel (semantics: `gemv_ref`);
    `silu_mul`: [M, N/2] = silu(gate) * up of that product (semantics: `gemv_silu_mul_ref`).
    A fixed launch config, not autotuning: graph capture and the interpreter both need one."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return _launch(x, w, b, config, silu_mul, None, early_trigger, argmax_keys)


def gemv_norm(
    # [M, K], M <= MAX_M: the hidden state before the norm
    x: torch.Tensor,
    # [N, K] (gate_up's [2N, K] with silu_mul)
    w: torch.Tensor,
    # [N] or None
    b: torch.Tensor | None,
    # [K]: the RMSNorm weight
    norm_weight: torch.Tensor,
    eps: float,
    # [M, K] or None (the first layer)
    residual: torch.Tensor | None,
    config: tuple[int, int, int, int] = DEFAULT_CONFIG,
    silu_mul: bool = False,
    early_trigger: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemv(rms_norm(x + residual)), x + residual) in one kernel (semantics:
    `gemv_norm_ref`); without a residual the second is x itself."""
    x, residual, res_out = skinny.norm_operands(x, residual)
    norm = (residual, res_out, norm_weight, eps)
    y = _launch(x, w, b, config, silu_mul, norm, early_trigger)
    return y, res_out


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    config: Config,
    silu_mul: bool,
    # (residual or None, residual out, norm weight, eps), or None: no norm
    norm: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float] | None,
    # the successor may launch at this kernel's start (DecodeLinear.early_trigger)
    early_trigger: bool = False,
    argmax_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0] // 2 if silu_mul else w.shape[0]
    if M > MAX_M or w.shape[1] != K or (silu_mul and w.shape[0] % 2):
        raise ValueError(
            f"gemv takes [M <= {MAX_M}, K] x [N, K]; got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    if argmax_keys is not None and (
        silu_mul or argmax_keys.dtype != torch.int64 or argmax_keys.shape[0] < M
    ):
        raise ValueError("gemv's argmax keys: int64, one a row, without silu_mul")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    res, res_out, norm_w, eps = norm if norm is not None else (None, x, w, 0.0)
    block_n, block_k, num_warps, num_stages = config
    kw = pdl.launch_kwargs(x.device)
    launcher(_gemv_kernel, (triton.cdiv(N, block_n),))(
        x,
        w,
        b if b is not None else w,
        y,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        res if res is not None else x,
        res_out,
        norm_w,
        eps,
        argmax_keys if argmax_keys is not None else x,
        HAS_BIAS=b is not None,
        SILU_MUL=silu_mul,
        NORM=norm is not None,
        HAS_RES=res is not None,
        BLOCK_M=triton.next_power_of_2(M),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        # Both only mean something under PDL (they are the overlap it buys).
        EARLY_TRIGGER=kw["PDL"] and early_trigger,
        PRELOAD=kw["PDL"],
        W_EVICT=l2.weight_eviction(),
        ARGMAX=argmax_keys is not None,
        **kw,
    )
    return y


# Decode row counts a plan is made for: the M <= 8 gemv's buckets, then the skinny matmul's row
# tiles (ops/skinny.py) up to 64 rows: verification batches are B x (K + 1) rows.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# A plan entry: a gemv launch config, a skinny-matmul config, or None (F.linear, cuBLAS).
PlanConfig = Config | skinny.SkinnyConfig | None


def bucket(m: int) -> int:
    """The plan entry a call with `m` rows uses: the smallest bucket holding it."""
    return next(b for b in BUCKETS if b >= m)


def plan_rows(m: int) -> int:
    """The rows a decode call of `m` rows is planned for: `graph_rows.row_bound(m)`, the rows
    of the captured graph the batch replays (or would replay), so an eager step and its graph
    take the same bucket: at 1 + K = 3 a batch of 5 has 15 rows (bucket 16) and its graph of 8
    has 24 (bucket 32), and the two kernels round differently."""
    return graph_rows.row_bound(m)


def default_plan(config: Config | None) -> dict[int, PlanConfig]:
    """`config` (the gemv's) for up to MAX_M rows, the skinny matmul's default above (None:
    cuBLAS everywhere)."""
    return {
        b: None if config is None else config if b <= MAX_M else skinny.DEFAULT_CONFIG
        for b in BUCKETS
    }


def planned_matmul(
    # [M, K]
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    cfg: Config | skinny.SkinnyConfig,
    silu_mul: bool = False,
    # the skinny matmul's split counters (DecodeLinear.counters) or None
    counters: torch.Tensor | None = None,
    early_trigger: bool = False,
) -> torch.Tensor:
    """gemv or skinny_matmul, whichever `cfg` is a launch config of (`early_trigger`: the
    gemv's)."""
    if isinstance(cfg, skinny.SkinnyConfig):
        return skinny.skinny_matmul(x, w, b, cfg, silu_mul, counters)
    return gemv(x, w, b, config=cfg, silu_mul=silu_mul, early_trigger=early_trigger)


def planned_matmul_norm(
    # [M, K]: the hidden state before the norm
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    # [M, K] or None
    residual: torch.Tensor | None,
    cfg: Config | skinny.SkinnyConfig,
    silu_mul: bool = False,
    counters: torch.Tensor | None = None,
    early_trigger: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv_norm or skinny_norm, whichever `cfg` is a launch config of (`early_trigger`: the
    gemv's)."""
    if isinstance(cfg, skinny.SkinnyConfig):
        return skinny.skinny_norm(x, w, b, norm_weight, eps, residual, cfg, silu_mul, counters)
    return gemv_norm(x, w, b, norm_weight, eps, residual, cfg, silu_mul, early_trigger)


class DecodeLinear(nn.Linear):
    """nn.Linear whose decode-sized calls (at most skinny.MAX_M rows, 16-bit, CUDA, no autograd)
    run the Triton gemv (<= 8 rows) or skinny matmul where its plan says so; everything else
    (prefill, training, CPU, rows the plan gives to cuBLAS) stays F.linear."""

    # row bucket -> Triton launch config, or None for F.linear (cuBLAS)
    plan: dict[int, PlanConfig]
    # gate_up_proj of an MLP only: the same for the fused gate_up + SiLU-and-mul kernel
    # (None: F.linear, then the SiLU-and-mul kernel)
    silu_plan: dict[int, PlanConfig]
    # The skinny matmul's split arrival counters (zero between launches), one buffer per layer:
    # its captured graphs hold the address, and it goes with the layer.
    counters: torch.Tensor | None
    # The model feeds this layer through norm_linear (models/layers.feeds_from_norm): the plan
    # times the norm-fused kernels for it.
    norm_fed: bool = False
    # An MLP's gate_up with a SiLU activation (models/layers.MLP): only its SiLU plan is made
    # (the plan times it with the fused SiLU-and-mul epilogue).
    silu_gate_up: bool = False
    # The gemv lets the next kernel launch at its start (pdl.early_kv: the attention this layer
    # feeds loads its first key tile meanwhile).
    early_trigger: bool = False

    @classmethod
    def sharing(cls, linear: nn.Linear, config: Config | None = DEFAULT_CONFIG) -> DecodeLinear:
        """A DecodeLinear over `linear`'s own Parameter objects (no copy), planned to `config`
        for up to MAX_M rows and the skinny default above (`default_plan`)."""
        new = sharing(cls, linear)  # its markers too (norm_fed ...; class defaults otherwise)
        new.plan = default_plan(config)
        new.silu_plan = default_plan(config)
        w = linear.weight
        # Column tiles of the narrowest skinny config (block_n 16), allocated outside any capture
        new.counters = (
            skinny.new_counters(w.device, triton.cdiv(w.shape[0], 16)) if w.is_cuda else None
        )
        return new

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether a call with input `x` may run a Triton kernel (judged on its rows as a
        captured graph runs them, `graph_rows.row_bound`: eager and graph choose alike)."""
        return (
            x.dim() == 2
            and graph_rows.row_bound(x.shape[0]) <= skinny.MAX_M
            and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16)
            and not torch.is_grad_enabled()
        )

    def config(self, x: torch.Tensor, silu_mul: bool = False) -> PlanConfig:
        """The Triton launch config for input `x`, or None: cuBLAS. The plan bucket is that of
        `plan_rows(x.shape[0])`, never the row count itself: an eager step and its padded graph
        must run the same kernel (`plan_rows` says why)."""
        if not self.takes(x):
            return None
        return (self.silu_plan if silu_mul else self.plan)[bucket(plan_rows(x.shape[0]))]

    def run(
        self, x: torch.Tensor, cfg: Config | skinny.SkinnyConfig, silu_mul: bool = False
    ) -> torch.Tensor:
        """This layer's product with `x` by the planned kernel `cfg` (silu_mul: gate_up's)."""
        w, b, counters = self.weight, self.bias, self.counters
        return planned_matmul(x, w, b, cfg, silu_mul, counters, self.early_trigger)

    def run_norm(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        cfg: Config | skinny.SkinnyConfig,
        silu_mul: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """planned_matmul_norm with this layer's weights."""
        w, b = self.weight, self.bias
        return planned_matmul_norm(
            x, w, b, norm_weight, eps, residual, cfg, silu_mul, self.counters, self.early_trigger
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config(x)
        if cfg is not None:
            return self.run(x, cfg)
        return super().forward(x)


def use_decode_gemv_(model: nn.Module, config: Config | None = DEFAULT_CONFIG) -> int:
    """Replace every plain nn.Linear child of `model` by a DecodeLinear holding the same
    parameters (tied weights stay tied), planned to `config` (`default_plan`); returns how
    many."""
    return replace_linears_(model, lambda child: DecodeLinear.sharing(child, config))
