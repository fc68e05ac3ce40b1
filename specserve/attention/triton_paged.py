"""Paged attention in Triton: one kernel for mixed prefill / decode / verification batches.

Layout and launch (vLLM "unified attention" style):
  grid = (num_tokens // BLOCK_Q + num_reqs, num_kv_heads, num_splits)
  Each program owns one q-block of one request: BLOCK_Q query tokens x GROUP query heads of one
  KV head, flattened into BLOCK_M = BLOCK_Q * GROUP (padded to a power of two) rows, so every KV
  tile is loaded once per GQA group. Request i's q-blocks are numbered from
  query_start_loc[i] // BLOCK_Q + i, which over-covers every request with a grid that depends only
  on host-side (num_tokens, num_reqs): programs past their request's query length exit at once.
  The program walks the request's keys in tiles of BLOCK_N positions, gathering each key's page
  through block_table, from the first tile inside the sliding window to the last visible key,
  with an fp32 online softmax. Per-head sinks (gpt-oss) join the softmax denominator after the
  key loop, once per row (in split 0's partial state when the keys are split).

Small decode batches over long contexts leave most SMs idle with that grid, so the keys are then
split over a third grid axis (flash-decoding): each split writes its partial softmax state (m, l,
unnormalized acc) and a second kernel merges them (`_num_splits` picks the count).

The metadata holds no position-dependent derived state: window bounds are computed in the kernel
from `positions`, so the per-window metadata of one forward all share one common metadata and
`advance_decode_` only has to advance the common tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specserve.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    ForwardContext,
)
from specserve.ops import graph_rows, pdl
from specserve.ops.fused import qk_norm_
from specserve.ops.spec_kernels import advance_decode_metadata_
from specserve.ops.triton_kernels import _rope_rows


@dataclass
class TritonAttentionMetadata:
    common: CommonAttentionMetadata
    sliding_window: int | None


# ---- KV cache write ---------------------------------------------------------------------------
@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])  # per-step views
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    # NOTE: padding tokens (slot -1) write nothing, so the null block stays untouched.
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < num_kv_heads)[:, None]
    src_k = t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :]
    src_v = t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dst = dst + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + src_k, mask=mask)
    v = tl.load(v_ptr + src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    # [num_tokens, num_kv_heads, head_dim]
    k: torch.Tensor,
    # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,
    # [num_tokens] int64, -1 = padding (skipped)
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        **pdl.launch_kwargs(k.device),
    )


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_mapping_ptr"])  # per-step views
def _rope_and_cache_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_q_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_META: tl.constexpr,
):
    """One token: rotate q in place, write rotated k and v to the cache. The arithmetic and
    roundings of the RoPE kernel followed by _reshape_and_cache_kernel (fp32, rounded to k's
    dtype, then to the cache's), so the cache holds the same bits. EARLY_META: position, slot
    and cos/sin loads before the wait for the previous kernel (as in the attention kernel)."""
    pdl.trigger(PDL)
    pdl.wait(PDL and not EARLY_META)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=dm, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + d, mask=dm, other=0.0)[None, :]
    slot = tl.load(slot_mapping_ptr + t)
    pdl.wait(PDL and EARLY_META)
    # q of padding tokens too: whoever reads their outputs expects the unfused behaviour.
    _rope_rows(q_ptr + t * stride_qt, stride_qh, num_q_heads, c, s, d, dm, HALF, BLOCK_HQ)
    if slot >= 0:  # padding tokens write nothing
        h = tl.arange(0, BLOCK_HK)
        hm = (h < num_kv_heads)[:, None]
        m = hm & dm[None, :]
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        dst = dst + h[:, None] * stride_ch
        src = k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :]
        k1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        k2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        r1 = (k1 * c - k2 * s).to(k_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty)
        r2 = (k2 * c + k1 * s).to(k_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + dst + d[None, :], r1, mask=m)
        tl.store(k_cache_ptr + dst + HALF + d[None, :], r2, mask=m)
        dv = tl.arange(0, HEAD_DIM)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + dv[None, :], mask=hm)
        tl.store(v_cache_ptr + dst + dv[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=hm)


def rope_and_cache_(
    # [num_tokens]
    positions: torch.Tensor,
    # [num_tokens, num_heads, head_dim], last dim contiguous: rotated in place
    q: torch.Tensor,
    # [num_tokens, num_kv_heads, head_dim], last dim contiguous: read, not modified
    k: torch.Tensor,
    # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    # [max_position, head_dim] fp32 as cat(cos, cos) / cat(sin, sin)
    cos: torch.Tensor,
    sin: torch.Tensor,
    # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,
    # [num_tokens] int64, -1 = padding (no write)
    slot_mapping: torch.Tensor,
) -> None:
    """ops.rope_ then reshape_and_cache in one launch (reference: those two)."""
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    v = v if v.stride(-1) == 1 else v.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    half = head_dim // 2
    kw = pdl.launch_kwargs(q.device)
    _rope_and_cache_kernel[(num_tokens,)](
        positions,
        q,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        num_heads,
        k.shape[1],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_D=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
        EARLY_META=kw["PDL"] and pdl.EARLY_METADATA,
        **kw,
    )


# ---- attention ------------------------------------------------------------------------------
@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest request i whose first q-block (query_start_loc[i] // BLOCK_Q + i) <= q_block."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The metadata arguments are views into the step's one upload and the request count: Triton
# would specialize on their 16-byte alignment and on num_reqs == 1 / % 16, so a batch shape first
# seen while serving compiled a new variant there (issue 23's stalls). They are scalar loads:
# one variant for every batch costs nothing. q, the caches and the output keep their alignment
# (vectorized loads).
_PER_STEP_ARGS = [
    "query_start_loc_ptr",
    "seq_lens_ptr",
    "positions_ptr",
    "block_table_ptr",
    "slot_mapping_ptr",
    "counter_ptr",
    "ws_acc_ptr",
    "ws_m_ptr",
    "ws_l_ptr",
]


@triton.jit(
    do_not_specialize=["num_reqs", "stride_bt"],
    do_not_specialize_on_alignment=_PER_STEP_ARGS,
)
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    positions_ptr,
    block_table_ptr,
    scale,
    num_reqs,
    sliding_window,
    max_blocks_per_req,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLITS: tl.constexpr,
    ws_acc_ptr,
    ws_m_ptr,
    ws_l_ptr,
    num_heads,
    k_new_ptr,
    v_new_ptr,
    cos_ptr,
    sin_ptr,
    slot_mapping_ptr,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_cos,
    sinks_ptr,
    PDL: tl.constexpr,
    EARLY_META: tl.constexpr,
    FUSE_KV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    q_norm_w_ptr,
    k_norm_w_ptr,
    q_eps,
    k_eps,
    QK_NORM: tl.constexpr,
    PAGE_EARLY: tl.constexpr,
    EARLY_ROPE: tl.constexpr = False,
    EARLY_KV: tl.constexpr = False,
    EARLY_PARAMS: tl.constexpr = False,
):
    # QK_NORM (with FUSE_KV): q and k arrive un-normed too; the per-head RMSNorm runs in the
    # RoPE tiles (no qk-norm launch), q_norm_w / k_norm_w [HEAD_DIM].
    # EARLY_META (pdl.EARLY_METADATA): the metadata loads below go before the wait for the
    # previous kernel (pdl.py says why that is safe); q and the KV cache stay after it.
    pdl.trigger(PDL)
    pdl.wait(PDL and not EARLY_META)
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_off = (q_block - (q_start // BLOCK_Q + req)) * BLOCK_Q

    rows = tl.arange(0, BLOCK_M)
    tok_in_req = q_off + rows // GROUP
    # BLOCK_M may exceed BLOCK_Q * GROUP when GROUP is not a power of two.
    row_valid = (tok_in_req < q_len) & (rows < BLOCK_Q * GROUP)
    tok = (q_start + tok_in_req).to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, HEAD_DIM)

    # Causal bound by absolute position; invalid rows get -1 and see nothing.
    pos = tl.load(positions_ptr + tok, mask=row_valid, other=-1).to(tl.int32)
    kv_end = tl.max(pos, axis=0) + 1
    # Keys past seq_len were never written; past the table's width they have no page.
    seq_len = tl.load(seq_lens_ptr + req)
    kv_end = tl.minimum(kv_end, seq_len)
    kv_end = tl.minimum(kv_end, max_blocks_per_req * BLOCK_SIZE)
    if USE_WINDOW:
        win_start = tl.maximum(pos - sliding_window + 1, 0)
        first = tl.min(tl.where(row_valid, win_start, kv_end), axis=0)
        kv_begin = (first // BLOCK_N) * BLOCK_N
    else:
        win_start = tl.zeros([BLOCK_M], dtype=tl.int32)
        kv_begin = 0
    if SPLITS > 1:
        # Split-KV (flash-decoding): this program takes its share of the key tiles; partial
        # softmax states are merged by _combine_splits_kernel.
        per = tl.cdiv(tl.cdiv(kv_end - kv_begin, BLOCK_N), SPLITS) * BLOCK_N
        kv_begin = kv_begin + split * per
        kv_end = tl.minimum(kv_end, kv_begin + per)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    if PAGE_EARLY:
        # The first key tile's page ids are metadata too: requested with it, so the loop's
        # first K / V loads wait on no block-table round trip after the wait.
        kpos0 = kv_begin + tl.arange(0, BLOCK_N)
        page0 = tl.load(bt_row + kpos0 // BLOCK_SIZE, mask=kpos0 < kv_end, other=0)
        if EARLY_KV:
            # EARLY_KV (pdl.early_kv): the first tile's keys and values from before this step
            # (positions < seq_len - q_len, complete before this kernel starts: pdl.py) load
            # before the wait too; this step's own keys load after the cache write below.
            old_end = seq_len - q_len
            ok0 = ((kpos0 < kv_end) & (kpos0 < old_end))[:, None]
            off0 = page0.to(tl.int64) * stride_cb + (kpos0 % BLOCK_SIZE) * stride_cs
            off0 = (off0 + kv_head * stride_ch)[:, None] + d[None, :]
            k0 = tl.load(k_cache_ptr + off0, mask=ok0, other=0.0)
            v0 = tl.load(v_cache_ptr + off0, mask=ok0, other=0.0)
    q_c, q_s, k_c, k_s = None, None, None, None
    if FUSE_KV:  # the new tokens: positions, slots (metadata), RoPE table rows (constants)
        tq = q_off + tl.arange(0, BLOCK_Q)
        t_tok = (q_start + tq).to(tl.int64)
        t_ok = tq < q_len
        t_pos = tl.load(positions_ptr + t_tok, mask=t_ok, other=-1).to(tl.int32)
        t_slot = tl.load(slot_mapping_ptr + t_tok, mask=t_ok, other=-1)
        if EARLY_ROPE:  # before the wait with the metadata: one round trip less after it
            q_c, q_s = _rope_trig(pos, row_valid, cos_ptr, sin_ptr, stride_cos, HEAD_DIM)
            k_c, k_s = _rope_trig(t_pos, t_ok, cos_ptr, sin_ptr, stride_cos, HEAD_DIM)
    q_nw, k_nw, sink = None, None, None
    if EARLY_PARAMS:  # the layer's own parameters too (EARLY_ATTN_PARAMS)
        if QK_NORM:
            q_nw = _norm_weights(q_norm_w_ptr, HEAD_DIM)
            k_nw = _norm_weights(k_norm_w_ptr, HEAD_DIM)
        if HAS_SINKS:
            sink = _sink_logits(sinks_ptr, head, row_valid)
    pdl.wait(PDL and EARLY_META)
    if q_off >= q_len:  # a q-block past its request's queries (all rows invalid above)
        return

    q_row = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
    if FUSE_KV:  # q arrives unrotated: RoPE here, rounded as the RoPE kernel rounds
        q = _rope_tile(
            q_row, row_valid, pos, cos_ptr, sin_ptr, stride_cos, HEAD_DIM, q_norm_w_ptr, q_eps,
            QK_NORM, q_c, q_s, q_nw,
        )  # fmt: skip
        q = q.to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_row + d[None, :], mask=row_valid[:, None], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)
    # exp2 on log2-scaled scores: one multiply per score instead of a multiply inside exp.
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if FUSE_KV:
        # This step's keys and values (rotated k) go to the cache here, each by the program
        # whose key range holds its position: all of a request's new tokens sit in one q-block
        # (the launcher fuses only when max_query_len <= BLOCK_Q), so no other program reads
        # them; the barrier makes them visible to this program's threads.
        mine = t_ok & (t_slot >= 0) & (t_pos >= kv_begin) & (t_pos < kv_end)
        k_row = k_new_ptr + t_tok[:, None] * stride_knt + kv_head * stride_knh
        k_rot = _rope_tile(
            k_row, mine, t_pos, cos_ptr, sin_ptr, stride_cos, HEAD_DIM, k_norm_w_ptr, k_eps,
            QK_NORM, k_c, k_s, k_nw,
        )  # fmt: skip
        v_new = tl.load(
            v_new_ptr + t_tok[:, None] * stride_vnt + kv_head * stride_vnh + d[None, :],
            mask=mine[:, None],
        )
        dst = (t_slot // BLOCK_SIZE) * stride_cb + (t_slot % BLOCK_SIZE) * stride_cs
        dst = dst[:, None] + kv_head * stride_ch + d[None, :]
        k_rot = k_rot.to(k_new_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + dst, k_rot, mask=mine[:, None])
        tl.store(v_cache_ptr + dst, v_new.to(v_cache_ptr.dtype.element_ty), mask=mine[:, None])
        tl.debug_barrier()
    for start in range(kv_begin, kv_end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < kv_end
        if PAGE_EARLY:  # the first tile's page ids are page0 (this load is predicated off)
            page = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask & (start != kv_begin), other=0)
            page = tl.where(start == kv_begin, page0, page).to(tl.int64)
        else:
            page = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
        kv_off = page * stride_cb + (kpos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_off = kv_off[:, None] + d[None, :]
        if EARLY_KV:  # the first tile: only this step's keys are left to load
            late = (kmask & ((kpos >= old_end) | (start != kv_begin)))[:, None]
            k = tl.load(k_cache_ptr + kv_off, mask=late, other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=late, other=0.0)
            if start == kv_begin:
                k = tl.where(late, k, k0)
                v = tl.where(late, v, v0)
        else:
            k = tl.load(k_cache_ptr + kv_off, mask=kmask[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=kmask[:, None], other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = (kpos[None, :] <= pos[:, None]) & kmask[None, :]
        if USE_WINDOW:
            visible = visible & (kpos[None, :] >= win_start[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with nothing visible yet keep m = -inf: subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_SINKS:
        if split == 0:
            # The head's sink logit joins the denominator once (split 0's partial state; the
            # merge sums l over splits): exp(sink) more mass, no value. Log2 domain, unscaled.
            if EARLY_PARAMS:
                sink_l2 = sink
            else:
                sink_l2 = _sink_logits(sinks_ptr, head, row_valid)
            m_new = tl.maximum(m_i, sink_l2)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.math.exp2(sink_l2 - m_new)
            acc = acc * alpha[:, None]
            m_i = m_new

    if SPLITS > 1:
        ws = (tok * num_heads + head) * SPLITS + split
        tl.store(ws_m_ptr + ws, m_i, mask=row_valid)
        tl.store(ws_l_ptr + ws, l_i, mask=row_valid)
        tl.store(ws_acc_ptr + ws[:, None] * HEAD_DIM + d[None, :], acc, mask=row_valid[:, None])
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )


@triton.jit
def _rope_trig(pos, row_ok, cos_ptr, sin_ptr, stride_cos, HEAD_DIM: tl.constexpr):
    """(cos, sin) [rows, HEAD_DIM] fp32 table rows of positions pos [rows] (0 where not
    row_ok)."""
    d = tl.arange(0, HEAD_DIM)
    trig = pos.to(tl.int64)[:, None] * stride_cos + d[None, :]
    ok = row_ok[:, None]
    return tl.load(cos_ptr + trig, mask=ok, other=0.0), tl.load(sin_ptr + trig, mask=ok, other=0.0)


@triton.jit
def _rope_tile(
    row_ptr,
    row_ok,
    pos,
    cos_ptr,
    sin_ptr,
    stride_cos,
    HEAD_DIM: tl.constexpr,
    norm_w_ptr,
    eps,
    NORM: tl.constexpr,
    c=None,
    s=None,
    nw=None,
):
    """[rows, HEAD_DIM] fp32 rotate-half RoPE of the vectors at row_ptr [rows, 1] (positions
    pos [rows]): x1 * c - x2 * s, x2 * c + x1 * s, as the RoPE kernels compute it; each half's
    partner is a second load of the same row (cos/sin rows are cat(c, c), cat(s, s)); c, s:
    the rows' `_rope_trig`, loaded already, or None; nw: `_norm_weights`, loaded already, or
    None.
    NORM: each row RMS-normed over HEAD_DIM first (Qwen3's q_norm / k_norm, weight at
    norm_w_ptr), rounded as the qk-norm kernel rounds (to the row dtype after the scale and
    after the weight), so the rotation sees the values that kernel would have stored."""
    d = tl.arange(0, HEAD_DIM)
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    ok = row_ok[:, None]
    x = tl.load(row_ptr + d[None, :], mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(row_ptr + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORM:
        dt = row_ptr.dtype.element_ty
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        if nw is None:
            nw = _norm_weights(norm_w_ptr, HEAD_DIM)
        w, wp = nw
        x = (w * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        xp = (wp * (xp * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    if c is None:
        c, s = _rope_trig(pos, row_ok, cos_ptr, sin_ptr, stride_cos, HEAD_DIM)
    first_half = (d < HEAD_DIM // 2)[None, :]
    return tl.where(first_half, x * c - xp * s, x * c + xp * s)


@triton.jit
def _sink_logits(sinks_ptr, head, row_ok):
    """[rows] fp32 sink logits of the rows' heads, log2 domain (as the scores)."""
    sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    return sink * 1.4426950408889634


@triton.jit
def _norm_weights(norm_w_ptr, HEAD_DIM: tl.constexpr):
    """(w, w of each element's rotate-half partner) [1, HEAD_DIM] fp32: a per-head RMSNorm
    weight as `_rope_tile` applies it."""
    d = tl.arange(0, HEAD_DIM)
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    w = tl.load(norm_w_ptr + d).to(tl.float32)[None, :]
    return w, tl.load(norm_w_ptr + partner).to(tl.float32)[None, :]


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    ws_acc_ptr,
    ws_m_ptr,
    ws_l_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t, h] from the SPLITS partial (m, l, acc) of row (t, h): rescale each to the global
    max (log2 domain, as the main kernel) and normalize once. Empty splits have m = -inf."""
    pdl.start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = (t * num_heads + h) * SPLITS
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    m = tl.load(ws_m_ptr + row + sp)
    lse = tl.load(ws_l_ptr + row + sp)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_safe)
    denom = tl.sum(lse * w, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    acc = tl.load(ws_acc_ptr + (row + sp)[:, None] * HEAD_DIM + d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class _LaunchConfig:
    block_m: int  # rows per program: BLOCK_Q query tokens x GROUP heads (padded to a power of 2)
    block_n: int  # key positions per KV tile
    num_warps: int
    num_stages: int  # the key loop's software pipeline depth when keys are not split

    def stages(self, num_splits: int) -> int:
        """The launch's pipeline depth: split programs walk a few key tiles each, where the
        deep pipeline only costs (batch 1, RESULTS.md session 20)."""
        return self.num_stages if num_splits == 1 else 2


def _launch_config(
    group: int, max_query_len: int, head_dim: int, dtype: torch.dtype
) -> _LaunchConfig:
    """Tile sizes chosen so that sm_90 ptxas reports no register spills for head_dim <= 128.

    A tl.dot needs at least 16 rows. 16-bit inputs run on tensor cores: up to 128 rows (8 warps)
    for head_dim <= 128. fp32 uses exact (ieee) FMA dots, which need far more registers per row:
    at most 32 rows with 32-key tiles; fp32 is for tests and tiny models, not for speed.
    """
    if dtype == torch.float32:
        max_m, block_n = 32, 32
    elif head_dim > 128:
        max_m, block_n = 64, 32
    else:
        max_m, block_n = 128, 64
    rows = triton.next_power_of_2(group * max(max_query_len, 1))
    block_m = max(min(max(rows, 16), max_m), triton.next_power_of_2(group))
    num_warps = 8 if block_m >= 128 or dtype == torch.float32 else 4
    # Decode and verification tiles (<= 32 rows) walk a request's whole key range once the
    # batch fills the SMs (no key splits: batch 16+); prefill tiles keep the shallow pipeline
    # they were measured with.
    num_stages = NUM_STAGES if block_m <= 32 else 2
    return _LaunchConfig(block_m, block_n, num_warps, num_stages)


def paged_attention(
    # [num_tokens, num_heads, head_dim]
    q: torch.Tensor,
    # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,
    common: CommonAttentionMetadata,
    scale: float,
    sliding_window: int | None,
    num_splits: int | None = None,
    split_len: int | None = None,
    # (k, v [num_tokens, num_kv_heads, head_dim], cos, sin): q and k unrotated, this step's
    # keys not yet in the cache; only where `fuses_kv_write` says so
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    # [num_heads] per-head sink logits (gpt-oss) or None
    sinks: torch.Tensor | None = None,
    # (q_norm weight [head_dim], k_norm weight [head_dim], q_eps, k_eps): q and k not yet
    # per-head RMS-normed (Qwen3); only with `new_kv`
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None,
) -> torch.Tensor:
    """`num_splits`: key splits per program (None: `split_count`'s choice; tests force it).
    `split_len`: the key count that choice assumes (the engine passes max_model_len; None: the
    batch's max_seq_len). `new_kv`: RoPE and the KV write inside this kernel (the RoPE + KV
    write kernel's work; positions and slots from `common`). `qk_norm`: with `new_kv`, the
    qk-norm kernel's work too (ops.qk_norm_)."""
    num_tokens, num_heads, head_dim = q.shape
    if qk_norm is not None and new_kv is None:
        raise ValueError("qk_norm is fused only with new_kv (RoPE + KV write in the kernel)")
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}.")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim}: the Triton backend needs a power of two >= 16.")
    q = q if q.stride(-1) == 1 else q.contiguous()
    # NOTE: rows not covered by any request (none today) are left uninitialised; callers drop them.
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    cfg = _launch_config(group, common.max_query_len, head_dim, kv_cache.dtype)
    block_q = cfg.block_m // group
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    bt = common.block_table
    # Fixed by host-side sizes only, so a captured graph replays with any data.
    q_blocks = num_tokens // block_q + common.num_reqs
    split_len = split_len or common.max_seq_len
    if num_splits is None:
        num_splits = split_count(
            num_tokens, common.num_reqs, block_q, num_kv_heads, split_len, q.device
        )
    grid = (q_blocks, num_kv_heads, num_splits)
    block_n = cfg.block_n
    # Small tiles where a split holds few keys at most (host sizes: graph and eager alike).
    short = split_len // num_splits <= SPLIT_SMALL_TILE_MAX_KEYS
    if num_splits > 1 and short and SPLIT_BLOCK_N and kv_cache.dtype != torch.float32:
        block_n = min(block_n, max(16, SPLIT_BLOCK_N))
    if num_splits > 1:
        ws_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, device=q.device)
        ws_m = torch.empty(num_tokens, num_heads, num_splits, device=q.device)
        ws_l = torch.empty_like(ws_m)
    else:
        ws_acc = ws_m = ws_l = out  # unused
    if new_kv is not None:
        if common.max_query_len > block_q:
            raise ValueError("new_kv needs max_query_len <= BLOCK_Q (see fuses_kv_write)")
        k_new, v_new, cos, sin = new_kv
        v_new = v_new if v_new.stride(-1) == 1 else v_new.contiguous()
        fused = (k_new, v_new, cos, sin, common.slot_mapping)
        fused_strides = (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1))
        fused_strides += (cos.stride(0),)
    else:
        fused, fused_strides = (q, q, q, q, q), (0, 0, 0, 0, 0)  # unused
    kw = pdl.launch_kwargs(q.device)
    # Loads before the PDL wait. Without PDL nothing waits: early or not is the same kernel
    # (the interpreter tests this path).
    early = pdl.EARLY_METADATA or not kw["PDL"]
    early_kv = pdl.early_kv(head_dim) if kw["PDL"] else head_dim <= pdl.EARLY_KV_MAX_HEAD_DIM
    if SPLIT_EARLY_KV and block_n < cfg.block_n:  # a small split tile (SPLIT_BLOCK_N)
        early_kv = not kw["PDL"] or (pdl.EARLY_METADATA and not pdl.GEMV_EARLY_TRIGGER)
    _paged_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        common.query_start_loc,
        common.seq_lens,
        common.positions,
        bt,
        scale,
        common.num_reqs,
        sliding_window or 0,
        bt.shape[1],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        bt.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        # fp32 caches get exact fp32 dots (no tf32), so results track the reference closely.
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        SPLITS=num_splits,
        ws_acc_ptr=ws_acc,
        ws_m_ptr=ws_m,
        ws_l_ptr=ws_l,
        num_heads=num_heads,
        k_new_ptr=fused[0],
        v_new_ptr=fused[1],
        cos_ptr=fused[2],
        sin_ptr=fused[3],
        slot_mapping_ptr=fused[4],
        stride_knt=fused_strides[0],
        stride_knh=fused_strides[1],
        stride_vnt=fused_strides[2],
        stride_vnh=fused_strides[3],
        stride_cos=fused_strides[4],
        sinks_ptr=sinks if sinks is not None else q,
        HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.stages(num_splits),
        EARLY_META=kw["PDL"] and pdl.EARLY_METADATA,
        FUSE_KV=new_kv is not None,
        PAGE_EARLY=PRELOAD_FIRST_PAGE and early,
        EARLY_ROPE=EARLY_ROPE_ROWS and early,
        EARLY_PARAMS=EARLY_ATTN_PARAMS and early,
        # Split launches (batch 1-ish: a tile or two a program) only, with the page ids early.
        EARLY_KV=PRELOAD_FIRST_PAGE and num_splits > 1 and early_kv,
        **_qk_norm_args(qk_norm, q),
        **kw,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            out,
            ws_acc,
            ws_m,
            ws_l,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            SPLITS=num_splits,
            **kw,
        )
    return out


