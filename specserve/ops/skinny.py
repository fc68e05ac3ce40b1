"""Skinny matmul for 2-64 rows (decode and verification batches: B requests x (K + 1) tokens).

y[M, N] = x[M, K] @ W[N, K]^T (+ b) with M <= 64 is a stream of weight reads, like the M <= 8
gemv (ops/gemv.py), but with enough rows that the tensor cores should do the multiply. Each
program owns BLOCK_N output columns and a K range: it multiplies the weight tile by x^T
(acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T, "swap AB": the weight's N goes in the MMA's large
dimension, the few rows in its small one), so every weight byte is read once, in long rows.

Split-K: N / BLOCK_N tiles alone leave SMs idle (4096 / 64 = 64 programs on 132 SMs), so each
tile's K is split over SPLIT_K programs. Each writes its fp32 partial to a workspace and counts
itself in on a per-tile arrival counter; the last to arrive sums the partials in split order
(deterministic: which program merges varies, what it computes does not; graph == eager bit for
bit), runs the epilogue and resets the counter (the buffer stays zero between launches and
graph replays). No second kernel. The best split count depends on the shape (Llama-3-8B at
2-16 rows: qkv 2, o and down 4, gate_up + SiLU 1): decode_matmul="auto" times several.

Epilogues as the gemv: bias, SiLU-and-mul (W is gate_up's [2N, K]: the [M, 2N] intermediate is
never written) and a prologue-free RMSNorm (+ residual add): W @ (x * g * rstd) = rstd * (W @
(x * g)), so the K loop feeds x * g (rounded to the weight dtype for the MMA) and accumulates
x^2 elementwise, summed per row once after the loop; the merge sums those too and scales by
rstd. The loop's only plain loads (the norm weight and residual tiles; the pipeliner copies
x^T and the weights ahead itself) are issued a K step before their use. PDL as the gemv: the
first weight tile is requested before waiting for the previous kernel, the successor is
triggered after the weight stream.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from specserve.ops import graph_rows, l2, pdl
from specserve.ops.jit import launcher

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference only
    triton = None

MAX_M = 64
# Row tiles: the MMA's small dimension is 16 at least; one tile holds every row, so the weight
# is read once whatever M is. A 128-row tile (batch-16 verification at K = 4: 80 rows) lost to
# cuBLAS on every Llama-3-8B shape (H100, benchmarks/RESULTS.md: best 1.5-2.1 TB/s vs 2.0-2.7,
# the norm-fed ones spilling): each program reads the whole [128, BLOCK_K] x^T tile per K step,
# as many bytes as its weight tile or more, so the activation's L2 traffic outgrows the weight
# stream; cuBLAS's wider tiles read it fewer times.
ROW_TILES = (16, 32, 64)


class SkinnyConfig(NamedTuple):
    """A launch config; split_k 0: enough splits for about two programs per SM."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


DEFAULT_CONFIG = SkinnyConfig(64, 128, 0, 4, 4)


def skinny_ref(
    # [M, K]
    x: torch.Tensor,
    # [N, K]
    w: torch.Tensor,
    # [N] or None
    b: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, N] = F.linear(x, w, b), accumulated in fp32, rounded once to x's dtype."""
    return torch.nn.functional.linear(
        x.float(), w.float(), b.float() if b is not None else None
    ).to(x.dtype)


def block_m(m: int) -> int:
    return next(t for t in ROW_TILES if t >= m)


