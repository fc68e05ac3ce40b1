"""Training-time test: the target's signals and the drafter unrolled over its draft steps.

Per batch of token windows `t` [B, S]: the target's dense causal forward (no grad) gives the
final-norm hidden h, the aux taps (EAGLE-3) and the next-token distribution at every position.
The drafter then runs `num_steps` draft steps; step k at row i sits at position i + k, reads
token t[i+k+1] and, for k = 0, the target's hidden at i (through `combine_hidden`), for k > 0
its own carry from step k - 1, and is trained to match the target's distribution at position
i + k + 1. Attention in step k (`UnrolledBackend`): row i sees step-0 keys at rows <= i (what
the draft prefill left in the KV cache) and its own keys of steps 1..k (what the decode steps
wrote). Drafters with one module per step (multi-module MTP) get plain causal attention per
module instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specserve.attention.backend import AttentionBackend, ForwardContext
from specserve.attention.dense import dense_context, dense_positions
from specserve.models.drafters import Drafter
from specserve.models.llama import LlamaForCausalLM
from specserve.train.heads import DraftMethod

__all__ = [
    "TargetSignals",
    "UnrolledBackend",
    "target_signals",
    "unrolled_context",
    "unrolled_loss",
    "unrolled_outputs",
]


@dataclass
class UnrolledMeta:
    batch: int
    seq_len: int


class UnrolledBackend(AttentionBackend):
    """Dense attention for draft steps unrolled in training (EAGLE-3's training-time test).

    `kv_cache` is the layer's list of (k, v) [B, kv_heads, S, D] from the earlier steps of the
    same batch. Step 0 is plain causal; step n > 0 at row i sees step-0 keys at rows <= i and
    the keys of steps 1..n at row i only: the KV the engine's draft decode steps see.
    """

    name = "unrolled"

    def build(self, common: Any, sliding_window: int | None) -> Any:
        raise NotImplementedError("built by unrolled_context(), not from pages")

    def forward(
        self,
        # [B * S, num_heads, head_dim]
        q: torch.Tensor,
        # [B * S, num_kv_heads, head_dim]
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: Any,
        meta: UnrolledMeta,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if sliding_window is not None:
            raise ValueError("drafter heads train with full attention (no sliding window)")
        B, S = meta.batch, meta.seq_len
        qh, kh, vh = (t.view(B, S, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        kv_cache.append((kh, vh))
        n = len(kv_cache)
        kh = torch.cat([c[0] for c in kv_cache], 2)
        vh = torch.cat([c[1] for c in kv_cache], 2)
        rep = qh.shape[1] // kh.shape[1]
        if rep > 1:  # GQA: each kv head serves `rep` query heads
            kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
        if n == 1:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            i = torch.arange(S, device=q.device)
            # [S, S * n]: causal over step 0, then the diagonal of each later step
            mask = torch.cat([i[:, None] >= i[None, :]] + [i[:, None] == i[None, :]] * (n - 1), 1)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        return out.transpose(1, 2).reshape(B * S, q.shape[1], q.shape[2])


def unrolled_context(batch: int, seq_len: int, device: torch.device, layers: int) -> ForwardContext:
    """A fresh context: every attention layer (kv_index 0..layers-1) starts with no steps."""
    caches: list[Any] = [[] for _ in range(layers)]
    meta = {None: UnrolledMeta(batch, seq_len)}
    return ForwardContext(backend=UnrolledBackend(), kv_caches=caches, metadata=meta)


@dataclass
class TargetSignals:
    """What the drafter learns from, for one batch of [B, S] windows (no grad)."""

    # [B * S, hidden] final-norm hidden states; aux: EAGLE-3 taps, [B * S, hidden] each
    hidden: torch.Tensor
    aux: list[torch.Tensor]
    # [B, S] the target's greedy next token at every position
    greedy: torch.Tensor
    # [B, S] bool: the drafter's vocabulary holds `greedy` (always, without a draft vocab)
    valid: torch.Tensor
    # [B, S, draft vocab] next-token distribution restricted to the drafter's vocabulary
    probs: torch.Tensor
    # [B, S] its entropy: the reported loss is CE minus this (a KL; 0 = a perfect copy)
    entropy: torch.Tensor


@torch.no_grad()
def target_signals(
    dm: DraftMethod,
    target: LlamaForCausalLM,
    # [B, S]
    tokens: torch.Tensor,
) -> TargetSignals:
    """The target's dense causal forward: the same hidden states and aux taps the engine's
    model runner hands the drafter (`model(ids, positions, ctx, aux_layers)`)."""
    B, S = tokens.shape
    ctx = dense_context(B, S, tokens.device, target.sliding_windows())
    pos = dense_positions(B, S, tokens.device)
    hidden, aux = target(tokens.flatten(), pos, ctx, dm.aux_layers())
    logits = target.compute_logits(hidden).float()
    greedy = logits.argmax(-1).view(B, S)
    valid = torch.ones_like(greedy, dtype=torch.bool)
    if dm.draft_ids is not None:
        valid = dm.t2d[greedy]
        logits = logits[:, dm.draft_ids]
    logp = logits.log_softmax(-1).view(B, S, -1)
    probs = logp.exp()
    return TargetSignals(hidden, aux, greedy, valid, probs, -(probs * logp).sum(-1))


def unrolled_outputs(
    dm: DraftMethod,
    sig: TargetSignals,
    # [B, S]
    tokens: torch.Tensor,
) -> Iterator[tuple[Drafter, torch.Tensor]]:
    """Per draft step k: (module, its output [B, S - 1 - k, H]); row i's output stands for the
    draft at position i + k + 2."""
    B, S = tokens.shape
    dev = tokens.device
    pos = dense_positions(B, S, dev)
    h = dm.first_hidden(sig.hidden, sig.aux)
    shared = unrolled_context(B, S, dev, dm.num_attention_layers())
    for k in range(dm.num_steps):
        module = dm.module_for_step(k)
        ctx = shared if dm.reuse_module else unrolled_context(B, S, dev, dm.num_attention_layers())
        # Step k at row i reads token i + k + 1 (rows past the window read padding, unused).
        ids, h = dm.step_inputs(k, F.pad(tokens[:, k + 1 :], (0, k + 1)).flatten(), h)
        # A reused module drafts step k at position i + k (the engine advances draft positions);
        # chained MTP modules all sit at the row's own position i.
        out, h = module(ids, pos + k if dm.reuse_module else pos, h, ctx)
        yield module, out.view(B, S, -1)[:, : S - 1 - k]


def unrolled_loss(
    dm: DraftMethod,
    target: LlamaForCausalLM,
    # [B, S] token windows
    tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-step top-1 agreement with the target [num_steps]) over one batch."""
    B, S = tokens.shape
    sig = target_signals(dm, target, tokens)
    total, weights, accs = torch.zeros((), device=tokens.device), 0.0, []
    for k, (module, out) in enumerate(unrolled_outputs(dm, sig, tokens)):
        # Row i matches the target's distribution at position i + k + 1.
        z = module.draft_logits(out).float()
        kl = -(sig.probs[:, k + 1 :] * z.log_softmax(-1)).sum(-1) - sig.entropy[:, k + 1 :]
        mask = sig.valid[:, k + 1 :].float()
        loss_k = (kl * mask).sum() / mask.sum().clamp_min(1.0)
        if dm.feature_loss_weight:
            feat = sig.hidden.view(B, S, -1)[:, k + 1 :].float()
            loss_k = loss_k + dm.feature_loss_weight * F.smooth_l1_loss(out.float(), feat)
        # Later steps count less (SpecForge's 0.8^k): their inputs are noisier.
        total, weights = total + 0.8**k * loss_k, weights + 0.8**k
        with torch.no_grad():
            agree = module.to_target_ids(z.argmax(-1)) == sig.greedy[:, k + 1 :]
            accs.append(agree.float().mean())
    return total / weights, torch.stack(accs)