def _qk_norm_args(
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None, dummy: torch.Tensor
) -> dict:
    """The attention kernel's qk-norm arguments (any tensor stands in when off: never read)."""
    if qk_norm is None:
        return dict(q_norm_w_ptr=dummy, k_norm_w_ptr=dummy, q_eps=0.0, k_eps=0.0, QK_NORM=False)
    q_w, k_w, q_eps, k_eps = qk_norm
    return dict(q_norm_w_ptr=q_w, k_norm_w_ptr=k_w, q_eps=q_eps, k_eps=k_eps, QK_NORM=True)


def fuses_kv_write(
    num_heads: int, num_kv_heads: int, max_query_len: int, head_dim: int, dtype: torch.dtype
) -> bool:
    """Whether `paged_attention` may take this step's RoPE + KV write (`new_kv`): when
    FUSE_ROPE_KV is on and every request's new tokens fit one small q-block (decode and
    verification batches), so each new key is written and read by one program only."""
    group = num_heads // num_kv_heads
    block_m = _launch_config(group, max_query_len, head_dim, dtype).block_m
    # At most 32 rows: the unrotated q, its partner and cos / sin tiles all live in registers.
    # The kernel walks the q-block's tokens with tl.arange(0, BLOCK_Q): a power of two only
    # (a GQA group of 3, as SmolLM2's 9 / 3 heads, gives BLOCK_Q = 16 // 3 = 5).
    block_q = block_m // group
    pow2 = block_q & (block_q - 1) == 0
    return FUSE_ROPE_KV and pow2 and max_query_len <= block_q and block_m <= 32