@functools.cache
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SMs of `device`; 132 (an H100) off CUDA, where it only sizes the split."""
    return _num_sms(device.index) if device.type == "cuda" else 132


def resolve_split(cfg: SkinnyConfig, n: int, k: int, sms: int) -> tuple[int, int]:
    """(splits, K columns per split, a multiple of block_k) for `cfg` on an [n, k] weight (n:
    output columns). split_k 0 picks the fewest splits giving >= 2 programs per SM."""
    k_tiles = triton.cdiv(k, cfg.block_k)
    want = cfg.split_k or triton.cdiv(2 * sms, triton.cdiv(n, cfg.block_n))
    per = triton.cdiv(k_tiles, max(1, min(want, k_tiles)))
    return triton.cdiv(k_tiles, per), per * cfg.block_k


if triton is not None:

    @triton.jit
    def _weight_tiles(w_row, up_row, k, n_ok, k_end, SILU_MUL: tl.constexpr,
                      W_EVICT: tl.constexpr):  # fmt: skip
        """[BLOCK_N, BLOCK_K]: the weight tile at columns k (and the up tile), read once."""
        ok = n_ok[:, None] & (k < k_end)[None, :]
        w = tl.load(w_row + k[None, :], mask=ok, other=0.0, eviction_policy=W_EVICT)
        w_up = w
        if SILU_MUL:
            w_up = tl.load(up_row + k[None, :], mask=ok, other=0.0, eviction_policy=W_EVICT)
        return w, w_up

    @triton.jit
    def _norm_weight_tile(norm_w_ptr, k, k_end, NORM: tl.constexpr, BLOCK_M: tl.constexpr):
        """[BLOCK_K, BLOCK_M]: the RMSNorm weight at columns k, each repeated over the rows (x^T's
        layout: no conversion; as a [BLOCK_K] vector it crossed shared memory every K step), or
        0 without NORM. The kernel loads it a K step ahead of its use: a plain load in the loop
        (not one the pipeliner copies ahead) was an L2 round trip every step."""
        g = 0.0
        if NORM:
            rows = tl.arange(0, BLOCK_M)
            g_ptr = norm_w_ptr + k[:, None] + 0 * rows[None, :]
            g = tl.load(g_ptr, mask=(k < k_end)[:, None], other=0.0)
        return g

    @triton.jit
    def _residual_tile(res_ptr, k, k_end, M, stride_xm, HAS_RES: tl.constexpr,
                       BLOCK_M: tl.constexpr):  # fmt: skip
        """[BLOCK_K, BLOCK_M]: the residual rows' columns k, transposed as x^T, or 0 without
        HAS_RES. Loaded a K step ahead of its use, as `_norm_weight_tile`."""
        r = 0.0
        if HAS_RES:
            rows = tl.arange(0, BLOCK_M)
            ok = (k < k_end)[:, None] & (rows < M)[None, :]
            r = tl.load(res_ptr + rows[None, :] * stride_xm + k[:, None], mask=ok, other=0.0)
        return r

    @triton.jit
    def _skinny_tile(
        acc,
        acc_up,
        sum_sq,
        w,
        w_up,
        g,
        r,
        k,
        k_end,
        x_ptr,
        res_out_ptr,
        M,
        stride_xm,
        write_res,
        SILU_MUL: tl.constexpr,
        NORM: tl.constexpr,
        HAS_RES: tl.constexpr,
        BLOCK_M: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """acc[, acc_up] += tile @ x[:, k]^T (x times the norm weight tile g per NORM); sum_sq
        += x[:, k]^2 elementwise ([BLOCK_K, BLOCK_M]: the kernel sums it over K once, after the
        loop: a cross-warp sum every K step put barriers into the pipelined loop)."""
        rows = tl.arange(0, BLOCK_M)
        k_ok = k < k_end
        ok = k_ok[:, None] & (rows < M)[None, :]
        # [BLOCK_K, BLOCK_M]: x^T, from L2 (every program reads the same few rows)
        offs = rows[None, :] * stride_xm + k[:, None]
        xt = tl.load(x_ptr + offs, mask=ok, other=0.0)
        if HAS_RES:
            xt = (xt.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_out_ptr + offs, xt, mask=ok & write_res)
        if NORM:
            xf = xt.to(tl.float32)
            sum_sq += xf * xf
            xt = xf * g.to(tl.float32)
        xt = xt.to(w.dtype)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        if SILU_MUL:
            acc_up = tl.dot(w_up, xt, acc_up, input_precision=DOT_PRECISION)
        return acc, acc_up, sum_sq

    @triton.jit
    def _epilogue(
        acc,
        acc_up,
        sum_sq,
        n,
        n_ok,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_ym,
        eps,
        HAS_BIAS: tl.constexpr,
        SILU_MUL: tl.constexpr,
        NORM: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Norm scale, bias, SiLU-and-mul; store y[:, n] (acc is [BLOCK_N, BLOCK_M])."""
        rows = tl.arange(0, BLOCK_M)
        if NORM:
            rstd = tl.rsqrt(sum_sq / K + eps)[None, :]
            acc = acc * rstd
            acc_up = acc_up * rstd
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            if SILU_MUL:
                acc_up += tl.load(b_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        y = y_ptr + rows[None, :] * stride_ym + n[:, None]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rows < M)[None, :] & n_ok[:, None])

    @triton.jit
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        ws_ptr,
        ss_ptr,
        counter_ptr,
        res_ptr,
        res_out_ptr,
        norm_w_ptr,
        M,
        N,
        K,
        k_split,
        split_k,
        stride_xm,
        stride_wn,
        stride_ym,
        eps,
        HAS_BIAS: tl.constexpr,
        SILU_MUL: tl.constexpr,
        NORM: tl.constexpr,
        HAS_RES: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        PDL: tl.constexpr,
        PRELOAD: tl.constexpr,
        W_EVICT: tl.constexpr = "",
    ):
        # Program (pid_n, pid_k): columns pid_n * BLOCK_N.., K range pid_k * k_split.. (k_split
        # a multiple of BLOCK_K; every split non-empty). HAS_RES: x + res (rounded to the model
        # dtype, as the norm kernel) is x; the programs of column tile 0 write it to res_out,
        # each its own K range.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        w_row = w_ptr + n.to(tl.int64)[:, None] * stride_wn
        up_row = w_row + N * stride_wn
        k_start = pid_k * k_split
        k_end = tl.minimum(K, k_start + k_split)
        k = k_start + tl.arange(0, BLOCK_K)
        if PRELOAD:  # weights never depend on the previous kernel
            w, w_up = _weight_tiles(w_row, up_row, k, n_ok, k_end, SILU_MUL, W_EVICT)
        g = _norm_weight_tile(norm_w_ptr, k, k_end, NORM, BLOCK_M)  # a constant too
        pdl.wait(PDL)
        r = _residual_tile(res_ptr, k, k_end, M, stride_xm, HAS_RES, BLOCK_M)
        if not PRELOAD:
            w, w_up = _weight_tiles(w_row, up_row, k, n_ok, k_end, SILU_MUL, W_EVICT)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        sum_sq = tl.zeros([BLOCK_K if NORM else 1, BLOCK_M], dtype=tl.float32)
        write_res = pid_n == 0
        acc, acc_up, sum_sq = _skinny_tile(
            acc, acc_up, sum_sq, w, w_up, g, r, k, k_end, x_ptr, res_out_ptr, M, stride_xm,
            write_res, SILU_MUL, NORM, HAS_RES, BLOCK_M, DOT_PRECISION,
        )  # fmt: skip
        # The norm weight and residual tiles a K step ahead (the pipeliner copies only x^T and
        # the weights ahead; these were an L2 round trip every step).
        g = _norm_weight_tile(norm_w_ptr, k + BLOCK_K, k_end, NORM, BLOCK_M)
        r = _residual_tile(res_ptr, k + BLOCK_K, k_end, M, stride_xm, HAS_RES, BLOCK_M)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w, w_up = _weight_tiles(w_row, up_row, k, n_ok, k_end, SILU_MUL, W_EVICT)
            g_next = _norm_weight_tile(norm_w_ptr, k + BLOCK_K, k_end, NORM, BLOCK_M)
            r_next = _residual_tile(res_ptr, k + BLOCK_K, k_end, M, stride_xm, HAS_RES, BLOCK_M)
            acc, acc_up, sum_sq = _skinny_tile(
                acc, acc_up, sum_sq, w, w_up, g, r, k, k_end, x_ptr, res_out_ptr, M, stride_xm,
                write_res, SILU_MUL, NORM, HAS_RES, BLOCK_M, DOT_PRECISION,
            )  # fmt: skip
            g, r = g_next, r_next
        sum_sq = tl.sum(sum_sq, axis=0)  # [BLOCK_M]: this program's K range
        # After the weight stream: the successor takes no SM slots from this grid's later waves.
        pdl.trigger(PDL)
        if split_k == 1:
            _epilogue(
                acc, acc_up, sum_sq, n, n_ok, b_ptr, y_ptr, M, N, K, stride_ym, eps, HAS_BIAS,
                SILU_MUL, NORM, BLOCK_M,
            )  # fmt: skip
        else:
            # Partials of tile pid_n: [split_k, (gate, up), BLOCK_N, BLOCK_M] fp32, and
            # [split_k, BLOCK_M] sums of squares. The barrier orders all threads' stores before
            # the counter's release; the acquire makes the other splits' partials visible, read
            # from L2 (.cg).
            TILE: tl.constexpr = BLOCK_N * BLOCK_M * (2 if SILU_MUL else 1)
            tile = ws_ptr + pid_n.to(tl.int64) * split_k * TILE
            offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            tl.store(tile + pid_k * TILE + offs, acc)
            if SILU_MUL:
                tl.store(tile + pid_k * TILE + BLOCK_N * BLOCK_M + offs, acc_up)
            ss = ss_ptr + pid_n * split_k * BLOCK_M + tl.arange(0, BLOCK_M)
            if NORM:
                tl.store(ss + pid_k * BLOCK_M, sum_sq)
            tl.debug_barrier()
            counter = counter_ptr + pid_n
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == split_k - 1:
                tl.store(counter, 0)
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
                for s in range(0, split_k):
                    acc += tl.load(tile + s * TILE + offs, cache_modifier=".cg")
                    if SILU_MUL:
                        part = tile + s * TILE + BLOCK_N * BLOCK_M + offs
                        acc_up += tl.load(part, cache_modifier=".cg")
                    if NORM:
                        sum_sq += tl.load(ss + s * BLOCK_M, cache_modifier=".cg")
                _epilogue(
                    acc, acc_up, sum_sq, n, n_ok, b_ptr, y_ptr, M, N, K, stride_ym, eps,
                    HAS_BIAS, SILU_MUL, NORM, BLOCK_M,
                )  # fmt: skip


