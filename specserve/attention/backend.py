"""Attention backend interface: common metadata in, backend-specific metadata out.

The runner builds one `CommonAttentionMetadata` per forward (target, draft prefill, each draft
decode step). Each backend's `build` derives what its kernels need; that derived state may depend
on positions (e.g. sliding-window bounds), so anything that advances positions must rebuild it or
call `advance_decode_` (graph-safe, in place) where the backend supports it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CommonAttentionMetadata:
    # [num_reqs + 1] int32: token offsets of each request in the flattened batch
    query_start_loc: torch.Tensor
    # [num_reqs] int32: context length including this step's tokens
    seq_lens: torch.Tensor
    # [num_tokens] int64
    positions: torch.Tensor
    # [num_reqs, max_blocks_per_req] int32
    block_table: torch.Tensor
    # [num_tokens] int64; -1 for padding tokens (their KV goes to the null slot)
    slot_mapping: torch.Tensor
    # [num_tokens] int64: batch row of each token
    token_req: torch.Tensor
    num_reqs: int
    num_tokens: int
    # Host-side upper bounds (never read back from the device).
    max_query_len: int
    max_seq_len: int
    # Tree attention (draft trees, spec_decode/tree.py); None: plain causal. [num_tokens] int64
    # each: the key index where the token's tree starts (keys from there on are visible only
    # through the token's bits, bit i = key tree_start + i; a huge value: no tree), the
    # token's ancestor-or-self bitmask, and its rotary position (root position + depth, which
    # is what sliding windows measure from). Keys inside the tree skip the window test (the
    # runner checks every window is longer than a tree is deep).
    tree_start: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    tree_positions: torch.Tensor | None = None


@dataclass
class ForwardContext:
    """What a model forward needs for attention; passed explicitly, never global."""

    backend: AttentionBackend
    # One KV tensor per attention layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: list[torch.Tensor]
    # Backend metadata per sliding window (None = full attention).
    metadata: dict[int | None, Any] = field(default_factory=dict)
    # calculate_kv_scales: kv_index of the layers whose fp8 KV scales this (eager, prefill)
    # forward computes from its keys and values; each removes itself (the runner's set).
    kv_scales_todo: set[int] | None = None

    def meta(self, sliding_window: int | None) -> Any:
        return self.metadata[sliding_window]


class AttentionBackend(ABC):
    name: str = "abstract"
    # True when `advance_decode_` can update metadata inside a captured CUDA graph.
    supports_inplace_advance: bool = False
    # True when `forward` takes `rope=(positions, cos, sin)` with q and k not yet rotated and
    # applies the rotary embedding inside its KV write (one kernel instead of two per layer).
    fuses_rope: bool = False
    # True when `forward` also takes `qk_norm=(q_weight, k_weight, q_eps, k_eps)` with `rope`:
    # q and k not yet per-head RMS-normed (Qwen3's q_norm / k_norm); it norms them before the
    # rotation (inside the attention kernel where it fuses the RoPE, else with ops.qk_norm_).
    fuses_qk_norm: bool = False
    # True when build/forward honour CommonAttentionMetadata's tree fields (draft trees).
    supports_tree: bool = False

    @classmethod
    def create(cls, device: torch.device, max_model_len: int | None = None) -> AttentionBackend:
        """This backend for `device` (attention.registry.get_attn_backend calls it);
        `max_model_len`: the longest sequence a forward may see."""
        return cls()

    @abstractmethod
    def build(self, common: CommonAttentionMetadata, sliding_window: int | None) -> Any:
        """Derive this backend's metadata from the common metadata."""

    @abstractmethod
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
        meta: Any,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Write k/v at meta's slot mapping, then attend. Returns [num_tokens, num_heads, head_dim].
        Layers with attention sinks also pass `sinks=` ([num_heads] logits); a backend without
        them does not accept the keyword, so such a model fails loudly, not silently wrong."""

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
        meta: Any,
    ) -> torch.Tensor:
        """MLA (attention/mla.py): norm and rotate, write the latent rows, attend in the latent
        space, apply W_UV. Returns [num_tokens, num_heads, v_head_dim]. Every backend's
        metadata carries `common`. Here the torch path; the Triton backend overrides it."""
        from specserve.attention.mla import mla_forward

        return mla_forward(positions, q, kv_a, weights, kv_cache, meta.common)

    def advance_decode_(self, meta: Any, block_size: int) -> None:
        """Every request advanced by one decode token: update `meta` in place (graph-safe)."""
        raise NotImplementedError(f"{self.name} has no in-place metadata update")

    def advance_context_(self, ctx: ForwardContext, block_size: int) -> None:
        """Advance every window's metadata of a single-token-per-request context in place."""
        for meta in ctx.metadata.values():
            self.advance_decode_(meta, block_size)


def build_forward_context(
    backend: AttentionBackend,
    common: CommonAttentionMetadata,
    kv_caches: list[torch.Tensor],
    sliding_windows: set[int | None],
) -> ForwardContext:
    meta = {w: backend.build(common, w) for w in sliding_windows}
    return ForwardContext(backend=backend, kv_caches=kv_caches, metadata=meta)
