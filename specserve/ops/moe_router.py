"""MoE routing: the expert choice of a router's logits, and for decode batches one kernel that
runs a layer's whole path from the attention output to the choice.

`select_experts_ref` is the routing arithmetic every MoE model uses (models/moe.py's Router),
after transformers' modeling_qwen3_moe.py / modeling_glm4_moe.py:
  softmax   weights, ids = topk(softmax(logits in float32), k); optionally renormalized over k.
  softmax_topk  gpt-oss: ids = the k best logits, weights = their softmax among themselves in
            float32 (transformers' GptOssTopKRouter; its logits carry the router's bias).
  sigmoid   s = sigmoid(logits) in float32; the choice ranks s + correction bias among the
            `topk_group` best of `n_group` groups (a group's score: the sum of its two best);
            the weights are the chosen s, optionally renormalized (+ 1e-20), times `scale`.
`n_shared` > 0 (models/moe.py's fused shared experts) appends experts E .. E + n_shared - 1
with weight 1.0 to every token's choice, after the k chosen: [T, k + n_shared].

`norm_route` = the post-attention RMSNorm (with the residual add), the router matmul and
`select_experts_ref`, returning what the experts need: (topk_weights, topk_ids, normed x, new
residual). At decode batch sizes on CUDA that is ONE Triton launch (`_norm_route_kernel`)
instead of a norm kernel, a cuBLAS gemv and four or five torch ops (softmax, topk, sum, div).
Each program computes the logits of BLOCK_E experts for every token (the norm recomputed per
program from x: T x H elements from L2, next to BLOCK_E x H weights); program 0 also writes the
normed x and the residual; the last program to finish (an acq_rel counter, reset by that
program, so a captured graph replays it) reads every logit and makes the choice, and writes
the appended shared experts' columns itself (no torch.cat launch on the decode path).

Latency, not bandwidth, is this kernel's cost (0.5 MB of router at Qwen3-30B-A3B): its time is
the chain of dependent memory round trips (a norm kernel, cuBLAS and torch took 10 us a layer
there). So:
- the router rows (weights: they never depend on the previous kernel) are requested before the
  PDL wait, a program's whole [BLOCK_E, H] slab in one go where it fits a tile (K_TILES = 1 at
  H = 2048), so they arrive during the previous kernel's tail;
- the K loops are unrolled (K_TILES constexpr), so no load waits on the previous tile's math;
- the choice ranks (score, expert) packed in an int64 (the weight decoded from the winning
  key) and takes the k best in one partial bitonic sort (tl.topk,
  `tunables().moe_route_topk_sort`): 5 barrier rounds at 128 experts on 4 warps. The fallback,
  where the k + n_shared tile exceeds the experts' row, is k rounds of ONE max reduction each
  over those keys: a round is a cross-warp reduction through shared memory and a barrier, and
  the rounds are serial. (A one-shot rank from an [E, E] comparison spills at E = 128 with 4
  warps.)
Tried and dropped (H100, batch-1 steps, `python benchmarks/timeline.py`; patches in
benchmarks/experiments/ at commit b3db210):
- the choosing program bulk-prefetching the first 0.5-2 MB of each chosen expert's gate and up
  rows into L2 before writing the choice. Busy time a step: Qwen3-30B-A3B 2966-2971 us (1 MB /
  2 MB) vs 2945 us, gpt-oss-20b 1781-1782 vs 1778-1780 us: the expert kernel's ramp is not idle
  HBM it can fill.
- fewer warps a program (reductions within a warp, no shared-memory rounds): (2, 2048, 2) and
  (2, 1024, 2) at Qwen3-30B-A3B 5.42 / 5.41 us a layer vs 5.39, (2, 1024, 2) and (2, 1024, 1)
  at gpt-oss-20b 4.17 us all three: the reductions are not where its time goes.
- the choice left to the MoE gate_up kernel, every program making its token's and column block
  0 writing it for down. Without the choice this kernel takes 2.3 us a layer instead of 5.4
  (Qwen3-30B-A3B; 2.3 vs 4.7 at GLM-4.7-Flash), but the choice in every gate_up program costs
  more: +3.5 us a layer with k rounds, +5.7 with a rank count (Qwen3 step 2841 -> 2857 / 2812
  -> 3005 us); GLM-4.7-Flash's 3840 gate_up programs, 24.5 -> 128 us. So the choice stays
  here, made shorter by the sort instead.
- one-warp launches at one token with the sort, (1, 1024, 1) 2789 us a step and (2, 512, 1)
  with every K tile's router rows before the PDL wait 2843 us, against 2760 with the sort alone
  (router 5.06 / 6.16 vs 4.42 us a layer, Qwen3-30B-A3B; the code is at commit 7c598c7).
- the MoE kernels polling a ready word this kernel's last program releases, instead of waiting
  for its grid: the polling programs slow everything beside them (Qwen3-30B-A3B step 2761 ->
  2992 us, router 4.4 -> 7.6 us a layer; GLM-4.7-Flash 3301 -> 4290 us).

Ties among experts: the kernel takes the lowest expert index first (torch.topk does not promise
an order among equal values); the choice is otherwise the reference's, the weights equal up to
float32 summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.ops import graph_rows, pdl
from specserve.ops.fused import _use_triton, rms_norm_ref
from specserve.tunables import tunables

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference only
    triton = None

ROUTE_MAX_TOKENS = 8  # decode batches; larger ones run the norm kernel, cuBLAS and torch
ROUTE_MAX_EXPERTS = 512  # the choice reads all of a token's logits in one tile
# (BLOCK_E experts a program, BLOCK_K, num_warps): 128 experts -> 64 programs, each with its
# two router rows (8 KB at H = 2048, bf16) in one tile requested before the PDL wait.
ROUTE_CONFIG = (2, 2048, 4)
# What benchmarks/moe.py --route-sweep times at the real router shapes (one compile each).
ROUTE_CONFIGS: tuple[tuple[int, int, int], ...] = (
    (2, 2048, 4),
    (2, 1024, 4),
    (4, 2048, 4),
    (4, 1024, 4),
    (8, 1024, 8),
)
# The k best in one partial bitonic sort (tl.topk) instead of k rounds of one max reduction
# each (`tunables().moe_route_topk_sort`); sm_90 at 128 experts on 4 warps: 5 barrier rounds
# against 23. Ties still go to the lower id (the id, inverted, is the key's low bits). Measured
# (H100, batch-1 step): Qwen3-30B-A3B 2760 / 2760 us vs 2805 / 2806 (router 4.42 vs 5.35 us a
# layer), GLM-4.7-Flash 3317 / 3303 vs 3334 / 3337 (4.05 vs 4.70). Off: the k rounds, which the
# kernel also takes where next_power_of_2(top_k + n_shared) > the experts' row (tl.topk's k).
# Renormalized softmax routers (Qwen3-MoE) take the softmax_topk path
# (`tunables().moe_route_softmax_topk`): the k best logits, then their softmax among
# themselves, which equals the full softmax's k best renormalized up to float32 rounding (ties
# aside: exp may round two close logits to one probability, where torch.topk promises no order
# either). The choosing program skips the full softmax's max and sum reductions: sm_90 barrier
# rounds after its atomic 13 -> 7 at Qwen3-30B-A3B batch 1 (tests/test_moe_router.py).
# Measured (H100, batch-1 step): Qwen3-30B-A3B 2750 / 2748 us vs 2762 / 2764 (router 4.15 vs
# 4.44 us a layer); EAGLE-3 K=3 4.91 vs 4.94 ms. Off: the full softmax, then the k best
# renormalized.
SCORINGS = ("softmax", "sigmoid", "softmax_topk")


def select_experts_ref(
    # [num_tokens, num_experts], any float dtype
    logits: torch.Tensor,
    # [num_experts] float32 or None (sigmoid routers' e_score_correction_bias)
    correction_bias: torch.Tensor | None,
    *,
    scoring: str,
    top_k: int,
    renormalize: bool,
    scale: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    n_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, k + n_shared], topk_ids int64 [T, k + n_shared]): the k
    chosen, then experts E.. with weight 1.0 (not scaled)."""
    if scoring == "softmax":
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(top_k, dim=-1)
    elif scoring == "softmax_topk":
        best, ids = logits.topk(top_k, dim=-1)
        weights = best.softmax(dim=-1, dtype=torch.float32)
    elif scoring == "sigmoid":
        scores = logits.float().sigmoid()
        ids = _grouped_choice(scores, correction_bias, top_k, n_group, topk_group)
        weights = scores.gather(1, ids)
    else:
        raise ValueError(f"routing scoring must be one of {SCORINGS}, got {scoring!r}")
    if renormalize:
        # NOTE: 1e-20 as transformers' sigmoid router (softmax weights never sum to 0).
        eps = 1e-20 if scoring == "sigmoid" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if scale != 1.0:
        weights = weights * scale
    if n_shared:
        T, E = logits.shape
        shared = torch.arange(E, E + n_shared, device=ids.device).expand(T, n_shared)
        ids = torch.cat([ids, shared], dim=1)
        weights = torch.cat([weights, weights.new_ones(T, n_shared)], dim=1)
    return weights, ids


