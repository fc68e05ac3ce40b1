"""A step's grammar masks: built on the host for the requests that have a grammar, applied to
the target logits as a separate step before sampling or verification reads them.

Only batches holding a structured request build a `GrammarStep`; every other step runs exactly
as before (no upload, no launch). The runner builds it right after queueing the target
forward, so on CUDA the host fills the masks while the device runs the forward; the masks
then travel in one pinned, asynchronous upload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class GrammarStep:
    # [G] int64 batch rows of the structured requests that sample this step
    rows: torch.Tensor
    # [G, K + 1, ceil(vocab / 32)] int32: bit t of slot j = token t allowed at output slot j
    bitmask: torch.Tensor


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


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
        gr.fill_masks(gr.drafts[: s.num_draft], host, g * k1)
    rows = torch.tensor(idx, dtype=torch.int64)
    if cuda:
        rows = rows.pin_memory()
    return GrammarStep(
        rows.to(device, non_blocking=True),
        host.view(len(idx), k1, -1).to(device, non_blocking=True),
    )


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
