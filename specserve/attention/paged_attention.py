"""Paged attention in Triton: one kernel for mixed prefill / decode / verification batches
(torch reference: `torch_ref.paged_attention_ref`, the CPU backend's attention).

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

Key splits (flash-decoding) and tile sizes are launch_policy.py's choice; split programs write
partial softmax states that split_merge.py merges. For decode and verification batches the
kernel also takes this step's RoPE (and Qwen3's qk-norm) and KV write (`new_kv`,
rope_kv_write.py's tile helpers): one launch a layer less, batch-1 decode 5.817 -> 5.726 ms a
step on the H100 (benchmarks/RESULTS.md).

Under PDL (ops/pdl.py) everything that is metadata or a layer parameter loads before the wait
for the previous kernel: positions, seq_lens, the first key tile's page ids, the RoPE table rows
of q and of the new keys, the qk-norm weights and the sink logits; q and the KV cache after it.
Each of these took a dependent L2 round trip off the path after the wait (H100, Qwen3-30B-A3B
and gpt-oss-20b device-busy time a step: page ids 2945 -> 2930 us; norm weights and sinks
2862 -> 2858 us and 1677 -> 1671 us).

Draft trees (CommonAttentionMetadata's tree fields, the TREE variant): a tree token sees keys
from its tree start on through its ancestor bits instead of the window test, and its window
counts from its rotary position; everything else (splits, sinks, GQA, fp8) is unchanged, and
launches without a tree compile to the kernel without these tests.

The metadata holds no position-dependent derived state: window bounds are computed in the kernel
from `positions`, so the per-window metadata of one forward all share one common metadata and
`advance_decode_` only has to advance the common tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.backend import CommonAttentionMetadata
from specserve.attention.kv_quant import check_kv_scales, compute_dtype, kv_quant_args
from specserve.attention.kv_write import fp8_quantize
from specserve.attention.launch_policy import launch_config, split_count
from specserve.attention.rope_kv_write import _norm_weights, _rope_tile, _rope_trig
from specserve.attention.split_merge import combine_splits
from specserve.attention.torch_ref import paged_attention_ref
from specserve.ops import pdl

__all__ = ["paged_attention", "paged_attention_ref"]


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


@triton.jit
def _sink_logits(sinks_ptr, head, row_ok):
    """[rows] fp32 sink logits of the rows' heads, log2 domain (as the scores)."""
    sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    return sink * 1.4426950408889634


