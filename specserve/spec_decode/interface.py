"""The speculator interface, and what a speculator needs from the model runner that drives it.

Speculators are written against `DraftRunner`, not the worker's `ModelRunner` (which satisfies
it), so spec_decode sits below worker: the runner calls into speculators, never the reverse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from specserve.attention.backend import AttentionBackend, CommonAttentionMetadata, ForwardContext
from specserve.config import EngineConfig

if TYPE_CHECKING:
    from specserve.spec_decode.drafting import TargetStep


class RequestBuffers(Protocol):
    """The runner's persistent per-request device state (worker/request_states.py)."""

    # [num_rows, width] each row's token ids; drafts are written after the last verified token
    token_ids: torch.Tensor
    # [num_rows, max_blocks_per_req] int32 KV block ids, shared by the target's and the
    # drafter's layers
    block_table: torch.Tensor
    # rows of the persistent state: max_num_seqs + 1
    num_rows: int
    # the row that padded batch rows point at; writes to it are discarded
    scratch_row: int
    # [num_rows] int64 positions below which a row's KV is read-only: its prefix-cache hit,
    # shared with other requests (0 without one)
    kv_floor: torch.Tensor


class DraftRunner(Protocol):
    """The model runner as a speculator sees it."""

    config: EngineConfig
    device: torch.device
    block_size: int
    max_model_len: int
    vocab_size: int
    backend: AttentionBackend
    states: RequestBuffers

    def forward_context(self, common: CommonAttentionMetadata) -> ForwardContext:
        """The attention context of a forward over `common` (KV caches, windows)."""
        ...


# `propose`'s num_drafts for a step whose drafter does not run at all (the adaptive budget's
# k = 0 once the drafter's KV is no longer kept): no drafts, and the drafter's KV keeps holes at
# these positions. 0 runs the draft prefill only (the KV stays complete).
NO_DRAFTER = -1


class Speculator:
    """A drafter and how it proposes: the runner calls these hooks and nothing else.

    Device speculators (spec_decode/drafting.py: the autoregressive loop, parallel drafting,
    multi-layer MTP) write drafts into the runner's token buffer in `propose`; host ones (n-gram)
    return them from `propose_host` for the scheduler to send with the next step.
    """

    # Drafts come from the host (propose_host), not from a device forward (propose).
    proposes_on_host: ClassVar[bool] = False
    # The runner captures this speculator's drafting in CUDA graphs (worker/draft_graphs.py).
    graph_capturable: ClassVar[bool] = False
    # `propose(num_drafts=0)` only brings the drafter's KV up to date, for a small share of a
    # plain step: the adaptive budget's k = 0 then runs it, so that drafting resumes from
    # complete KV. False: k = 0 runs no drafter, its KV keeps holes (lower acceptance after a
    # switch back, never other outputs).
    tracks_kv_at_zero: ClassVar[bool] = False
    # The drafter module (its KV layers share the target's block pool), or None.
    model: Any = None
    # Draft trees: the drafter's TreeDrafter (spec_decode/tree.py), whose `state` holds each
    # request's tree; None for chains.
    tree: Any = None

    def bind_rows(self, num_rows: int) -> None:
        """Allocate per-request state for the runner's `num_rows` persistent rows."""

    @property
    def kv_lookahead(self) -> int:
        """How many tokens after position p the drafter's KV at p depends on (and, at most,
        how far behind the verified tokens a step may rewrite it): the prefix cache keys a block
        by them and registers it only once they are final (engine/kv_cache.py). 0: no drafter
        KV, or KV at p from tokens up to p (a draft model)."""
        return 0

    def sliding_windows(self) -> set[int | None]:
        """The drafter's attention windows (None: full attention)."""
        return set()

    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the drafter reads (EAGLE-3)."""
        return ()

    # rows: [B] persistent rows; returns [B, K, vocab] or None when verification needs none
    def draft_probs(self, rows: torch.Tensor) -> torch.Tensor | None:
        return None

    def propose(self, runner: DraftRunner, t: TargetStep, num_drafts: int | None = None) -> None:
        """Write the next step's drafts into the token buffer on the device. `num_drafts`: how
        many the next step will verify (None: all K)."""

    def propose_host(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """The next step's drafts from the host, for host speculators."""
        raise NotImplementedError(f"{type(self).__name__} drafts on the device")