# RoPE + KV write inside the attention kernel for decode and verification batches (one launch a
# layer less): batch-1 decode 5.817 -> 5.726 ms a step on the H100 (benchmarks/RESULTS.md,
# session 6 call 1). Tried and removed: split-KV partials merged by the last split to finish
# (an acq_rel arrival counter) instead of _combine_splits_kernel: slower in every measurement
# (5.913 vs 5.817 ms there; Qwen3-30B-A3B and gpt-oss-20b in sessions 11 and 14).
FUSE_ROPE_KV = True
# With EARLY_METADATA: each program's first key tile's page ids load before the PDL wait, with
# the rest of the metadata (one dependent round trip less after it).
PRELOAD_FIRST_PAGE = True
# With FUSE_ROPE_KV and EARLY_METADATA: the RoPE table rows of q and of the new keys load
# before the wait too (the new keys' positions are metadata): after it, their cos / sin no
# longer wait on a positions round trip.
EARLY_ROPE_ROWS = True
# The layer's own parameters load before the wait too, with the metadata (the PDL rule allows
# weights): the fused qk-norm's q / k weights (Qwen3) and the sink logits (gpt-oss). In the
# sm_90 SASS of Qwen3's decode attention both norm weights and their rotate-half partners
# loaded after the wait, each behind a barrier of the norm's reductions: four dependent L2 round
# trips; split 0's sinks loaded after its key loop. Measured (H100, RESULTS.md session 23,
# `bash benchmarks/gpu_session.sh early-params`, two A/B pairs each): step 2862 / 2863 -> 2858 /
# 2857 us (Qwen3-30B-A3B), 1677 / 1674 -> 1671 / 1670 us (gpt-oss-20b, attention 5.72 -> 5.50
# us a layer): small, the same sign in every pair.
EARLY_ATTN_PARAMS = True
# Split launches (batch-1-like decode) with key tiles of at most this many keys (0: the tile
# _launch_config gives every launch, 64 keys at head_dim <= 128). A split takes whole tiles,
# so at a ~160-key context 64-key tiles leave 3 of 16 splits working, 16-key tiles 10, each a
# quarter of the bytes to wait for (as GLM-4.7-Flash's MLA attention). H100, Qwen3-30B-A3B
# batch 1 (RESULTS.md session 25): attention 8.66 -> 8.07 us a layer, device-busy 2862 / 2863
# -> 2836 us a step (32-key tiles: no gain). SPLIT_EARLY_KV: such a small tile also loads
# early (EARLY_KV) at any head size (the 64 x 128 tile did not pay, session 22: its registers
# held q back); with 16-key tiles it changed nothing measurable (2835 us), so off.
SPLIT_BLOCK_N = 16
SPLIT_EARLY_KV = False
# ... only where a split holds at most this many keys (split_len / splits: max_model_len in the
# engine; the regime measured above, max_model_len 1024 in 16 splits). Longer splits keep
# 64-key tiles: a 16-key tile there is 4x the key-loop iterations, unmeasured.
SPLIT_SMALL_TILE_MAX_KEYS = 64


