"""The Triton kernels of `rejection_sample_triton` and `coupled_sample_triton`
(rejection_triton.py) and their counter-based RNG helpers (gumbel.py's, op for op)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from specserve.ops.jit import jit_any_shape
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
_SALT_SYNTHETIC = tl.constexpr(_g.SALT_SYNTHETIC)


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
@jit_any_shape
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
@jit_any_shape
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
@jit_any_shape
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
@jit_any_shape
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


# ---- coupled verification: the target's own draw at every slot --------------------------------
@jit_any_shape
def _coupled_slot_kernel(
    logits_ptr,
    proc_ptr,
    temp_ptr,
    seeds_ptr,
    positions_ptr,
    tok_val_ptr,
    tok_idx_ptr,
    vocab,
    num_splits,
    logits_stride,
    proc_stride,
    temp_stride,
    seed_stride,
    K1: tl.constexpr,
    SAMPLED: tl.constexpr,
    APPLY_TEMP: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Per split of every slot row: (max, first index) of the raw logits for greedy rows, of
    processed logits + gumbel(seed, pos + j, SALT_SAMPLE) for sampled rows (`sample`'s draw)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK_V + tl.arange(0, BLOCK_V)
    m = cols < vocab
    x = tl.load(logits_ptr + r * logits_stride + cols, mask=m, other=float("-inf"))
    v = x.to(tl.float32)
    if SAMPLED:
        b = r // K1
        temp = tl.load(temp_ptr + b * temp_stride)
        if APPLY_TEMP:
            p = _processed(v, temp, True)
        else:
            p = tl.load(proc_ptr + r * proc_stride + cols, mask=m, other=float("-inf"))
        key = _row_key(
            tl.load(seeds_ptr + b * seed_stride).to(tl.int64),
            tl.load(positions_ptr + b).to(tl.int64) + r % K1,
            _SALT_SAMPLE,
        )
        mult = (_hash_u32(key ^ _KEY1) & 0x7FFFFFFF) | 1
        u = _to_unit(_hash_u32((cols.to(tl.int64) * mult + key) & _MASK32))
        g = -_log(-_log(u, PRECISE), PRECISE)
        v = tl.where(temp == 0.0, v, tl.where(m, p + g, float("-inf")))
    mx, idx = _argmax_parts(v, cols, 0, vocab)
    out = r * num_splits + c
    tl.store(tok_val_ptr + out, mx)
    tl.store(tok_idx_ptr + out, idx)


@jit_any_shape
def _coupled_accept_kernel(
    draft_ptr,
    num_draft_ptr,
    tok_val_ptr,
    tok_idx_ptr,
    out_tokens_ptr,
    num_acc_ptr,
    vocab,
    num_splits,
    draft_stride,
    out_stride,
    seeds_ptr,
    positions_ptr,
    seed_stride,
    synthetic_rate,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SYNTHETIC: tl.constexpr,
):
    """Per request: every slot's token from the splits; drafts accepted while equal to it
    (`SYNTHETIC`: each with probability `synthetic_rate`, uniform(seed, pos + j,
    SALT_SYNTHETIC) below it, as rejection.py's `_synthetic_accept`)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    s = tl.arange(0, BLOCK_S)
    in_slots = j < K + 1
    rows = b * (K + 1) + j
    pmask = in_slots[:, None] & (s < num_splits)[None, :]
    part = rows[:, None] * num_splits + s[None, :]
    tv = tl.load(tok_val_ptr + part, mask=pmask, other=float("-inf"))
    ti = tl.load(tok_idx_ptr + part, mask=pmask, other=vocab)
    _, target = _argmax_parts(tv, ti, 1, vocab)
    d = tl.load(draft_ptr + b * draft_stride + j, mask=j < K, other=0)
    d = tl.minimum(tl.maximum(d, 0), vocab - 1)
    if SYNTHETIC:
        seed = tl.load(seeds_ptr + b * seed_stride).to(tl.int64)
        pos = tl.load(positions_ptr + b).to(tl.int64) + j
        hit = _to_unit(_row_key(seed, pos, _SALT_SYNTHETIC)) < synthetic_rate
    else:
        hit = d == target
    ok = hit & (j < tl.load(num_draft_ptr + b))
    n = tl.min(tl.where(ok, BLOCK_K, j), axis=0)
    # accepted drafts, then the target's token (coupled: the drafts accepted ARE its tokens)
    out = tl.where(j <= n, tl.where(j < n, d, target).to(tl.int64), -1)
    tl.store(out_tokens_ptr + b * out_stride + j, out, mask=in_slots)
    tl.store(num_acc_ptr + b, n.to(tl.int64))