# Launch configs benchmarks/skinny.py sweeps and the start-up plan draws its candidates from.
CONFIGS: tuple[SkinnyConfig, ...] = (
    SkinnyConfig(64, 128, 0, 4, 4),
    SkinnyConfig(64, 256, 0, 4, 3),
    SkinnyConfig(32, 256, 0, 4, 4),
    SkinnyConfig(128, 128, 0, 8, 3),
    SkinnyConfig(64, 128, 1, 4, 4),
    SkinnyConfig(32, 128, 0, 4, 6),
)


# Shared memory a block may take on sm_90 (228 KiB less 1 KiB reserved).
SMEM_LIMIT = 232448


def num_stages(cfg: SkinnyConfig, bm: int, silu_mul: bool, elt: int = 2) -> int:
    """cfg.num_stages, fewer where the pipelined tiles (weight, up, x^T) would not fit in shared
    memory. Triton 3.6 on sm_90 allocates num_stages + 1 buffers for the wgmma path (block_n >=
    64; num_stages - 1 below): (64, 256) tiles with SiLU at 64 rows, 96 KiB a stage, get 1."""
    stage = (cfg.block_n * (2 if silu_mul else 1) + bm) * cfg.block_k * elt
    return max(1, min(cfg.num_stages, SMEM_LIMIT // stage - 1))


def new_counters(device: torch.device, n: int = 8192) -> torch.Tensor:
    """Split arrival counters: zero, and left zero by the kernel. Allocate outside graph capture
    and keep them as long as the graphs that use them (DecodeLinear holds its own)."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def skinny_matmul(
    # [M, K], M <= MAX_M, last dim contiguous
    x: torch.Tensor,
    # [N, K] ([2N, K] with silu_mul), last dim contiguous
    w: torch.Tensor,
    # [N] ([2N]) or None
    b: torch.Tensor | None = None,
    config: SkinnyConfig = DEFAULT_CONFIG,
    silu_mul: bool = False,
    # [>= N / block_n] int32 zeros (new_counters), or None: a fresh buffer
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ w.T (+ b) for 2-64 rows (semantics: `skinny_ref`, F.linear); `silu_mul`:
    [M, N] = silu(gate) * up (semantics: gemv_silu_mul_ref)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return _launch(x, w, b, config, silu_mul, None, counters)


def norm_operands(
    # [M, K]: the hidden state before the norm
    x: torch.Tensor,
    # [M, K] or None
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(x, residual, the new residual's buffer) as the norm-fused kernels (skinny_norm,
    gemv.gemv_norm) take them. With a residual, x, it and the sum written back share one row
    stride (stride_xm); without, x may be a view of rows with a longer stride (MLA's q_in:
    fused_qkv_a_proj's first columns), read in place, and is itself the new residual."""
    if residual is not None:
        x, residual = x.contiguous(), residual.contiguous()
        return x, residual, torch.empty_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x, None, x


def skinny_norm(
    # [M, K]: the hidden state before the norm
    x: torch.Tensor,
    # [N, K] ([2N, K] with silu_mul)
    w: torch.Tensor,
    b: torch.Tensor | None,
    # [K]
    norm_weight: torch.Tensor,
    eps: float,
    # [M, K] or None
    residual: torch.Tensor | None,
    config: SkinnyConfig = DEFAULT_CONFIG,
    silu_mul: bool = False,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(skinny_matmul(rms_norm(x + residual)), x + residual) in one kernel (semantics:
    gemv_norm_ref, up to x * g rounded to the weight dtype before the MMA)."""
    x, residual, res_out = norm_operands(x, residual)
    y = _launch(x, w, b, config, silu_mul, (residual, res_out, norm_weight, eps), counters)
    return y, res_out


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    cfg: SkinnyConfig,
    silu_mul: bool,
    norm: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float] | None,
    counters: torch.Tensor | None,
) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0] // 2 if silu_mul else w.shape[0]
    if M > MAX_M or w.shape[1] != K or (silu_mul and w.shape[0] % 2) or w.stride(-1) != 1:
        raise ValueError(
            f"skinny_matmul takes [M <= {MAX_M}, K] x [N, K]; got {tuple(x.shape)}, "
            f"{tuple(w.shape)}"
        )
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    # The row tile of the rows a captured graph runs (graph_rows): eager and graph alike.
    bm = block_m(min(graph_rows.row_bound(M), MAX_M))
    n_tiles = triton.cdiv(N, cfg.block_n)
    splits, k_split = resolve_split(cfg, N, K, num_sms(x.device))
    if splits > 1:
        ws = torch.empty(
            n_tiles * splits * cfg.block_n * bm * (2 if silu_mul else 1),
            dtype=torch.float32,
            device=x.device,
        )
        ss = torch.empty(n_tiles * splits * bm, dtype=torch.float32, device=x.device)
        if counters is None or counters.numel() < n_tiles:
            counters = new_counters(x.device, n_tiles)
    else:
        ws = ss = counters = y  # unused
    res, res_out, norm_w, eps = norm if norm is not None else (None, x, w, 0.0)
    kw = pdl.launch_kwargs(x.device)
    launcher(_skinny_kernel, (n_tiles, splits))(
        x,
        w,
        b if b is not None else w,
        y,
        ws,
        ss,
        counters,
        res if res is not None else x,
        res_out,
        norm_w,
        M,
        N,
        K,
        k_split,
        splits,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        eps,
        HAS_BIAS=b is not None,
        SILU_MUL=silu_mul,
        NORM=norm is not None,
        HAS_RES=res is not None,
        BLOCK_M=bm,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=num_stages(cfg, bm, silu_mul, x.element_size()),
        PRELOAD=kw["PDL"],
        W_EVICT=l2.weight_eviction(),
        **kw,
    )
    return y