def _grouped_choice(
    # [num_tokens, num_experts] float32
    scores: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
) -> torch.Tensor:
    choice = scores if correction_bias is None else scores + correction_bias
    num_experts = scores.shape[-1]
    if topk_group < n_group:
        per_group = choice.view(-1, n_group, num_experts // n_group)
        group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep[:, :, None].expand_as(per_group).reshape(-1, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    return choice.topk(top_k, dim=-1, sorted=False)[1]


def norm_route_ref(
    # [T, H]: the attention output
    x: torch.Tensor,
    # [T, H] or None
    residual: torch.Tensor | None,
    # [H]
    norm_weight: torch.Tensor,
    eps: float,
    # [E, H]
    router_weight: torch.Tensor,
    # [E] float32 or None
    correction_bias: torch.Tensor | None,
    # [E] or None: gpt-oss's router bias, added to the logits
    router_bias: torch.Tensor | None = None,
    **routing: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids, rms_norm(x + residual), x + residual): the norm as
    ops.rms_norm, logits as the Router's F.linear (softmax routers in the weight's dtype,
    sigmoid routers in float32), the choice as `select_experts_ref` (`routing`: its keywords)."""
    normed, new_res = rms_norm_ref(x, norm_weight, eps, residual)
    new_res = x if new_res is None else new_res
    if routing["scoring"] == "sigmoid":
        bias = None if router_bias is None else router_bias.float()
        logits = F.linear(normed.float(), router_weight.float(), bias)
    else:
        logits = F.linear(normed, router_weight, router_bias)
    weights, ids = select_experts_ref(logits, correction_bias, **routing)  # type: ignore[arg-type]
    return weights, ids, normed, new_res


def fusable(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    scoring: str,
    n_group: int,
    topk_group: int,
) -> bool:
    """Whether `norm_route` runs the Triton kernel for input `x`."""
    E = router_weight.shape[0]
    grouped = topk_group < n_group
    return (
        triton is not None
        and _use_triton(x)
        and x.dim() == 2
        # Judged on the rows a captured graph runs (graph_rows): eager and graph alike.
        and 0 < x.shape[0]
        and graph_rows.row_bound(x.shape[0]) <= ROUTE_MAX_TOKENS
        and scoring in SCORINGS
        and E <= ROUTE_MAX_EXPERTS
        # The in-kernel group choice views the logits as [n_group, E / n_group] tiles.
        and (not grouped or (E & (E - 1) == 0 and n_group & (n_group - 1) == 0))
    )


def norm_route(
    # [T, H]: the attention output
    x: torch.Tensor,
    # [T, H] or None
    residual: torch.Tensor | None,
    # [H]
    norm_weight: torch.Tensor,
    eps: float,
    # [E, H]
    router_weight: torch.Tensor,
    # [E] float32 or None
    correction_bias: torch.Tensor | None,
    # [1] int32, zero: the kernel's completion counter (reset by the kernel)
    counter: torch.Tensor,
    # [E] or None: the router's bias (gpt-oss)
    router_bias: torch.Tensor | None = None,
    *,
    scoring: str,
    top_k: int,
    renormalize: bool,
    scale: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    n_shared: int = 0,
    config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`norm_route_ref`, in one Triton launch where `fusable`."""
    routing = dict(scoring=scoring, top_k=top_k, renormalize=renormalize, scale=scale)
    routing.update(n_group=n_group, topk_group=topk_group, n_shared=n_shared)
    args = (x, residual, norm_weight, eps, router_weight, correction_bias)
    if not fusable(x, router_weight, scoring, n_group, topk_group):
        return norm_route_ref(*args, router_bias, **routing)
    return norm_route_triton(*args, counter, config, router_bias=router_bias, **routing)


if triton is not None:

    @triton.jit
    def _normed_row(
        x_ptr, res_ptr, res_out_ptr, normed_ptr, g, k, k_ok, rstd, STORE, HAS_RES: tl.constexpr
    ):
        """rms_norm of one token's columns k, rounded as the norm kernel (float32 out); STORE:
        also write it and the residual sum (program 0)."""
        h = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + k, mask=k_ok, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            if STORE:
                tl.store(res_out_ptr + k, h, mask=k_ok)
        y = (h.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (g * y).to(normed_ptr.dtype.element_ty)
        if STORE:
            tl.store(normed_ptr + k, y, mask=k_ok)
        return y.to(tl.float32)

    @triton.jit
    def _top2_sum(c, j, GROUP: tl.constexpr):
        """[BLOCK_T, N_GROUP]: the sum of each group's two best (its best alone if GROUP 1)."""
        best = tl.max(c, axis=2)
        if GROUP == 1:
            return best
        first = tl.min(tl.where(c == best[:, :, None], j[None, None, :], GROUP), axis=2)
        rest = tl.where(j[None, None, :] == first[:, :, None], float("-inf"), c)
        return best + tl.max(rest, axis=2)

    @triton.jit
    def _scores(
        s, bias_ptr, e, E, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, TOPK_SOFTMAX: tl.constexpr
    ):
        """(val, choice) of float32 logits s [BLOCK_T, BLOCK_ALL_E] (-inf past E): the routing
        weights' source (softmax / sigmoid / the logits themselves for softmax_topk, whose
        softmax comes after the choice) and what the choice ranks (+ correction bias)."""
        if SIGMOID:
            val = 1.0 / (1.0 + tl.exp(-s))
            choice = val
            if HAS_BIAS:
                choice += tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :]
        elif TOPK_SOFTMAX:
            val = s
            choice = s
        else:
            p = tl.exp(s - tl.max(s, axis=1)[:, None])
            val = p / tl.sum(p, axis=1)[:, None]
            choice = val
        return val, choice

    @triton.jit
    def _choose(
        logits_ptr,
        bias_ptr,
        topk_w_ptr,
        topk_ids_ptr,
        T,
        E,
        scale,
        SIGMOID: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        TOPK_SOFTMAX: tl.constexpr,
        RENORM: tl.constexpr,
        TOP_K: tl.constexpr,
        N_SHARED: tl.constexpr,
        N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_TOPK: tl.constexpr,
        BLOCK_ALL_E: tl.constexpr,
        TOPK_SORT: tl.constexpr = False,
    ):
        """The expert choice of every token from the float32 logits (select_experts_ref), then
        N_SHARED appended experts E.. at weight 1.0 (BLOCK_TOPK >= TOP_K + N_SHARED)."""
        t = tl.arange(0, BLOCK_T)
        e = tl.arange(0, BLOCK_ALL_E)
        ok = (t < T)[:, None] & (e < E)[None, :]
        # .cg: other programs wrote these; read them from L2, never a stale L1 line.
        s = tl.load(
            logits_ptr + t[:, None] * E + e[None, :], mask=ok, other=0.0, cache_modifier=".cg"
        )
        s = tl.where((e < E)[None, :], s, float("-inf"))
        val, choice = _scores(s, bias_ptr, e, E, SIGMOID, HAS_BIAS, TOPK_SOFTMAX)
        choice = tl.where(ok, choice, float("-inf"))
        if TOPK_GROUP < N_GROUP:
            GROUP: tl.constexpr = BLOCK_ALL_E // N_GROUP
            c3 = tl.reshape(choice, (BLOCK_T, N_GROUP, GROUP))
            gs = _top2_sum(c3, tl.arange(0, GROUP), GROUP)
            gi = tl.arange(0, N_GROUP)
            keep = tl.zeros([BLOCK_T, N_GROUP], dtype=tl.int32)
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.max(gs, axis=1)
                pick = tl.min(tl.where(gs == best[:, None], gi[None, :], N_GROUP), axis=1)
                hit = gi[None, :] == pick[:, None]
                keep = tl.where(hit, 1, keep)
                gs = tl.where(hit, float("-inf"), gs)
            keep3 = tl.broadcast_to(keep[:, :, None], (BLOCK_T, N_GROUP, GROUP))
            choice = tl.where(tl.reshape(keep3, (BLOCK_T, BLOCK_ALL_E)) != 0, choice, float("-inf"))
        # The k best, one max reduction a round: each score and its expert in one int64 key,
        # the score's float32 bits made order-preserving as a signed int, the id inverted so a
        # tie goes to the lower id. The chosen weight is the score itself (decoded from the
        # key) unless a correction bias separates the two (then a gather: a second reduction).
        bits = choice.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32
        key = key | (BLOCK_ALL_E - 1 - e)[None, :].to(tl.int64)
        kk = tl.arange(0, BLOCK_TOPK)
        if TOPK_SORT:
            # The BLOCK_TOPK best keys at once, sorted (a partial bitonic sort: 5 barrier
            # rounds at Qwen3-30B-A3B's 128 experts on 4 warps, against 23 for 8 rounds).
            top = tl.topk(key, BLOCK_TOPK, dim=1)
            ids = BLOCK_ALL_E - 1 - (top & 0xFFFFFFFF).to(tl.int32)
            if HAS_BIAS:
                weights = tl.gather(val, ids, axis=1)
            else:
                hi = (top >> 32).to(tl.int32)
                weights = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
            weights = tl.where(kk[None, :] < TOP_K, weights, 0.0)
            ids = tl.where(kk[None, :] < TOP_K, ids, 0)
        else:
            weights = tl.zeros([BLOCK_T, BLOCK_TOPK], dtype=tl.float32)
            ids = tl.zeros([BLOCK_T, BLOCK_TOPK], dtype=tl.int32)
            for j in tl.static_range(TOP_K):
                best = tl.max(key, axis=1)
                pick = BLOCK_ALL_E - 1 - (best & 0xFFFFFFFF).to(tl.int32)
                if HAS_BIAS:
                    w_j = tl.sum(tl.where(e[None, :] == pick[:, None], val, 0.0), axis=1)
                else:
                    hi = (best >> 32).to(tl.int32)
                    w_j = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
                weights = tl.where(kk[None, :] == j, w_j[:, None], weights)
                ids = tl.where(kk[None, :] == j, pick[:, None], ids)
                key = tl.where(key == best[:, None], -(2**63), key)
        if TOPK_SOFTMAX:  # the chosen logits softmaxed among themselves; the first is the max
            weights = tl.where((t < T)[:, None], weights, 0.0)  # padded rows: no 0 / 0
            first = tl.sum(tl.where(kk[None, :] == 0, weights, 0.0), axis=1)
            p = tl.where(kk[None, :] < TOP_K, tl.exp(weights - first[:, None]), 0.0)
            weights = p / tl.sum(p, axis=1)[:, None]
        if RENORM:
            total = tl.sum(weights, axis=1)[:, None]
            weights = weights / (total + (1e-20 if SIGMOID else 0.0))
        weights = weights * scale
        if N_SHARED > 0:  # the fused shared experts: every token, weight 1.0 (not scaled)
            shared = (kk >= TOP_K)[None, :]
            weights = tl.where(shared, 1.0, weights)
            ids = tl.where(shared, E + kk[None, :] - TOP_K, ids)
        out = t[:, None] * (TOP_K + N_SHARED) + kk[None, :]
        out_ok = (t < T)[:, None] & (kk < TOP_K + N_SHARED)[None, :]
        tl.store(topk_w_ptr + out, weights, mask=out_ok)
        tl.store(topk_ids_ptr + out, ids.to(tl.int64), mask=out_ok)

    @triton.jit
    def _x_row(x_ptr, res_ptr, k, k_ok, HAS_RES: tl.constexpr):
        """One token's x + res at columns k, rounded to the model dtype (the norm's input)."""
        h = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + k, mask=k_ok, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        return h.to(tl.float32)

    @triton.jit(do_not_specialize=["T"])
    def _norm_route_kernel(
        x_ptr,
        res_ptr,
        res_out_ptr,
        normed_ptr,
        norm_w_ptr,
        w_ptr,
        router_bias_ptr,
        bias_ptr,
        logits_ptr,
        counter_ptr,
        topk_w_ptr,
        topk_ids_ptr,
        T,
        E,
        H,
        stride_x,
        stride_r,
        stride_we,
        eps,
        scale,
        HAS_RES: tl.constexpr,
        SIGMOID: tl.constexpr,
        ROUND_LOGITS: tl.constexpr,
        HAS_ROUTER_BIAS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        TOPK_SOFTMAX: tl.constexpr,
        RENORM: tl.constexpr,
        TOP_K: tl.constexpr,
        N_SHARED: tl.constexpr,
        N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_TOPK: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_TILES: tl.constexpr,
        BLOCK_ALL_E: tl.constexpr,
        PDL: tl.constexpr,
        TOPK_SORT: tl.constexpr = False,
    ):
        # logits[t, e] = W[e] @ rms_norm(x[t] + res[t]) for this program's BLOCK_E experts.
        # normed / res_out rows are [T, H] contiguous (fresh outputs). H <= K_TILES * BLOCK_K.
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_T)
        e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = e < E
        w_rows = w_ptr + e.to(tl.int64)[:, None] * stride_we
        # The first weight tile (the whole slab when K_TILES == 1) before the wait: weights
        # never depend on the previous kernel, so they stream during its tail.
        k0 = tl.arange(0, BLOCK_K)
        w0 = tl.load(w_rows + k0[None, :], mask=e_ok[:, None] & (k0 < H)[None, :], other=0.0)
        if HAS_ROUTER_BIAS:
            r_bias = tl.load(router_bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
        pdl.start(PDL)
        # Pass 1: each token's sum of squares (x + res rounded to the model dtype first).
        sum_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
        for kt in tl.static_range(K_TILES):
            k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            for i in tl.static_range(BLOCK_T):
                hf = _x_row(x_ptr + i * stride_x, res_ptr + i * stride_r, k, (k < H) & (i < T),
                            HAS_RES)  # fmt: skip
                sum_sq += tl.where(rows == i, tl.sum(hf * hf, axis=0), 0.0)
        rstd = tl.rsqrt(sum_sq / H + eps)
        # Pass 2: the normed rows (program 0 stores them) against this program's weight rows.
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for kt in tl.static_range(K_TILES):
            k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = k < H
            if kt == 0:
                w = w0.to(tl.float32)
            else:
                w = tl.load(w_rows + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
                w = w.to(tl.float32)
            g = tl.load(norm_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            for i in tl.static_range(BLOCK_T):
                m = k_ok & (i < T)
                rstd_i = tl.sum(tl.where(rows == i, rstd, 0.0), axis=0)
                y = _normed_row(
                    x_ptr + i * stride_x, res_ptr + i * stride_r, res_out_ptr + i * H,
                    normed_ptr + i * H, g, k, m, rstd_i, pid == 0, HAS_RES,
                )  # fmt: skip
                acc += tl.where(rows[:, None] == i, tl.sum(w * y[None, :], axis=1)[None, :], 0.0)
        if HAS_ROUTER_BIAS:  # F.linear's bias, added before its one rounding
            acc += r_bias[None, :]
        if ROUND_LOGITS:  # softmax routers: F.linear's output, in the router weight's dtype
            acc = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
        out_ok = (rows < T)[:, None] & e_ok[None, :]
        tl.store(logits_ptr + rows[:, None] * E + e[None, :], acc, mask=out_ok)
        # The last program to get here makes the choice from every program's logits.
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            tl.store(counter_ptr, 0)
            _choose(
                logits_ptr, bias_ptr, topk_w_ptr, topk_ids_ptr, T, E, scale, SIGMOID, HAS_BIAS,
                TOPK_SOFTMAX, RENORM, TOP_K, N_SHARED, N_GROUP, TOPK_GROUP, BLOCK_T, BLOCK_TOPK,
                BLOCK_ALL_E, TOPK_SORT,
            )  # fmt: skip


def route_block_k(H: int, config: tuple[int, int, int]) -> int:
    """The K tile of a launch: the config's, or one tile over all of H where H would leave a
    partial second tile (gpt-oss's 2880 in 2048-wide tiles: the second tile's router rows
    would load after the PDL wait, and at 8 tokens the two tiles spill on sm_90)."""
    block_k = min(config[1], triton.next_power_of_2(H))
    return 2 * block_k if block_k < H < 2 * block_k else block_k


def route_warps(block_t: int, config: tuple[int, int, int]) -> int:
    """Warps of a launch for BLOCK_T tokens: at least 8 from 8 tokens on (with 4, the choice's
    [8, E] tiles spill at E = 128 on sm_90)."""
    return max(config[2], 8) if block_t > 4 else config[2]


def norm_route_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    counter: torch.Tensor,
    config: tuple[int, int, int] | None = None,
    *,
    router_bias: torch.Tensor | None = None,
    scoring: str,
    top_k: int,
    renormalize: bool,
    scale: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    n_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`norm_route_ref` as one launch (T <= ROUTE_MAX_TOKENS tokens)."""
    T, H = x.shape
    E = router_weight.shape[0]
    bad_bias = router_bias is not None and router_bias.shape != (E,)
    if router_weight.shape[1] != H or norm_weight.shape != (H,) or top_k > E or bad_bias:
        raise ValueError(
            f"norm_route takes x [T, H], norm [H], router [E, H], router bias [E], top_k <= E; "
            f"got {tuple(x.shape)}, {tuple(norm_weight.shape)}, {tuple(router_weight.shape)}, "
            f"{None if router_bias is None else tuple(router_bias.shape)}, {top_k}"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    router_weight = router_weight if router_weight.stride(-1) == 1 else router_weight.contiguous()
    dev = x.device
    normed = torch.empty(T, H, dtype=torch.promote_types(x.dtype, norm_weight.dtype), device=dev)
    res_out = torch.empty_like(x) if residual is not None else x
    logits = torch.empty(T, E, dtype=torch.float32, device=dev)
    topk_w = torch.empty(T, top_k + n_shared, dtype=torch.float32, device=dev)
    topk_ids = torch.empty(T, top_k + n_shared, dtype=torch.int64, device=dev)
    # The token tile of the rows a captured graph runs (graph_rows), when it fits the kernel.
    bound = graph_rows.row_bound(T)
    block_t = triton.next_power_of_2(bound if bound <= ROUTE_MAX_TOKENS else T)
    config = config or ROUTE_CONFIG  # read at call time: benchmarks switch it
    block_e = config[0]
    block_k = route_block_k(H, config)
    block_all_e = triton.next_power_of_2(E)
    sigmoid = scoring == "sigmoid"
    # A renormalized softmax's weights are the chosen logits' softmax among themselves (the
    # full softmax's denominator cancels), and its choice the k best logits (exp is monotone).
    as_topk = (
        tunables().moe_route_softmax_topk
        and scoring == "softmax"
        and renormalize
        and router_bias is None
    )
    _norm_route_kernel[(triton.cdiv(E, block_e),)](
        x,
        residual if residual is not None else x,
        res_out,
        normed,
        norm_weight,
        router_weight,
        router_bias if router_bias is not None else logits,
        correction_bias if correction_bias is not None else logits,
        logits,
        counter,
        topk_w,
        topk_ids,
        T,
        E,
        H,
        x.stride(0),
        residual.stride(0) if residual is not None else x.stride(0),
        router_weight.stride(0),
        eps,
        scale,
        HAS_RES=residual is not None,
        SIGMOID=sigmoid,
        ROUND_LOGITS=not sigmoid,
        HAS_ROUTER_BIAS=router_bias is not None,
        HAS_BIAS=sigmoid and correction_bias is not None,
        TOPK_SOFTMAX=as_topk or scoring == "softmax_topk",
        RENORM=renormalize and not as_topk,  # the k best's softmax sums to 1 already
        TOP_K=top_k,
        N_SHARED=n_shared,
        N_GROUP=n_group if topk_group < n_group else 1,
        TOPK_GROUP=topk_group if topk_group < n_group else 1,
        BLOCK_T=block_t,
        BLOCK_TOPK=triton.next_power_of_2(top_k + n_shared),
        BLOCK_E=block_e,
        BLOCK_K=block_k,
        K_TILES=triton.cdiv(H, block_k),
        BLOCK_ALL_E=block_all_e,
        num_warps=route_warps(block_t, config),
        # tl.topk takes at most the row: BLOCK_TOPK <= BLOCK_ALL_E
        TOPK_SORT=tunables().moe_route_topk_sort
        and triton.next_power_of_2(top_k + n_shared) <= block_all_e,
        **pdl.launch_kwargs(dev),
    )
    return topk_w, topk_ids, normed, res_out
