"""Triton MLA attention over the paged latent cache (torch reference: attention/mla.py).

One program per (query token, block of heads, key split): the token's request comes from
token_req, its visible keys are positions 0..positions[t] (causal; a decode token sees the whole
context, a verification or prefill token its prefix). Keys stream in BLOCK_N-row tiles of the
latent cache; each tile is read once for all BLOCK_H heads (MLA's single shared K/V row is what
makes a head-block program cheap), scores = q_latent . c + q_pe . k_pe, online softmax, and the
output accumulates in the latent space [BLOCK_H, L].

  grid = (num_tokens, cdiv(num_heads, BLOCK_H), num_splits)

Split-KV (flash-decoding): a batch-1 decode step has one token and cdiv(20, 16) = 2 head blocks,
2 programs for the whole GPU (18 us a layer on the H100 at GLM-4.7-Flash's shape). The keys
of each token are then split evenly over `num_splits` programs (a count fixed by host-side
sizes that a padded graph batch and the eager step it stands for share: max_model_len, never
the batch's seq lens, and `graph_rows.row_bound` of the token count, never the count itself);
each writes its partial softmax state (m, l, unnormalized acc) and mla_merge.py merges the
splits in a fixed order (deterministic). The merge can also apply W_UV (the absorbed value
up-projection, [H, v, L]) to the merged latent: the output is then [T, H, v] and the separate
bmm after attention goes away.

An fp8 latent cache (KV_FP8, attention/kv_quant.py) holds each row / the layer's latent scale
(MLAWeights.latent_scale): every key tile, latent and rotary parts alike, is dequantized (cast,
times the scale) into q's dtype, which the dots and the output then use.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specserve.attention.backend import CommonAttentionMetadata
from specserve.attention.kv_quant import check_kv_scales, compute_dtype, kv_quant_args
from specserve.attention.mla import mla_attention_ref
from specserve.attention.mla_merge import mla_merge
from specserve.ops import graph_rows, pdl
from specserve.tunables import tunables

__all__ = ["mla_attention", "mla_attention_ref", "mla_split_count"]


@triton.jit
def _latent_rows(row, ok, dl, lm, dr, rm, L: tl.constexpr):
    """The cache rows at `row` [BLOCK_N] where `ok`: (latent c [BLOCK_N, BLOCK_L], rotary key
    k_pe [BLOCK_N, BLOCK_R]), zeros elsewhere."""
    c = tl.load(row[:, None] + dl[None, :], mask=ok[:, None] & lm[None, :], other=0.0)
    k_pe = tl.load(row[:, None] + L + dr[None, :], mask=ok[:, None] & rm[None, :], other=0.0)
    return c, k_pe


@triton.jit
def _latent_tile(
    q_lat,
    q_pe,
    c,
    k_pe,
    sm,
    m_i,
    l_i,
    acc,
    qk_scale,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One key tile of the online softmax (log2 domain): keys where `sm`; returns the new
    (m_i [BLOCK_H], l_i [BLOCK_H], acc [BLOCK_H, BLOCK_L]). KV_FP8: c and k_pe arrive as the
    cache's fp8 values and are only cast here, through f16 (exact; the paired hardware cvt):
    the cache scale is in `qk_scale` and multiplies the output once."""
    if KV_FP8:
        c = c.to(tl.float16).to(q_lat.dtype)
        k_pe = k_pe.to(tl.float16).to(q_lat.dtype)
    # [BLOCK_H, BLOCK_N]
    qk = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
    qk = tl.dot(q_pe, tl.trans(k_pe), qk, input_precision=DOT_PRECISION)
    qk = tl.where(sm[None, :], qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Per-step views (metadata uploads, split workspaces): no alignment specialization, so no batch
# shape compiles a variant after start-up (see paged_attention._PER_STEP_ARGS).
@triton.jit(
    do_not_specialize=["stride_bt"],
    do_not_specialize_on_alignment=[
        "ws_acc_ptr", "ws_ml_ptr", "block_table_ptr", "token_req_ptr", "positions_ptr"
    ],
)  # fmt: skip
def _mla_attention_kernel(
    q_lat_ptr,
    q_pe_ptr,
    kv_ptr,
    out_ptr,
    ws_acc_ptr,
    ws_ml_ptr,
    block_table_ptr,
    token_req_ptr,
    positions_ptr,
    scale,
    num_heads,
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_kvb,
    stride_kvs,
    stride_ot,
    stride_oh,
    stride_bt,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    SPLITS: tl.constexpr,
    PARTIALS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    kv_scale_ptr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    EARLY_KV: tl.constexpr = False,
):
    # KV_FP8: the cache holds row / scale in fp8; q keeps its dtype and the key tiles are
    # dequantized into it (FP8_MAX, FP8_MANT, FP8_MIN_EXP: kv_quant_args's, unused on read).
    # PARTIALS: write (m, l, acc) to the workspace for _mla_merge_kernel (always with
    # SPLITS > 1; with SPLITS == 1 too when the merge applies W_UV), else the normalized output.
    pdl.trigger(PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < num_heads
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    lm, rm = dl < L, dr < R
    # Metadata is written before the forward (ops/pdl.py says why): load it early.
    req = tl.load(token_req_ptr + t)
    seq_len = tl.load(positions_ptr + t) + 1
    # This split's share of the key tiles (empty splits keep m = -inf, l = 0, acc = 0).
    per = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), SPLITS) * BLOCK_N
    kv_begin = split * per
    kv_end = tl.minimum(seq_len, kv_begin + per)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    if EARLY_KV:
        # The first key tile's rows written before this step, requested before the wait: they
        # stream while the previous kernels (the prologue writing this step's rows) run. Rows
        # this step may have written (a request's new tokens are at most the batch's T, at
        # positions >= seq_len - T) are read after the wait. Safe because kernels that trigger
        # only after their own wait (the o projection's gemv; the MoE gate_up, whose PTX order
        # tests/test_moe_ops.py checks) sit between a layer's cache writes of one step and its
        # attention in the next, so those writes are complete before this kernel launches.
        s0 = kv_begin + offs_n
        sm0 = s0 < kv_end
        page0 = tl.load(bt_row + s0 // PAGE, mask=sm0, other=0)
        row0 = kv_ptr + page0.to(tl.int64) * stride_kvb + (s0 % PAGE) * stride_kvs
        fresh0 = s0 >= seq_len - tl.num_programs(0)
        c0, k_pe0 = _latent_rows(row0, sm0 & ~fresh0, dl, lm, dr, rm, L)
    pdl.wait(PDL)
    # The dots run in the cache's dtype, or in q's for an fp8 cache (tiles dequantized to it).
    if KV_FP8:  # the scale after the wait: calculate_kv_scales writes it in the stream
        kv_scale = tl.load(kv_scale_ptr)
        cdt = q_lat_ptr.dtype.element_ty
    else:
        kv_scale = 1.0
        cdt = kv_ptr.dtype.element_ty
    q_lat = tl.load(
        q_lat_ptr + t * stride_qlt + h[:, None] * stride_qlh + dl[None, :],
        mask=hm[:, None] & lm[None, :],
        other=0.0,
    ).to(cdt)
    q_pe = tl.load(
        q_pe_ptr + t * stride_qpt + h[:, None] * stride_qph + dr[None, :],
        mask=hm[:, None] & rm[None, :],
        other=0.0,
    ).to(cdt)
    # exp2 on log2-scaled scores: one multiply per score instead of one inside exp (an fp8
    # cache's scale with it: the tiles are cast, not rescaled).
    qk_scale = scale * 1.4426950408889634 * kv_scale
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    first = kv_begin
    if EARLY_KV:
        c_new, k_pe_new = _latent_rows(row0, sm0 & fresh0, dl, lm, dr, rm, L)
        c0 = tl.where(fresh0[:, None], c_new, c0)
        k_pe0 = tl.where(fresh0[:, None], k_pe_new, k_pe0)
        if kv_begin < kv_end:  # an empty split keeps m = -inf, l = 0, acc = 0
            m_i, l_i, acc = _latent_tile(
                q_lat, q_pe, c0, k_pe0, sm0, m_i, l_i, acc, qk_scale, DOT_PRECISION, KV_FP8,
            )  # fmt: skip
        first = kv_begin + BLOCK_N
    for start in range(first, kv_end, BLOCK_N):
        s = start + offs_n
        sm = s < kv_end
        page = tl.load(bt_row + s // PAGE, mask=sm, other=0)
        row = kv_ptr + page.to(tl.int64) * stride_kvb + (s % PAGE) * stride_kvs
        c, k_pe = _latent_rows(row, sm, dl, lm, dr, rm, L)
        m_i, l_i, acc = _latent_tile(
            q_lat, q_pe, c, k_pe, sm, m_i, l_i, acc, qk_scale, DOT_PRECISION, KV_FP8
        )
    if KV_FP8:  # the latent values' scale, once
        acc = acc * kv_scale
    if PARTIALS:
        ws = (t * num_heads + h) * SPLITS + split
        tl.store(ws_ml_ptr + 2 * ws, m_i, mask=hm)
        tl.store(ws_ml_ptr + 2 * ws + 1, l_i, mask=hm)
        tl.store(ws_acc_ptr + ws[:, None] * BLOCK_L + dl[None, :], acc, mask=hm[:, None])
    else:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + t * stride_ot + h[:, None] * stride_oh + dl[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=hm[:, None] & lm[None, :],
        )


def mla_attention(
    # [num_tokens, num_heads, L]
    q_latent: torch.Tensor,
    # [num_tokens, num_heads, R]
    q_pe: torch.Tensor,
    # [num_blocks, block_size, L + R]: this step's rows already written
    kv_cache: torch.Tensor,
    c: CommonAttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    split_len: int | None = None,
    # [num_heads, v, L] (last dim contiguous) or None
    w_uv: torch.Tensor | None = None,
    # [] fp32: an fp8 cache's scale (MLAWeights.latent_scale), else None
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal latent attention; returns [num_tokens, num_heads, L] in kv_cache's dtype (q's for
    an fp8 cache), or with `w_uv` the value-projected [num_tokens, num_heads, v] (W_UV applied
    in the merge kernel).
    `num_splits`: key splits per token (None: `mla_split_count`'s choice over `split_len`, the
    engine's max_model_len, and `graph_rows.row_bound` of the token count; tests force it).
    Padding tokens (positions of a padded row) attend over their row's pages harmlessly."""
    T, H, L = q_latent.shape
    R = q_pe.shape[-1]
    check_kv_scales(kv_cache.dtype, kv_scale)
    # The dtype the dots run in: the cache's, or q's for an fp8 cache (dequantized tiles).
    cdt = compute_dtype(kv_cache.dtype, q_latent.dtype)
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    block_h = 16  # a tl.dot needs 16 rows; heads past num_heads are masked
    head_blocks = triton.cdiv(H, block_h)
    split_len = split_len or c.max_seq_len
    if num_splits is None:
        bound = graph_rows.row_bound(T)
        num_splits = mla_split_count(bound, head_blocks, split_len, q_latent.device)
    out_dim = L if w_uv is None else w_uv.shape[1]
    out = torch.empty(T, H, out_dim, dtype=cdt, device=q_latent.device)
    if T == 0:
        return out
    block_l = max(16, triton.next_power_of_2(L))
    partials = num_splits > 1 or w_uv is not None
    if partials:
        ws_acc = torch.empty(T * H * num_splits, block_l, device=q_latent.device)
        ws_ml = torch.empty(T * H * num_splits, 2, device=q_latent.device)
    else:
        ws_acc = ws_ml = out  # unused
    kw = pdl.launch_kwargs(q_latent.device)
    fp32 = cdt == torch.float32
    # Short splits: 16-key tiles spread a short context over more programs.
    block_n = 32 if fp32 or split_len // num_splits >= 256 else 16
    _mla_attention_kernel[(T, head_blocks, num_splits)](
        q_latent, q_pe, kv_cache, out, ws_acc, ws_ml, c.block_table, c.token_req, c.positions,
        scale, H,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), out.stride(0), out.stride(1),
        c.block_table.stride(0),
        L=L, R=R,
        BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(R)),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        PAGE=kv_cache.shape[1],
        SPLITS=num_splits,
        PARTIALS=partials,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        # On a GPU 32-key tiles already fill the registers (sm_90: 255 and 32 bytes of stack;
        # 528 with the early tile); the CPU interpreter has none to fill.
        EARLY_KV=tunables().mla_early_kv and (block_n == 16 or q_latent.device.type == "cpu"),
        num_warps=4,
        **kw,
        kv_scale_ptr=kv_scale if kv_scale is not None else q_latent,
        **kv_quant_args(kv_cache.dtype),
    )  # fmt: skip
    if partials:
        mla_merge(out, ws_acc, ws_ml, num_splits, L, w_uv)
    return out


def mla_split_count(max_tokens: int, head_blocks: int, split_len: int, device: torch.device) -> int:
    """Key splits per (token, head block): 1 unless the grid leaves most SMs idle (decode and
    small verification batches) and keys are many (at least tunables().mla_min_keys_per_split a
    split); a power of two <= mla_max_splits. From host-side sizes only: `max_tokens` (`graph_rows.row_bound` of
    the token count: bg x q for a uniform batch of B padded to bg, eager or graph; rounded up to
    a power of two) and split_len (max_model_len), so graph and eager split alike."""
    programs = triton.next_power_of_2(max(max_tokens, 1)) * head_blocks
    sms = _num_sms(device.index) if device.type == "cuda" else 132
    t = tunables()
    want = min(t.mla_max_splits, split_len // t.mla_min_keys_per_split, sms // programs)
    return 1 if want < 2 else 1 << (want.bit_length() - 1)


@functools.cache
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
