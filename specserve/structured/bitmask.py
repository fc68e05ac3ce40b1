"""A step's grammar masks: built on the host for the requests that have a grammar, applied to
the target logits as a separate step before sampling or verification reads them.

Only batches holding a structured request build a `GrammarStep`; every other step runs exactly
as before (no upload, no launch). The runner builds it right after queueing the target
forward, so on CUDA the host fills the masks while the device runs the forward; the masks
then travel in one pinned, asynchronous upload.

Under tensor parallelism only rank 0 holds the matchers: it sends each step's mask rows to the
other ranks (worker/tp_step.py), whose mirror requests hold them as a `SentMasks` in place of a
grammar, so every rank's `build_grammar_step` writes the very same masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from specserve.request import RequestGrammar


@dataclass
class GrammarStep:
    # [G] int64 batch rows of the structured requests that sample this step
    rows: torch.Tensor
    # [G, K + 1, ceil(vocab / 32)] int32: bit t of slot j = token t allowed at output slot j
    bitmask: torch.Tensor


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass
class SentMasks:
    """One request's masks for one step, walked by rank 0's matcher: the `RequestGrammar` of a
    worker rank's mirror request (and of rank 0's own launch of that step). The runner only
    reads `drafts` and `fill_masks`; the engine, which commits, runs on rank 0 alone."""

    # The drafts the step verifies (rank 0's, already cut to the step's count).
    drafts: list[int]
    # [len(drafts) + 1, ceil(vocab / 32)] int32 host rows, as `fill_masks` writes them
    rows: torch.Tensor
    # (The rest of `RequestGrammar`: rank 0's engine alone ends and commits requests; the
    # rows already follow each tree node's path.)
    is_terminated: bool = False
    parents: list[int] | None = None

    @classmethod
    def walk(cls, grammar: RequestGrammar, num_draft: int, vocab_size: int) -> SentMasks:
        """The rows `grammar.fill_masks` writes for this step's drafts (which it leaves
        tentatively accepted, as the runner's own walk would)."""
        drafts = grammar.drafts[:num_draft]
        rows = torch.full((len(drafts) + 1, bitmask_width(vocab_size)), -1, dtype=torch.int32)
        fill_request_masks(grammar, num_draft, rows, 0)
        return cls(drafts, rows)

    def fill_masks(
        self,
        drafts: list[int],
        # [rows, ceil(vocab / 32)] int32 host bitmask; rows start .. start + len(drafts) written
        bitmask: torch.Tensor,
        start: int,
    ) -> None:
        if len(drafts) + 1 != len(self.rows):
            raise RuntimeError(f"masks for {len(self.rows) - 1} drafts, {len(drafts)} scheduled")
        bitmask[start : start + len(self.rows)] = self.rows

    def commit(self, tokens: list[int], num_accepted: int) -> int:
        raise RuntimeError("only rank 0's grammar commits tokens")

    def valid_prefix(self, drafts: list[int]) -> int:
        raise RuntimeError("only rank 0's grammar checks drafts")


def build_grammar_step(
    scheduled: Sequence[Any], k1: int, vocab_size: int, device: torch.device
) -> GrammarStep | None:
    """Masks for every output slot of every structured request that samples in this step (the
    drafts it verifies walked through its matcher); None if there is none."""
    idx = [i for i, s in enumerate(scheduled) if s.samples and getattr(s.req, "grammar", None)]
    if not idx:
        return None
    cuda = device.type == "cuda"
    host = torch.full((len(idx) * k1, bitmask_width(vocab_size)), -1, dtype=torch.int32)
    if cuda:
        host = host.pin_memory()
    for g, i in enumerate(idx):
        s = scheduled[i]
        gr = s.req.grammar
        if len(gr.drafts) < s.num_draft:
            raise RuntimeError(
                f"request {s.req.request_id}: {s.num_draft} drafts scheduled, "
                f"{len(gr.drafts)} known to its grammar"
            )
        fill_request_masks(gr, s.num_draft, host, g * k1)
    rows = torch.tensor(idx, dtype=torch.int64)
    if cuda:
        rows = rows.pin_memory()
    return GrammarStep(
        rows.to(device, non_blocking=True),
        host.view(len(idx), k1, -1).to(device, non_blocking=True),
    )


def fill_request_masks(
    grammar: RequestGrammar,
    num_draft: int,
    # [rows, ceil(vocab / 32)] int32 host bitmask; rows start .. start + num_draft written
    bitmask: torch.Tensor,
    start: int,
) -> None:
    """One request's rows for a step verifying its first `num_draft` drafts: a chain's, or a
    draft tree's (each node's row after its own path from the root)."""
    drafts = grammar.drafts[:num_draft]
    if grammar.parents is not None:
        grammar.fill_tree_masks(drafts, grammar.parents[: num_draft + 1], bitmask, start)
    else:
        grammar.fill_masks(drafts, bitmask, start)


def apply_grammar_bitmask_(
    # [B, K + 1, V] logits (any float dtype), masked in place
    logits: torch.Tensor,
    step: GrammarStep,
) -> None:
    """Set the logits of tokens the grammar forbids to -inf, for the structured rows only."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    # [G, K + 1, W * 32] -> [G, K + 1, V]; int32 >> 31 keeps the sign bit, & 1 reads it.
    allowed = ((step.bitmask[..., None] >> shifts) & 1).bool().flatten(-2)[..., :vocab]
    logits[step.rows] = logits[step.rows].masked_fill(~allowed, float("-inf"))
