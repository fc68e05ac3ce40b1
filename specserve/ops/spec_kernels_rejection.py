"""Verification (`rejection_sample`, strict and probabilistic) as Triton kernels over all requests
at once (CUDA; the torch reference is `rejection_sample_ref` in sample/rejection.py).

Four launches (two for all-greedy batches), each split over the vocabulary so that one request
still spreads over the whole GPU; R = B * (K + 1) slot rows, S vocabulary splits of BLOCK_V:
  1. _slot_stats_kernel    grid (R, S): per split of every slot row, the argmax of the raw logits
                           and, for sampled batches, max and sum(exp(x - max)) of the processed
                           logits (temperature applied here when it is the only processing).
  2. _accept_kernel        grid (B,): combines the splits; greedy rows accept while the draft is
                           the argmax, sampled rows while u * q(d) < p(d); writes the accepted
                           drafts, the argmax as recovered / bonus token, -1 after, num_accepted.
  3. _final_sample_kernel  grid (B, S), sampled batches: Gumbel-max over each split of the final
                           slot: norm(max(p - q, 0)) after a rejection, p for the bonus token.
  4. _final_combine_kernel grid (B,): the sampled rows' final token from the splits.

NOTE on bit-identity with the reference. The random numbers are computed in the kernels with the
counter-based hash of sample/gumbel.py (`_hash_u32` and friends below mirror it op for op on
int64), not precomputed with torch: the final slot's Gumbel key depends on the accept count, so
precomputing it would put the ~25 torch ops of `gumbel()` and their [B, V] int64 temporaries
between kernels 2 and 3, the very launches this replaces. The uniforms are integer math plus
exact float ops, hence bit-identical; logs, exps and divisions go through libdevice's logf / expf
and round-to-nearest division on CUDA, the functions torch's CUDA kernels use, with no FMA
contraction and no flush-to-zero, so the Gumbel noise, the temperature scaling, every p(d) term
and the Gumbel-max arguments are computed exactly as the reference does. What cannot match to the
bit is a sum over the vocabulary (logsumexp, softmax normalizer), whose reduction order differs
from torch's by design: a decision can differ only where p(d) lies within an ulp of u * q(d), or
where two residual scores tie to an ulp. Greedy rows, and sampled rows drafted greedily (q
one-hot, no softmax), involve no such sum in the final token. Under the interpreter numpy's log
stands in for libdevice (it may differ from torch CPU's log in the last ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from specserve.sample import gumbel as _g

_MASK32 = tl.constexpr(_g._MASK32)
_MUL1 = tl.constexpr(_g._MUL1)
_MUL2 = tl.constexpr(_g._MUL2)
_MUL3 = tl.constexpr(_g._MUL3)
_KEY0 = tl.constexpr(_g._KEY0)
_KEY1 = tl.constexpr(_g._KEY1)
_INV_2_24 = tl.constexpr(_g._INV_2_24)
_U_MAX = tl.constexpr(_g._U_MAX)
_SALT_ACCEPT = tl.constexpr(_g.SALT_ACCEPT)
_SALT_SAMPLE = tl.constexpr(_g.SALT_SAMPLE)

# Vocabulary entries per program; at most _MAX_SPLITS splits per row (BLOCK_S in kernels 2, 4).
_BLOCK_V = 2048
_MAX_SPLITS = 128


# ---- counter-based random numbers (mirror sample/gumbel.py) -----------------------------------
@triton.jit
def _hash_u32(x):
    # int64 holding values in [0, 2^32): products stay below 2^63 as in gumbel.hash_u32.
    x = x ^ (x >> 17)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 11)
    x = (x * _MUL2) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL3) & _MASK32
    x = x ^ (x >> 14)
    return x


@triton.jit
def _row_key(seed, pos, salt: tl.constexpr):
    h = _hash_u32((seed & _MASK32) ^ _KEY0)
    h = _hash_u32(h ^ ((seed >> 32) & _MASK32))
    h = _hash_u32(h ^ (pos & _MASK32))
    return _hash_u32(h ^ salt)


@triton.jit
def _to_unit(h):
    u = ((h >> 8).to(tl.float32) + 0.5) * _INV_2_24
    return tl.minimum(u, _U_MAX)


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _processed(x, temp, APPLY_TEMP: tl.constexpr):
    """Temperature scaling as `apply_temperature` (greedy rows divide by 1), IEEE division."""
    if APPLY_TEMP:
        return tl.math.div_rn(x, tl.where(temp == 0.0, 1.0, temp))
    else:
        return x


@triton.jit
def _argmax_parts(val, idx, axis: tl.constexpr, none):
    """Combine (max, first index) pairs: the first index of the maximum, as torch.argmax."""
    best = tl.max(val, axis=axis)
    if axis == 0:
        hit = val == best
    else:
        hit = val == tl.expand_dims(best, axis)
    return best, tl.min(tl.where(hit, idx, none), axis=axis)


# ---- 1. per-split statistics of every slot row ------------------------------------------------
@triton.jit
def _slot_stats_kernel(
    logits_ptr,
    proc_ptr,
    temp_ptr,
    amax_val_ptr,
    amax_idx_ptr,
    pmax_ptr,
    psum_ptr,
    vocab,
    num_splits,
    logits_stride,
    proc_stride,
    temp_stride,
    K1: tl.constexpr,
    SAMPLED: tl.constexpr,
    APPLY_TEMP: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK_V + tl.arange(0, BLOCK_V)
    m = cols < vocab
    x = tl.load(logits_ptr + r * logits_stride + cols, mask=m, other=float("-inf"))
    x = x.to(tl.float32)
    mx, idx = _argmax_parts(x, cols, 0, vocab)
    out = r * num_splits + c
    tl.store(amax_val_ptr + out, mx)
    tl.store(amax_idx_ptr + out, idx)
    if SAMPLED:
        if APPLY_TEMP:
            p = _processed(x, tl.load(temp_ptr + (r // K1) * temp_stride), True)
        else:
            p = tl.load(proc_ptr + r * proc_stride + cols, mask=m, other=float("-inf"))
        pm = tl.max(p, axis=0)
        pm_safe = tl.where(pm == float("-inf"), 0.0, pm)
        ps = tl.sum(tl.where(m, _exp(p - pm_safe, PRECISE), 0.0), axis=0)
        tl.store(pmax_ptr + out, pm)
        tl.store(psum_ptr + out, ps)


# ---- 2. acceptance ----------------------------------------------------------------------------
@triton.jit
def _accept_kernel(
    logits_ptr,
    proc_ptr,
    temp_ptr,
    seeds_ptr,
    positions_ptr,
    draft_ptr,
    probs_ptr,
    num_draft_ptr,
    amax_val_ptr,
    amax_idx_ptr,
    pmax_ptr,
    psum_ptr,
    out_tokens_ptr,
    num_acc_ptr,
    final_max_ptr,
    final_sum_ptr,
    vocab,
    num_splits,
    logits_stride,
    proc_stride,
    draft_stride,
    probs_stride_b,
    probs_stride_k,
    out_stride,
    temp_stride,
    seed_stride,
    K: tl.constexpr,
    SAMPLED: tl.constexpr,
    APPLY_TEMP: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    s = tl.arange(0, BLOCK_S)
    in_slots = j < K + 1
    rows = b * (K + 1) + j
    pmask = in_slots[:, None] & (s < num_splits)[None, :]
    part = rows[:, None] * num_splits + s[None, :]
    av = tl.load(amax_val_ptr + part, mask=pmask, other=float("-inf"))
    ai = tl.load(amax_idx_ptr + part, mask=pmask, other=vocab)
    _, argmax = _argmax_parts(av, ai, 1, vocab)

    is_draft = j < K
    d = tl.load(draft_ptr + b * draft_stride + j, mask=is_draft, other=0)
    # Padding drafts may hold anything (e.g. -1): clamped as the reference does.
    d = tl.minimum(tl.maximum(d, 0), vocab - 1)
    accept = d == argmax
    if SAMPLED:
        temp = tl.load(temp_ptr + b * temp_stride)
        pm = tl.load(pmax_ptr + part, mask=pmask, other=float("-inf"))
        ps = tl.load(psum_ptr + part, mask=pmask, other=0.0)
        # logsumexp as torch computes it: max (0 if infinite), log(sum(exp(x - max))) + max.
        mx = tl.max(pm, axis=1)
        m0 = tl.where(tl.abs(mx) == float("inf"), 0.0, mx)
        scaled = tl.where(pm == float("-inf"), 0.0, ps * _exp(pm - m0[:, None], PRECISE))
        total = tl.sum(scaled, axis=1)
        lse = _log(total, PRECISE) + m0
        if APPLY_TEMP:
            l_d = tl.load(logits_ptr + rows * logits_stride + d, mask=is_draft, other=0.0)
            l_d = _processed(l_d.to(tl.float32), temp, True)
        else:
            l_d = tl.load(proc_ptr + rows * proc_stride + d, mask=is_draft, other=0.0)
        p_d = _exp(l_d - lse, PRECISE)
        if HAS_PROBS:
            q_off = b * probs_stride_b + j * probs_stride_k + d
            q_d = tl.load(probs_ptr + q_off, mask=is_draft, other=1.0).to(tl.float32)
        else:
            q_d = tl.full([BLOCK_K], 1.0, tl.float32)
        seed = tl.load(seeds_ptr + b * seed_stride).to(tl.int64)
        pos = tl.load(positions_ptr + b).to(tl.int64) + j
        u = _to_unit(_row_key(seed, pos, _SALT_ACCEPT))
        # Multiplied out to avoid dividing; q(d) == 0 cannot have been drafted.
        accept = tl.where(temp == 0.0, accept, u * q_d < p_d)
    nd = tl.load(num_draft_ptr + b)
    ok = accept & (j < nd)
    # Leading accepted drafts: the first slot that is not an accepted valid draft.
    n = tl.min(tl.where(ok, BLOCK_K, j), axis=0)
    final = tl.sum(tl.where(j == n, argmax, 0), axis=0).to(tl.int64)
    out = tl.where(j < n, d.to(tl.int64), tl.where(j == n, final, -1))
    tl.store(out_tokens_ptr + b * out_stride + j, out, mask=in_slots)
    tl.store(num_acc_ptr + b, n.to(tl.int64))
    if SAMPLED:  # the final slot's softmax statistics, for kernel 3
        tl.store(final_max_ptr + b, tl.sum(tl.where(j == n, m0, 0.0), axis=0))
        tl.store(final_sum_ptr + b, tl.sum(tl.where(j == n, total, 0.0), axis=0))


# ---- 3. Gumbel-max over the final slot, per split ---------------------------------------------
@triton.jit
def _final_sample_kernel(
    logits_ptr,
    proc_ptr,
    temp_ptr,
    seeds_ptr,
    positions_ptr,
    draft_ptr,
    probs_ptr,
    num_draft_ptr,
    num_acc_ptr,
    final_max_ptr,
    final_sum_ptr,
    main_val_ptr,
    main_idx_ptr,
    fb_val_ptr,
    fb_idx_ptr,
    has_main_ptr,
    vocab,
    num_splits,
    logits_stride,
    proc_stride,
    draft_stride,
    probs_stride_b,
    probs_stride_k,
    temp_stride,
    seed_stride,
    K: tl.constexpr,
    APPLY_TEMP: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    temp = tl.load(temp_ptr + b * temp_stride)
    if temp == 0.0:  # greedy rows keep kernel 2's argmax
        return
    n = tl.load(num_acc_ptr + b)
    rejected = n < tl.load(num_draft_ptr + b)
    r = b * (K + 1) + n
    cols = c * BLOCK_V + tl.arange(0, BLOCK_V)
    m = cols < vocab
    if APPLY_TEMP:
        x = tl.load(logits_ptr + r * logits_stride + cols, mask=m, other=float("-inf"))
        x = _processed(x.to(tl.float32), temp, True)
    else:
        x = tl.load(proc_ptr + r * proc_stride + cols, mask=m, other=float("-inf"))
    if HAS_PROBS:
        # After a rejection: norm(max(p - q, 0)), or p if that is all zero; else the logits.
        p = tl.math.div_rn(
            _exp(x - tl.load(final_max_ptr + b), PRECISE), tl.load(final_sum_ptr + b)
        )
        q_off = b * probs_stride_b + tl.minimum(n, K - 1) * probs_stride_k + cols
        q = tl.load(probs_ptr + q_off, mask=m & rejected, other=0.0).to(tl.float32)
        res = tl.maximum(p - q, 0.0)
        main = tl.where(rejected, _log(res, PRECISE), x)
        fb = tl.where(rejected, _log(p, PRECISE), x)
        has_main = (tl.max(tl.where(m, res, 0.0), axis=0) > 0.0) | ~rejected
    else:
        # q one-hot at the draft: p without the rejected draft, or p if nothing else is left.
        d = tl.load(draft_ptr + b * draft_stride + tl.minimum(n, K - 1))
        d = tl.minimum(tl.maximum(d, 0), vocab - 1)
        main = tl.where(rejected & (cols == d), float("-inf"), x)
        fb = x
        has_main = tl.max(tl.where(m, main, float("-inf")), axis=0) > float("-inf")
    key = _row_key(
        tl.load(seeds_ptr + b * seed_stride).to(tl.int64),
        tl.load(positions_ptr + b) + n,
        _SALT_SAMPLE,
    )
    mult = (_hash_u32(key ^ _KEY1) & 0x7FFFFFFF) | 1
    u = _to_unit(_hash_u32((cols.to(tl.int64) * mult + key) & _MASK32))
    g = -_log(-_log(u, PRECISE), PRECISE)
    mv, mi = _argmax_parts(tl.where(m, main + g, float("-inf")), cols, 0, vocab)
    fv, fi = _argmax_parts(tl.where(m, fb + g, float("-inf")), cols, 0, vocab)
    out = b * num_splits + c
    tl.store(main_val_ptr + out, mv)
    tl.store(main_idx_ptr + out, mi)
    tl.store(fb_val_ptr + out, fv)
    tl.store(fb_idx_ptr + out, fi)
    tl.store(has_main_ptr + out, has_main.to(tl.int32))


# ---- 4. the sampled rows' final token ---------------------------------------------------------
@triton.jit
def _final_combine_kernel(
    temp_ptr,
    num_acc_ptr,
    main_val_ptr,
    main_idx_ptr,
    fb_val_ptr,
    fb_idx_ptr,
    has_main_ptr,
    out_tokens_ptr,
    vocab,
    num_splits,
    out_stride,
    temp_stride,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    if tl.load(temp_ptr + b * temp_stride) == 0.0:
        return
    s = tl.arange(0, BLOCK_S)
    m = s < num_splits
    part = b * num_splits + s
    mv = tl.load(main_val_ptr + part, mask=m, other=float("-inf"))
    mi = tl.load(main_idx_ptr + part, mask=m, other=vocab)
    fv = tl.load(fb_val_ptr + part, mask=m, other=float("-inf"))
    fi = tl.load(fb_idx_ptr + part, mask=m, other=vocab)
    has_main = tl.max(tl.load(has_main_ptr + part, mask=m, other=0), axis=0) > 0
    _, main_tok = _argmax_parts(mv, mi, 0, vocab)
    _, fb_tok = _argmax_parts(fv, fi, 0, vocab)
    tok = tl.where(has_main, main_tok, fb_tok).to(tl.int64)
    tl.store(out_tokens_ptr + b * out_stride + tl.load(num_acc_ptr + b), tok)


def rejection_sample_triton(
    # [B, K + 1, V] raw target logits
    target_logits: Tensor,
    # [B, K] draft tokens (padding past num_draft may hold anything)
    draft_tokens: Tensor,
    # [B, K, V] draft probabilities over the target vocab, or None (q one-hot at the draft)
    draft_probs: Tensor | None,
    # [B] int64
    num_draft: Tensor,
    # [B] float32, 0 = greedy
    temperature: Tensor,
    # [B] int64
    seeds: Tensor,
    # [B] int64 position of output slot 0
    positions: Tensor,
    all_greedy: bool,
    # [B * (K + 1), V] float32 `process_logits` output when top-k / top-p / min-p are in use;
    # None: temperature is the only processing and is applied in the kernels
    processed_logits: Tensor | None = None,
    block_v: int = _BLOCK_V,
) -> tuple[Tensor, Tensor]:
    """-> (output tokens [B, K + 1] int64, -1 after the last valid; num_accepted [B] int64)."""
    B, k1, V = target_logits.shape
    K = k1 - 1
    dev = target_logits.device
    out_tokens = torch.empty(B, k1, dtype=torch.int64, device=dev)
    num_acc = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return out_tokens, num_acc
    logits = target_logits.reshape(B * k1, V)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_v = max(block_v, triton.next_power_of_2(triton.cdiv(V, _MAX_SPLITS)))
    S = triton.cdiv(V, block_v)
    sampled = not all_greedy
    apply_temp = processed_logits is None
    proc = logits if apply_temp else processed_logits
    probs = draft_probs
    if probs is not None and probs.stride(2) != 1:
        probs = probs.contiguous()
    probs_arg = probs if probs is not None else logits
    probs_strides = (probs.stride(0), probs.stride(1)) if probs is not None else (0, 0)

    def f32(*shape: int) -> Tensor:
        return torch.empty(*shape, dtype=torch.float32, device=dev)

    def i32(*shape: int) -> Tensor:
        return torch.empty(*shape, dtype=torch.int32, device=dev)

    amax_val, amax_idx = f32(B * k1, S), i32(B * k1, S)
    pmax, psum = (f32(B * k1, S), f32(B * k1, S)) if sampled else (amax_val, amax_val)
    final_max, final_sum = f32(B), f32(B)
    precise = dev.type == "cuda"
    # Torch's arithmetic: no FMA contraction, libdevice without flush-to-zero (see the NOTE).
    opts = dict(enable_fp_fusion=False, enable_reflect_ftz=False)
    common = dict(SAMPLED=sampled, APPLY_TEMP=apply_temp, PRECISE=precise)
    _slot_stats_kernel[(B * k1, S)](
        logits,
        proc,
        temperature,
        amax_val,
        amax_idx,
        pmax,
        psum,
        V,
        S,
        logits.stride(0),
        proc.stride(0),
        temperature.stride(0),
        K1=k1,
        BLOCK_V=block_v,
        num_warps=4,
        **common,
        **opts,
    )
    _accept_kernel[(B,)](
        logits,
        proc,
        temperature,
        seeds,
        positions,
        draft_tokens,
        probs_arg,
        num_draft,
        amax_val,
        amax_idx,
        pmax,
        psum,
        out_tokens,
        num_acc,
        final_max,
        final_sum,
        V,
        S,
        logits.stride(0),
        proc.stride(0),
        draft_tokens.stride(0),
        *probs_strides,
        out_tokens.stride(0),
        temperature.stride(0),
        seeds.stride(0),
        K=K,
        HAS_PROBS=probs is not None,
        BLOCK_K=triton.next_power_of_2(k1),
        BLOCK_S=triton.next_power_of_2(S),
        num_warps=4,
        **common,
        **opts,
    )
    if not sampled:
        return out_tokens, num_acc
    main_val, main_idx, fb_val, fb_idx, has_main = (
        f32(B, S),
        i32(B, S),
        f32(B, S),
        i32(B, S),
        i32(B, S),
    )
    _final_sample_kernel[(B, S)](
        logits,
        proc,
        temperature,
        seeds,
        positions,
        draft_tokens,
        probs_arg,
        num_draft,
        num_acc,
        final_max,
        final_sum,
        main_val,
        main_idx,
        fb_val,
        fb_idx,
        has_main,
        V,
        S,
        logits.stride(0),
        proc.stride(0),
        draft_tokens.stride(0),
        *probs_strides,
        temperature.stride(0),
        seeds.stride(0),
        K=K,
        APPLY_TEMP=apply_temp,
        HAS_PROBS=probs is not None,
        PRECISE=precise,
        BLOCK_V=block_v,
        num_warps=4,
        **opts,
    )
    _final_combine_kernel[(B,)](
        temperature,
        num_acc,
        main_val,
        main_idx,
        fb_val,
        fb_idx,
        has_main,
        out_tokens,
        V,
        S,
        out_tokens.stride(0),
        temperature.stride(0),
        BLOCK_S=triton.next_power_of_2(S),
        num_warps=1,
    )
    return out_tokens, num_acc
