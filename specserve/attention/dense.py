"""Dense causal attention without a KV cache: the training path.

Training (the reference target, drafter heads) runs the engine's own model classes over a dense
[batch, seq] block of tokens, so there is one implementation of every layer. Tokens arrive
flattened as [batch * seq]; nothing is written to a cache and autograd flows through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specserve.attention.backend import AttentionBackend, CommonAttentionMetadata, ForwardContext


@dataclass
class DenseMeta:
    batch: int
    seq_len: int
    # [seq, seq] bool (True = attend) for a sliding window; None = plain causal
    mask: torch.Tensor | None


class DenseCausalBackend(AttentionBackend):
    name = "dense"

    def build(self, common: CommonAttentionMetadata, sliding_window: int | None) -> Any:
        raise NotImplementedError("the dense backend is built by dense_context(), not from pages")

    def forward(
        self,
        # [batch * seq, num_heads, head_dim]
        q: torch.Tensor,
        # [batch * seq, num_kv_heads, head_dim]
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: DenseMeta,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        B, S = meta.batch, meta.seq_len
        qh, kh, vh = (t.view(B, S, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        rep = qh.shape[1] // kh.shape[1]
        if rep > 1:  # GQA: each kv head serves `rep` query heads
            kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
        if meta.mask is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=meta.mask, scale=scale)
        return out.transpose(1, 2).reshape(B * S, q.shape[1], q.shape[2])


def dense_context(
    batch: int, seq_len: int, device: torch.device, windows: set[int | None] | None = None
) -> ForwardContext:
    """A ForwardContext for dense causal attention over `batch` rows of `seq_len` tokens."""
    i = torch.arange(seq_len, device=device)
    meta: dict[int | None, DenseMeta] = {}
    for w in windows or {None}:
        mask = None
        if w is not None:
            diff = i[:, None] - i[None, :]
            mask = (diff >= 0) & (diff < w)
        meta[w] = DenseMeta(batch, seq_len, mask)
    # Layers index kv_caches[kv_index] (-1 when no cache was allocated): one None serves all.
    return ForwardContext(backend=DenseCausalBackend(), kv_caches=[None], metadata=meta)


def dense_positions(batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[batch * seq] positions 0..seq-1 for every row."""
    return torch.arange(seq_len, device=device).repeat(batch)
