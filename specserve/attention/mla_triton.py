"""Triton MLA attention over the paged latent cache (torch reference: attention/mla.py).

One program per (query token, block of heads): the token's request comes from token_req, its
visible keys are positions 0..positions[t] (causal; a decode token sees the whole context, a
verification or prefill token its prefix). Keys stream in BLOCK_N-row tiles of the latent cache;
each tile is read once for all BLOCK_H heads (MLA's single shared K/V row is what makes a
head-block program cheap), scores = q_latent . c + q_pe . k_pe, online softmax, and the output
accumulates in the latent space [BLOCK_H, L].

  grid = (num_tokens, cdiv(num_heads, BLOCK_H))
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.backend import CommonAttentionMetadata


@triton.jit
def _mla_attention_kernel(
    q_lat_ptr,
    q_pe_ptr,
    kv_ptr,
    out_ptr,
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
    DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < num_heads
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    lm, rm = dl < L, dr < R
    req = tl.load(token_req_ptr + t)
    seq_len = tl.load(positions_ptr + t) + 1
    q_lat = tl.load(
        q_lat_ptr + t * stride_qlt + h[:, None] * stride_qlh + dl[None, :],
        mask=hm[:, None] & lm[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + t * stride_qpt + h[:, None] * stride_qph + dr[None, :],
        mask=hm[:, None] & rm[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, seq_len, BLOCK_N):
        s = start + offs_n
        sm = s < seq_len
        page = tl.load(block_table_ptr + req * stride_bt + s // PAGE, mask=sm, other=0)
        row = kv_ptr + page.to(tl.int64) * stride_kvb + (s % PAGE) * stride_kvs
        c = tl.load(row[:, None] + dl[None, :], mask=sm[:, None] & lm[None, :], other=0.0)
        k_pe = tl.load(row[:, None] + L + dr[None, :], mask=sm[:, None] & rm[None, :], other=0.0)
        # [BLOCK_H, BLOCK_N]
        qk = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        qk = tl.dot(q_pe, tl.trans(k_pe), qk, input_precision=DOT_PRECISION)
        qk = tl.where(sm[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
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
) -> torch.Tensor:
    """Causal latent attention; returns [num_tokens, num_heads, L] in q_latent's dtype.
    Padding tokens (positions of a padded row) attend over their row's pages harmlessly."""
    T, H, L = q_latent.shape
    R = q_pe.shape[-1]
    q_latent = q_latent.to(kv_cache.dtype)
    q_pe = q_pe.to(kv_cache.dtype)
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    out = torch.empty(T, H, L, dtype=kv_cache.dtype, device=q_latent.device)
    if T == 0:
        return out
    block_h = 16  # a tl.dot needs 16 rows; heads past num_heads are masked
    grid = (T, triton.cdiv(H, block_h))
    _mla_attention_kernel[grid](
        q_latent, q_pe, kv_cache, out, c.block_table, c.token_req, c.positions, scale, H,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), out.stride(0), out.stride(1),
        c.block_table.stride(0),
        L=L, R=R,
        BLOCK_L=max(16, triton.next_power_of_2(L)),
        BLOCK_R=max(16, triton.next_power_of_2(R)),
        BLOCK_H=block_h,
        BLOCK_N=32,
        PAGE=kv_cache.shape[1],
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
