"""One step's inputs as the model runner uploads them (worker/input_batch.py builds them); the
drafters read them too, so they sit below every layer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StepInputs:
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    # Host copies the engine needs afterwards.
    num_draft_np: np.ndarray
    samples_np: np.ndarray
    # Device tensors (views into one uploaded buffer).
    # [B] persistent-state row of each batch row
    idx_mapping: torch.Tensor
    # [B + 1]
    query_start_loc: torch.Tensor
    # [T] batch row of each token
    token_req: torch.Tensor
    # [T]
    positions: torch.Tensor
    # [B, K + 1] flattened-token index of each verified slot (clamped to the request's last token)
    logits_indices: torch.Tensor
    # [B]
    num_draft: torch.Tensor
    # [B] position the token of output slot 0 lands at
    out_pos0: torch.Tensor
    # [B]
    seq_lens: torch.Tensor
    # [B] 1 where this step produces a token for the request (0 for a mid-prompt chunk)
    samples: torch.Tensor
    # [3, N] (row, position, token) of host-proposed drafts (n-gram), N may be 0
    host_drafts: torch.Tensor
    # [B] 1 where the host's start is an upper bound to correct on the device; None if no row
    start_on_device: torch.Tensor | None = None
