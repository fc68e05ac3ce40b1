"""Parallel token drafting (PTD): an EAGLE-3 head that proposes K tokens in ONE forward.

Checkpoint layout (written by `specserve train-draft --method ptd`, read by the PTD drafter):
  an EAGLE-3 directory (model.safetensors: midlayer.*, fc.weight, norm.weight, lm_head.weight,
  d2t, t2d; config.json: draft_vocab_size, target_hidden_size, eagle_config) whose config.json
  also holds
    "parallel_draft": true
    "ptd_token_id":   a target token id; its (target) embedding is the mask slots' token input
    "ptd_max_k":      K the head was trained for (1 accepted slot + K - 1 mask slots)
  and one more tensor
    mask_hidden [hidden_size]   the hidden input at mask slots, in place of fc(aux taps)

Positions follow the EAGLE shift: the drafter's input at position p is token p + 1 paired with
the target's hidden at p. With p the position of the last slot that has a target hidden (so
token p + 1 is the newest accepted token):
  accepted slot, position p        token p + 1,   hidden fc(aux of p)  -> predicts d1
  mask slot j,   position p + j    ptd_token_id,  mask_hidden          -> predicts d_{j+1}
  for j = 1 .. K - 1 (d_i is the draft for position p + 1 + i).
Mask slots attend causally to every earlier slot: the accepted context (its KV comes from
target hidden states, as in an EAGLE-3 draft prefill) and the earlier mask slots of the same
forward. Training (`unrolled_loss`, step k = mask slot k, `UnrolledBackend` for the mask)
follows this exactly; the head's accepted slot is an ordinary EAGLE-3 step 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specserve.train.heads import Eagle3Method

if TYPE_CHECKING:
    from specserve.train.drafter import DraftTrainConfig


def mask_token_id(tcfg: dict[str, Any]) -> int:
    """The pad token when the target has one (rare in text), else EOS, else 0."""
    for key in ("pad_token_id", "eos_token_id"):
        v = tcfg.get(key)
        v = v[0] if isinstance(v, list) and v else v
        if isinstance(v, int) and 0 <= v < tcfg["vocab_size"]:
            return v
    return 0


class PTDMethod(Eagle3Method):
    """EAGLE-3 training whose steps 1..K-1 are mask slots (see the layout above): same loop,
    same `UnrolledBackend` attention, only the step inputs differ."""

    def build_config(
        self, tcfg: dict[str, Any], cfg: DraftTrainConfig, stream: torch.Tensor
    ) -> dict[str, Any]:
        self.ptd_token_id = mask_token_id(tcfg)
        # Small: the midlayer's hidden_norm rescales it; the residual starts near zero.
        self.mask_hidden = nn.Parameter(torch.randn(tcfg["hidden_size"]) * 0.02)
        c = super().build_config(tcfg, cfg, stream)
        c.update(parallel_draft=True, ptd_token_id=self.ptd_token_id, ptd_max_k=cfg.num_steps)
        return c

    def step_inputs(
        self, k: int, ids: torch.Tensor, carry: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if k == 0:
            return ids, carry
        # Mask slot k: no token, no hidden state of its own; only attention links it to the
        # accepted context and the earlier mask slots.
        mask_ids = torch.full_like(ids, self.ptd_token_id)
        return mask_ids, self.mask_hidden.expand(ids.shape[0], -1)

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        return {"mask_hidden": self.mask_hidden}

    @classmethod
    def spec_config(cls, out_dir: str) -> dict[str, Any]:
        return {"method": "eagle3", "model": out_dir, "parallel_draft": True}