# The metadata arguments are views into the step's one upload and the request count: Triton
# would specialize on their 16-byte alignment and on num_reqs == 1 / % 16, so a batch shape first
# seen while serving would stall the step on a compile. They are scalar loads: one variant for
# every batch costs nothing. q, the caches and the output keep their
# alignment (vectorized loads).
_PER_STEP_ARGS = [
    "query_start_loc_ptr",
    "seq_lens_ptr",
    "positions_ptr",
    "block_table_ptr",
    "slot_mapping_ptr",
    "ws_acc_ptr",
    "ws_m_ptr",
    "ws_l_ptr",
    "tree_start_ptr",
    "tree_mask_ptr",
    "tree_pos_ptr",
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
    FUSE_KV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    q_norm_w_ptr,
    k_norm_w_ptr,
    q_eps,
    k_eps,
    QK_NORM: tl.constexpr,
    kv_scales_ptr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    tree_start_ptr,
    tree_mask_ptr,
    tree_pos_ptr,
    EARLY_KV: tl.constexpr = False,
    TREE: tl.constexpr = False,
):
    # KV_FP8: the cache holds value / scale in fp8 (kv_quant.py): this step's keys and values
    # are quantized where the kernel writes them, every key tile dequantized (cast, times the
    # layer's scale) into q's dtype as it is loaded.
    # FUSE_KV: q and this step's k arrive unrotated and k is not in the cache yet; QK_NORM (with
    # FUSE_KV): q and k arrive un-normed too; the per-head RMSNorm runs in the RoPE tiles (no
    # qk-norm launch), q_norm_w / k_norm_w [HEAD_DIM].
    # TREE: draft trees (CommonAttentionMetadata's tree fields, [num_tokens] int64 each): keys
    # from a token's tree_start on are visible through its tree_mask bits instead of the
    # window test, and windows count from tree_positions (its rotary position).
    # The loads up to pdl.wait are metadata and parameters (ops/pdl.py says why that is safe).
    pdl.trigger(PDL)
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
    if TREE:
        rot_pos = tl.load(tree_pos_ptr + tok, mask=row_valid, other=-1).to(tl.int32)
        # The no-tree sentinel (1 << 40) clamped into int32 stays past every key.
        tree_start = tl.load(tree_start_ptr + tok, mask=row_valid, other=0)
        tree_start = tl.minimum(tree_start, 1 << 30).to(tl.int32)
        tree_mask = tl.load(tree_mask_ptr + tok, mask=row_valid, other=0)
    else:
        rot_pos = pos
    if USE_WINDOW:
        win_start = tl.maximum(rot_pos - sliding_window + 1, 0)
        first = win_start
        if TREE:  # tree keys are visible through the bits even before the window
            first = tl.minimum(first, tree_start)
        first = tl.min(tl.where(row_valid, first, kv_end), axis=0)
        kv_begin = (first // BLOCK_N) * BLOCK_N
    else:
        win_start = tl.zeros([BLOCK_M], dtype=tl.int32)
        kv_begin = 0
    if SPLITS > 1:
        # Split-KV (flash-decoding): this program takes its share of the key tiles; partial
        # softmax states are merged by split_merge.combine_splits.
        per = tl.cdiv(tl.cdiv(kv_end - kv_begin, BLOCK_N), SPLITS) * BLOCK_N
        kv_begin = kv_begin + split * per
        kv_end = tl.minimum(kv_end, kv_begin + per)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    # The first key tile's page ids are metadata too: requested with it, so the loop's first
    # K / V loads wait on no block-table round trip after the wait.
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
        k_first = tl.load(k_cache_ptr + off0, mask=ok0, other=0.0)
        v_first = tl.load(v_cache_ptr + off0, mask=ok0, other=0.0)
    q_c, q_s, k_c, k_s = None, None, None, None
    if FUSE_KV:  # the new tokens: positions, slots (metadata), RoPE table rows (constants)
        tq = q_off + tl.arange(0, BLOCK_Q)
        t_tok = (q_start + tq).to(tl.int64)
        t_ok = tq < q_len
        t_pos = tl.load(positions_ptr + t_tok, mask=t_ok, other=-1).to(tl.int32)
        t_slot = tl.load(slot_mapping_ptr + t_tok, mask=t_ok, other=-1)
        q_c, q_s = _rope_trig(pos, row_valid, cos_ptr, sin_ptr, stride_cos, HEAD_DIM)
        k_c, k_s = _rope_trig(t_pos, t_ok, cos_ptr, sin_ptr, stride_cos, HEAD_DIM)
    # The layer's own parameters: the fused qk-norm's q / k weights (Qwen3), the sink logits
    # (gpt-oss).
    q_nw, k_nw, sink = None, None, None
    if QK_NORM:
        q_nw = _norm_weights(q_norm_w_ptr, HEAD_DIM)
        k_nw = _norm_weights(k_norm_w_ptr, HEAD_DIM)
    if HAS_SINKS:
        sink = _sink_logits(sinks_ptr, head, row_valid)
    pdl.wait(PDL)
    if q_off >= q_len:  # a q-block past its request's queries (all rows invalid above)
        return

    q_row = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
    if FUSE_KV:  # q arrives unrotated: RoPE here, rounded as the RoPE kernel rounds
        q = _rope_tile(q_row, row_valid, HEAD_DIM, q_eps, QK_NORM, q_c, q_s, q_nw)
        q = q.to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_row + d[None, :], mask=row_valid[:, None], other=0.0)
    if KV_FP8:  # scales after the wait: calculate_kv_scales writes them in the stream
        k_scale = tl.load(kv_scales_ptr)
        v_scale = tl.load(kv_scales_ptr + 1)
        q = q.to(q_ptr.dtype.element_ty)
    else:
        k_scale, v_scale = 1.0, 1.0
        q = q.to(k_cache_ptr.dtype.element_ty)
    # exp2 on log2-scaled scores: one multiply per score instead of a multiply inside exp. An
    # fp8 cache's key scale joins it (and its value scale multiplies the output): the tiles
    # are only cast, not rescaled element by element (an fp8 value is exact in bf16 / fp16).
    qk_scale = scale * 1.4426950408889634 * k_scale
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
        k_rot = _rope_tile(k_row, mine, HEAD_DIM, k_eps, QK_NORM, k_c, k_s, k_nw)
        v_new = tl.load(
            v_new_ptr + t_tok[:, None] * stride_vnt + kv_head * stride_vnh + d[None, :],
            mask=mine[:, None],
        )
        dst = (t_slot // BLOCK_SIZE) * stride_cb + (t_slot % BLOCK_SIZE) * stride_cs
        dst = dst[:, None] + kv_head * stride_ch + d[None, :]
        k_rot = k_rot.to(k_new_ptr.dtype.element_ty)
        if KV_FP8:
            k_rot = fp8_quantize(k_rot, k_scale, FP8_MAX, FP8_MANT, FP8_MIN_EXP)
            v_new = fp8_quantize(v_new, v_scale, FP8_MAX, FP8_MANT, FP8_MIN_EXP)
        tl.store(k_cache_ptr + dst, k_rot.to(k_cache_ptr.dtype.element_ty), mask=mine[:, None])
        tl.store(v_cache_ptr + dst, v_new.to(v_cache_ptr.dtype.element_ty), mask=mine[:, None])
        tl.debug_barrier()
    for start in range(kv_begin, kv_end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < kv_end
        # The first tile's page ids are page0 (this load is predicated off).
        page = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask & (start != kv_begin), other=0)
        page = tl.where(start == kv_begin, page0, page).to(tl.int64)
        kv_off = page * stride_cb + (kpos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_off = kv_off[:, None] + d[None, :]
        if EARLY_KV:  # the first tile: only this step's keys are left to load
            late = (kmask & ((kpos >= old_end) | (start != kv_begin)))[:, None]
            k = tl.load(k_cache_ptr + kv_off, mask=late, other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=late, other=0.0)
            if start == kv_begin:
                k = tl.where(late, k, k_first)
                v = tl.where(late, v, v_first)
        else:
            k = tl.load(k_cache_ptr + kv_off, mask=kmask[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=kmask[:, None], other=0.0)
        if KV_FP8:
            # Through f16 (exact for both fp8 formats): the hardware's paired fp8 -> f16 cvt,
            # where a direct e5m2 -> bf16 cast lowers to bit moves of twice the instructions.
            k = k.to(tl.float16).to(q_ptr.dtype.element_ty)
            v = v.to(tl.float16).to(q_ptr.dtype.element_ty)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = (kpos[None, :] <= pos[:, None]) & kmask[None, :]
        if TREE:
            # Key tree_start + i: bit i (i past 63 reads bit 63, as the torch reference).
            rel = kpos[None, :] - tree_start[:, None]
            bit = (tree_mask[:, None] >> tl.minimum(tl.maximum(rel, 0), 63)) & 1
            in_window = kpos[None, :] >= win_start[:, None]
            visible = visible & tl.where(rel >= 0, bit != 0, in_window)
        elif USE_WINDOW:
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
            m_new = tl.maximum(m_i, sink)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.math.exp2(sink - m_new)
            acc = acc * alpha[:, None]
            m_i = m_new

    if KV_FP8:
        acc = acc * v_scale
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
    # keys not yet in the cache; only where `launch_policy.fuses_kv_write` says so
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    # [num_heads] per-head sink logits (gpt-oss) or None
    sinks: torch.Tensor | None = None,
    # (q_norm weight [head_dim], k_norm weight [head_dim], q_eps, k_eps): q and k not yet
    # per-head RMS-normed (Qwen3); only with `new_kv`
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None,
    # [2] fp32 (key, value scales): an fp8 cache's (attention/kv_quant.py), else None
    kv_scales: torch.Tensor | None = None,
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
    check_kv_scales(kv_cache.dtype, kv_scales)
    # The dtype the dots run in: the cache's, or q's for an fp8 cache (dequantized tiles).
    cdt = compute_dtype(kv_cache.dtype, q.dtype)
    cfg = launch_config(group, common.max_query_len, head_dim, cdt, cdt != kv_cache.dtype)
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
    block_n = cfg.split_block_n(num_splits, split_len, cdt)
    if num_splits > 1:
        ws_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, device=q.device)
        ws_m = torch.empty(num_tokens, num_heads, num_splits, device=q.device)
        ws_l = torch.empty_like(ws_m)
    else:
        ws_acc = ws_m = ws_l = out  # unused
    tree = common.tree_mask is not None
    if new_kv is not None:
        if common.max_query_len > block_q:
            raise ValueError("new_kv needs max_query_len <= BLOCK_Q (see fuses_kv_write)")
        if tree:
            # Its RoPE turns by `positions`, a tree node's by its tree_positions.
            raise ValueError("new_kv cannot take a draft tree: write the tree's KV first")
        k_new, v_new, cos, sin = new_kv
        v_new = v_new if v_new.stride(-1) == 1 else v_new.contiguous()
        fused = (k_new, v_new, cos, sin, common.slot_mapping)
        fused_strides = (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1))
        fused_strides += (cos.stride(0),)
    else:
        fused, fused_strides = (q, q, q, q, q), (0, 0, 0, 0, 0)  # unused
    kw = pdl.launch_kwargs(q.device)
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
        DOT_PRECISION="ieee" if cdt == torch.float32 else "tf32",
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
        FUSE_KV=new_kv is not None,
        # Split launches (batch 1-ish: a tile or two a program) of small heads only: a 128-wide
        # tile's registers held q back (Qwen3-30B-A3B: device-busy 2875 -> 2984 us a step).
        EARLY_KV=num_splits > 1 and pdl.early_kv(head_dim),
        **_qk_norm_args(qk_norm, q),
        kv_scales_ptr=kv_scales if kv_scales is not None else q,
        **kv_quant_args(kv_cache.dtype),
        **_tree_args(common, q),
        **kw,
    )
    if num_splits > 1:
        combine_splits(out, ws_acc, ws_m, ws_l)
    return out


def _tree_args(common: CommonAttentionMetadata, dummy: torch.Tensor) -> dict:
    """The attention kernel's tree arguments (any tensor stands in when off: never read)."""
    if common.tree_mask is None:
        return dict(tree_start_ptr=dummy, tree_mask_ptr=dummy, tree_pos_ptr=dummy, TREE=False)
    # Without tree_positions windows count from positions (as the torch reference's build).
    rot = common.tree_positions if common.tree_positions is not None else common.positions
    return dict(
        tree_start_ptr=common.tree_start,
        tree_mask_ptr=common.tree_mask,
        tree_pos_ptr=rot,
        TREE=True,
    )


def _qk_norm_args(
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None, dummy: torch.Tensor
) -> dict:
    """The attention kernel's qk-norm arguments (any tensor stands in when off: never read)."""
    if qk_norm is None:
        return dict(q_norm_w_ptr=dummy, k_norm_w_ptr=dummy, q_eps=0.0, k_eps=0.0, QK_NORM=False)
    q_w, k_w, q_eps, k_eps = qk_norm
    return dict(q_norm_w_ptr=q_w, k_norm_w_ptr=k_w, q_eps=q_eps, k_eps=k_eps, QK_NORM=True)
