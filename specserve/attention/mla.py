"""Multi-head latent attention (MLA) over the paged latent cache: the torch reference.

An MLA layer caches, per token, the normed KV latent c (kv_lora_rank) and the rotated rotary
key k_pe (qk_rope_head_dim) in one row of `kv_cache` [num_blocks, block_size, L + R]: the
same row serves every head. With the key and value up-projections absorbed into the query
and output projections (models/mla.py), attention runs in the latent space:

    score(h, s) = (q_latent[h] . c[s] + q_pe[h] . k_pe[s]) * scale
    out[h]      = sum_s softmax(score)[h, s] * c[s]           (then W_UV, o_proj)

Decode, verification and prefill all take this path (the kernel in attention/mla_triton.py
for CUDA); nothing ever expands per-head K/V.
"""

from __future__ import annotations

import torch

from specserve.attention.backend import CommonAttentionMetadata


def write_latent(
    # [num_blocks, block_size, L + R]
    kv_cache: torch.Tensor,
    # [num_tokens, L]
    kv_c: torch.Tensor,
    # [num_tokens, R]
    k_pe: torch.Tensor,
    # [num_tokens] int64, -1 = padding
    slot_mapping: torch.Tensor,
) -> None:
    # NOTE: slot -1 is the last slot of the reserved null block (as attention.backend.write_kv).
    nb, bs, d = kv_cache.shape
    row = torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype)
    kv_cache.view(nb * bs, d)[slot_mapping] = row


def mla_attention_ref(
    # [num_tokens, num_heads, L]: q_nope absorbed through W_UK
    q_latent: torch.Tensor,
    # [num_tokens, num_heads, R]: rotated
    q_pe: torch.Tensor,
    # [num_blocks, block_size, L + R]
    kv_cache: torch.Tensor,
    c: CommonAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal latent attention of every token over its request's cached rows (this step's
    rows already written). Returns [num_tokens, num_heads, L] in q_latent's dtype."""
    T, H, L = q_latent.shape
    bs = kv_cache.shape[1]
    nblk = (c.max_seq_len + bs - 1) // bs
    # [B, nblk * bs, L + R]: each request's pages gathered into one run.
    kv = kv_cache[c.block_table[:, :nblk].long()].flatten(1, 2).float()
    B, S = kv.shape[0], kv.shape[1]
    qsl = c.query_start_loc.long()
    offset = torch.arange(T, device=q_latent.device) - qsl[c.token_req]
    q = torch.cat([q_latent, q_pe], dim=-1).float()
    qp = q.new_zeros(B, c.max_query_len, H, q.shape[-1])
    qp[c.token_req, offset] = q
    pos = torch.full((B, c.max_query_len), -1, dtype=torch.long, device=q.device)
    pos[c.token_req, offset] = c.positions
    scores = torch.einsum("bqhd,bsd->bhqs", qp, kv) * scale
    visible = torch.arange(S, device=q.device)[None, None, :] <= pos[:, :, None]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    # Padded query rows see nothing; keep them finite (their output is dropped).
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhqs,bsl->bqhl", probs, kv[..., :L])
    return out[c.token_req, offset].to(q_latent.dtype)


def mla_forward(
    # [num_tokens, num_heads, L]
    q_latent: torch.Tensor,
    # [num_tokens, num_heads, R]
    q_pe: torch.Tensor,
    # [num_tokens, L]
    kv_c: torch.Tensor,
    # [num_tokens, R]
    k_pe: torch.Tensor,
    # [num_blocks, block_size, L + R]
    kv_cache: torch.Tensor,
    c: CommonAttentionMetadata,
    scale: float,
    use_triton: bool = False,
    # the key count split-KV assumes (max_model_len; None: the batch's max_seq_len)
    split_len: int | None = None,
) -> torch.Tensor:
    """Write this step's latent rows, then attend (Triton kernel where asked, else torch)."""
    write_latent(kv_cache, kv_c, k_pe, c.slot_mapping)
    if use_triton:
        from specserve.attention.mla_triton import mla_attention

        return mla_attention(q_latent, q_pe, kv_cache, c, scale, split_len=split_len)
    return mla_attention_ref(q_latent, q_pe, kv_cache, c, scale)
