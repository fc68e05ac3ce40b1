"""MLA prefill through per-head keys and values expanded from the latent (vLLM's choice for MLA
prefill; reference: attention/mla.py's latent path, which it must equal).

k = [W_UK c, k_pe], v = W_UV c, then ordinary attention with nope + R = 256 channels a score and
v = 256 a value (GLM-4.7-Flash) instead of L + R = 576 and L = 512, at the price of the
expansion (S x H x (nope + v) x L multiply-adds for S context rows). Steps whose longest query
has at least `tunables().mla_expand_prefill_min_query` tokens take it (1024: on an H100,
`benchmarks/mla_prefill.py` at GLM-4.7-Flash's shape, time to first token of one prompt of 512 /
2048 / 8192 tokens: latent 39.5 / 80.1 / 817 ms, expanded 54.6 / 56.2 / 254 ms).
"""

from __future__ import annotations

import torch

from specserve.attention.backend import CommonAttentionMetadata
from specserve.attention.mla import (
    MLAWeights,
    gather_latent,
    gather_requests,
    prologue_unabsorbed,
)
from specserve.tunables import tunables


def expand_fits(c: CommonAttentionMetadata, w: MLAWeights, rope_dim: int) -> bool:
    """Whether `mla_forward` takes `mla_prefill_expanded` for this step (host sizes only)."""
    t = tunables()
    min_query = t.mla_expand_prefill_min_query
    if min_query is None or c.max_query_len < min_query:
        return False
    H, nope = w.w_uk.shape[0], w.nope
    per_row = H * (nope + rope_dim + w.w_uv.shape[1])
    return c.num_reqs * c.max_seq_len * per_row <= t.mla_expand_max_elements


def mla_prefill_expanded(
    # [num_tokens]
    positions: torch.Tensor,
    # [num_tokens, H, nope + R]
    q: torch.Tensor,
    # [num_tokens, L + R]
    kv_a: torch.Tensor,
    w: MLAWeights,
    # [num_blocks, block_size, L + R]
    kv_cache: torch.Tensor,
    c: CommonAttentionMetadata,
) -> torch.Tensor:
    """`mla_forward` through per-head K/V: this step's latent rows written as always, then
    every request's context rows gathered from the cache and expanded (k_nope = W_UK c,
    v = W_UV c; k_pe shared by the heads) and attended causally by position with SDPA.
    Returns [num_tokens, H, v] in q's dtype."""
    q_nope, q_pe = prologue_unabsorbed(positions, q, kv_a, w, kv_cache, c.slot_mapping)
    H, L = w.w_uk.shape[0], w.w_uk.shape[2]
    R = q_pe.shape[-1]
    bs = kv_cache.shape[1]
    nblk = (c.max_seq_len + bs - 1) // bs
    # [B, S, L + R]: each request's pages gathered into one run (rows past its length unused).
    kv = gather_latent(kv_cache, c.block_table[:, :nblk], w.latent_scale).to(q.dtype)
    B, S = kv.shape[0], kv.shape[1]
    lat, k_pe = kv[..., :L], kv[..., L:]
    # [B, S, L] x [H, nope, L] -> [B, H, S, nope]; the same for W_UV: [B, H, S, v]
    k_nope = torch.einsum("bsl,hnl->bhsn", lat, w.w_uk)
    v = torch.einsum("bsl,hvl->bhsv", lat, w.w_uv)
    k = torch.cat([k_nope, k_pe[:, None].expand(B, H, S, R)], dim=-1)
    qp, offset = gather_requests(torch.cat([q_nope, q_pe], dim=-1), c)
    pos, _ = gather_requests(positions, c, fill=-1)
    # [B, 1, Q, S]: a key is visible to the queries at or after its position; padded query
    # rows (position -1) see key 0 only, so SDPA stays finite (their output is dropped).
    visible = torch.arange(S, device=q.device)[None, None, :] <= pos.clamp(min=0)[:, :, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        qp.transpose(1, 2), k, v, attn_mask=visible[:, None], scale=w.scale
    )  # [B, H, Q, v]
    return out.transpose(1, 2)[c.token_req, offset].to(q.dtype)
