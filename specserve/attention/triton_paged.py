"""The Triton attention backend: paged attention (paged_attention.py) with the KV write it needs
(kv_write.py, rope_kv_write.py, or inside the attention kernel for decode and verification
batches), MLA through mla_fused.py / mla_triton.py, and an in-place, graph-safe metadata advance
for draft loops."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from specserve.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    ForwardContext,
)
from specserve.attention.kv_quant import compute_dtype
from specserve.attention.kv_write import reshape_and_cache
from specserve.attention.launch_policy import fuses_kv_write
from specserve.attention.paged_attention import paged_attention
from specserve.attention.rope_kv_write import rope_and_cache_
from specserve.ops.fused import qk_norm_
from specserve.ops.spec_kernels import advance_decode_metadata_


@dataclass
class TritonAttentionMetadata:
    common: CommonAttentionMetadata
    sliding_window: int | None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_inplace_advance = True
    fuses_rope = True
    fuses_qk_norm = True
    # The paged kernel's TREE variant; MLA (mla_forward) and the fused RoPE + KV write refuse.
    supports_tree = True

    def __init__(self, max_model_len: int | None = None) -> None:
        # Split-KV counts follow max_model_len, the bound every captured graph is built for.
        self.max_model_len = max_model_len

    @classmethod
    def create(
        cls, device: torch.device, max_model_len: int | None = None
    ) -> TritonAttentionBackend:
        # TRITON_INTERPRET=1 runs the kernels on CPU tensors (tests: the whole engine through
        # the Triton attention path without a GPU).
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend=triton needs a CUDA device (or TRITON_INTERPRET=1); "
                "use attention_backend=torch or auto."
            )
        return cls(max_model_len)

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
        # [2] fp32 (key, value scales): only with an fp8 cache (attention/kv_quant.py)
        kv_scales: torch.Tensor | None = None,
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
        # The fused kernel rotates by the metadata's positions: only when RoPE's are those, and
        # never for a tree (its nodes turn by tree_positions; paged_attention refuses).
        same_pos = rope is not None and rope[0].data_ptr() == c.positions.data_ptr()
        same_pos = same_pos and c.tree_mask is None
        if same_pos and rope[0].shape == c.positions.shape and k.stride(-1) == 1:
            cdt = compute_dtype(kv_cache.dtype, q.dtype)
            if fuses_kv_write(q.shape[1], k.shape[1], c.max_query_len, q.shape[2], cdt):
                new_kv = (k, v, rope[1], rope[2])
        if new_kv is None and qk_norm is not None:  # not fusable here: the qk-norm kernel
            q, k = qk_norm_(q, k, *qk_norm)
            qk_norm = None
        if new_kv is None and rope is not None:
            rope_and_cache_(rope[0], q, k, v, rope[1], rope[2], kv_cache, c.slot_mapping, kv_scales)
        elif new_kv is None:
            reshape_and_cache(k, v, kv_cache, c.slot_mapping, kv_scales)
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
            kv_scales=kv_scales,
        )

    def forward_mla(
        self,
        # [num_tokens]
        positions: torch.Tensor,
        # [num_tokens, num_heads, qk_nope_head_dim + qk_rope_head_dim]: not rotated
        q: torch.Tensor,
        # [num_tokens, kv_lora_rank + qk_rope_head_dim]: latent not normed, k_pe not rotated
        kv_a: torch.Tensor,
        # attention.mla.MLAWeights
        weights: Any,
        # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        kv_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
    ) -> torch.Tensor:
        """MLA through the Triton kernels; split-KV counts follow max_model_len, as paged
        attention's."""
        from specserve.attention.mla import mla_forward

        return mla_forward(
            positions, q, kv_a, weights, kv_cache, meta.common, True, self.max_model_len
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
    if c.tree_mask is not None:  # tree fields do not advance with positions
        raise ValueError("a draft tree's metadata cannot advance in place: build it again")
    advance_decode_metadata_(
        c.positions, c.seq_lens, c.slot_mapping, c.block_table, c.token_req, block_size
    )
    # Host-side bound stays an upper bound on seq_lens (eager callers may read it).
    c.max_seq_len += 1