def split_count(
    num_tokens: int,
    num_reqs: int,
    block_q: int,
    num_kv_heads: int,
    split_len: int,
    device: torch.device,
) -> int:
    """The split count of a launch, from sizes that a captured graph and the eager step it
    stands for share, so both round the same way: the launch's q-blocks (num_tokens // block_q
    + num_reqs) bounded by `graph_rows.row_bound` (for a uniform batch of B requests padded to
    the capture size bg, eager or graph: bg x q tokens and bg requests) and `split_len`
    (max_model_len in the engine: the graph's bound, never the batch's own max_seq_len)."""
    q_blocks = graph_rows.row_bound(num_tokens) // block_q + graph_rows.row_bound(num_reqs)
    return _num_splits(q_blocks * num_kv_heads, split_len, device)


def _num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Key splits per (q-block, KV head): 1 unless the grid leaves most SMs idle (small decode
    batches) and keys are many (at least MIN_KEYS_PER_SPLIT each); a power of two <=
    MAX_SPLITS.

    From host-side sizes only (a captured graph uses max_model_len for max_seq_len)."""
    sms = _num_sms(device.index) if device.type == "cuda" else 132
    room = PROGRAMS_PER_SM * sms // max(num_programs, 1)
    want = min(MAX_SPLITS, max_seq_len // MIN_KEYS_PER_SPLIT, room)
    return 1 if want < 2 else 1 << (want.bit_length() - 1)


# Splits pay off from short contexts on (batch-1 decode at max_model_len 400, H100: 5.64 vs
# 5.76 ms a graph with 4 splits instead of 1; benchmarks/RESULTS.md).
MIN_KEYS_PER_SPLIT = 64
MAX_SPLITS = 16
# The key loop's software pipeline of decode / verification tiles (sm_90 compile,
# tests/test_pdl.py): at 2 the next tile's K and V copies start after this tile's dots and its
# page ids load in the iteration; at 3 (and 4) the page ids load an iteration earlier; at 5 the
# K and V tiles are double-buffered (72 KB of shared memory at head_dim 128). Llama-3-8B batch
# 16 at 1024-token contexts (H100, benchmarks/RESULTS.md session 20): attention 41.9 -> 33.0 us
# a layer, step 7085 -> 6764 us with 5 (3: 7014); batch 1 (16 splits) 5417 -> 5439 us, so
# split launches keep 2.
NUM_STAGES = 5
# Programs an SM is given before keys stop being split. 1: a batch of 16 requests x 8 KV heads
# fills the H100's 132 SMs once and walks each request's keys in one program (experiment:
# larger values split such batches too; benchmarks/RESULTS.md session 18).
PROGRAMS_PER_SM = 1


@functools.cache
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_inplace_advance = True
    fuses_rope = True
    fuses_qk_norm = True

    def __init__(self, max_model_len: int | None = None) -> None:
        # Split-KV counts follow max_model_len, the bound every captured graph is built for.
        self.max_model_len = max_model_len

    def build(
        self, common: CommonAttentionMetadata, sliding_window: int | None
    ) -> TritonAttentionMetadata:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}.")
        return TritonAttentionMetadata(common, sliding_window)

    def forward(
        self,
        # [num_tokens, num_heads, head_dim]
        q: torch.Tensor,
        # [num_tokens, num_kv_heads, head_dim]
        k: torch.Tensor,
        # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        # [2, num_blocks, block_size, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        scale: float,
        sliding_window: int | None,
        # (positions [num_tokens], cos, sin): q and k are not rotated yet (see fuses_rope)
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        # [num_heads] per-head sink logits (gpt-oss) or None
        sinks: torch.Tensor | None = None,
        # (q_norm weight, k_norm weight, q_eps, k_eps): with `rope`, q and k not normed yet
        qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None,
    ) -> torch.Tensor:
        if qk_norm is not None and rope is None:
            raise ValueError("qk_norm comes with rope (see AttentionBackend.fuses_qk_norm)")
        if sliding_window != meta.sliding_window:
            raise ValueError(
                f"metadata was built for sliding_window={meta.sliding_window}, "
                f"forward got {sliding_window}: pass ForwardContext.meta(sliding_window)."
            )
        c = meta.common
        new_kv = None
        # The fused kernel rotates by the metadata's positions: only when RoPE's are those.
        same_pos = rope is not None and rope[0].data_ptr() == c.positions.data_ptr()
        if same_pos and rope[0].shape == c.positions.shape and k.stride(-1) == 1:
            if fuses_kv_write(q.shape[1], k.shape[1], c.max_query_len, q.shape[2], kv_cache.dtype):
                new_kv = (k, v, rope[1], rope[2])
        if new_kv is None and qk_norm is not None:  # not fusable here: the qk-norm kernel
            q, k = qk_norm_(q, k, *qk_norm)
            qk_norm = None
        if new_kv is None and rope is not None:
            rope_and_cache_(rope[0], q, k, v, rope[1], rope[2], kv_cache, c.slot_mapping)
        elif new_kv is None:
            reshape_and_cache(k, v, kv_cache, c.slot_mapping)
        return paged_attention(
            q,
            kv_cache,
            c,
            scale,
            sliding_window,
            split_len=self.max_model_len,
            new_kv=new_kv,
            sinks=sinks,
            qk_norm=qk_norm,
        )

    def advance_decode_(self, meta: TritonAttentionMetadata, block_size: int) -> None:
        """One decode token per request: advance positions, seq_lens and slots in place.

        The metadata of every sliding window of a forward shares one common metadata, so call
        this once per forward context, not once per window.
        """
        advance_decode_common_(meta.common, block_size)

    def advance_context_(self, ctx: ForwardContext, block_size: int) -> None:
        # Every window's metadata wraps the same common metadata: advance it once.
        advance_decode_common_(next(iter(ctx.metadata.values())).common, block_size)


def advance_decode_common_(c: CommonAttentionMetadata, block_size: int) -> None:
    """In place and graph-safe (no host sync, no tensor rebinding): positions and seq_lens + 1,
    slots from the block table, -1 kept for padded rows and set past the table. One launch on
    CUDA (`advance_decode_metadata_`)."""
    advance_decode_metadata_(
        c.positions, c.seq_lens, c.slot_mapping, c.block_table, c.token_req, block_size
    )
    # Host-side bound stays an upper bound on seq_lens (eager callers may read it).
    c.max_seq_len += 1
