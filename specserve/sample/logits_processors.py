"""Per-request logits processors applied to the raw target logits before sampling and
verification: min_tokens, logit_bias, then vLLM's repetition, frequency and presence penalties.

They run on every verified slot of a speculative step: slot j of a request is the target's
next-token distribution after [last token, d1..dj], so the penalties at slot j count the
drafts d1..dj as output tokens, exactly as plain decoding would count them once accepted. That
keeps verification lossless (greedy spec == greedy plain; sampled rows are verified against the
distribution plain decoding would sample from). Tokens are read from the persistent token
buffer, where the drafts already sit after the verified tokens.

The engine builds `LogitsProcessorInputs` only for steps where some request uses one of these
features; other steps skip this file entirely (no launch, no upload). Logprobs stay unprocessed
(vLLM's default): they are computed from the logits before this step.

Structured outputs: the grammar mask (structured/bitmask.py) is applied to the same logits at
the same slots; its -inf entries stay -inf through every processor here, so the order of the
two does not matter. min_tokens does not mask the stop tokens of a request with a grammar: the
grammar decides where the output ends (a grammar that allows only its stop token would leave
no token at all), as the engine ends such a request at the grammar's stop token.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.engine.request import Request


@dataclass
class LogitsProcessorInputs:
    # [B] int64 prompt length of each batch row (tokens before it are prompt tokens)
    prompt_lens: Tensor
    # [B] float32 each
    presence: Tensor
    frequency: Tensor
    repetition: Tensor
    # [B] int64: EOS / stop_token_ids are masked while the slot's output index is below it
    min_tokens: Tensor
    # [N] int64, [N] int64, [N] float32: logit_bias entries (batch row, token id, bias)
    bias_rows: Tensor
    bias_ids: Tensor
    bias_vals: Tensor
    # [M] int64, [M] int64: (batch row, token id) masked until min_tokens
    stop_rows: Tensor
    stop_ids: Tensor
    any_penalty: bool


def build_logits_processor_inputs(
    reqs: list[Request], eos_token_ids: Set[int], device: torch.device
) -> LogitsProcessorInputs | None:
    """The step's processor inputs (one upload each for ints and floats), or None when no
    request in the batch uses a processor."""
    if not any(r.sampling_params.uses_penalties for r in reqs):
        return None
    ints: list[list[int]] = [
        [],
        [],
        [],
        [],
        [],
        [],
    ]  # prompt_lens, min_tok, b_row, b_id, s_row, s_id
    floats: list[list[float]] = [[], [], [], []]  # presence, frequency, repetition, bias
    for b, r in enumerate(reqs):
        sp = r.sampling_params
        ints[0].append(r.num_prompt_tokens)
        ints[1].append(sp.min_tokens)
        floats[0].append(sp.presence_penalty)
        floats[1].append(sp.frequency_penalty)
        floats[2].append(sp.repetition_penalty)
        for tid, v in (sp.logit_bias or {}).items():
            ints[2].append(b)
            ints[3].append(tid)
            floats[3].append(v)
        if sp.min_tokens > 0 and r.num_output_tokens < sp.min_tokens and r.grammar is None:
            stops: Iterable[int] = set(sp.stop_token_ids or [])
            if not sp.ignore_eos:
                stops = set(stops) | set(eos_token_ids)
            for tid in stops:
                ints[4].append(b)
                ints[5].append(tid)
    B = len(reqs)
    n_bias, n_stop = len(ints[2]), len(ints[4])
    ip = torch.tensor([x for part in ints for x in part], dtype=torch.int64)
    fp = torch.tensor([x for part in floats for x in part], dtype=torch.float32)
    if device.type == "cuda":
        ip = ip.pin_memory().to(device, non_blocking=True)
        fp = fp.pin_memory().to(device, non_blocking=True)
    pl, mt, br, bi, sr, si = torch.split(ip, [B, B, n_bias, n_bias, n_stop, n_stop])
    pres, freq, rep, bv = torch.split(fp, [B, B, B, n_bias])
    return LogitsProcessorInputs(
        prompt_lens=pl,
        presence=pres,
        frequency=freq,
        repetition=rep,
        min_tokens=mt,
        bias_rows=br,
        bias_ids=bi,
        bias_vals=bv,
        stop_rows=sr,
        stop_ids=si,
        any_penalty=any(
            r.sampling_params.presence_penalty != 0.0
            or r.sampling_params.frequency_penalty != 0.0
            or r.sampling_params.repetition_penalty != 1.0
            for r in reqs
        ),
    )


def _output_counts(
    # [B, L] tokens at positions 0..L-1
    tokens: Tensor,
    # [B] int64
    prompt_lens: Tensor,
    # [B] int64 first position NOT counted
    end: Tensor,
    vocab: int,
) -> Tensor:
    """[B, V] float32 counts of the output tokens at positions [prompt_len, end)."""
    pos = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    counted = (pos >= prompt_lens[:, None]) & (pos < end[:, None])
    counts = torch.zeros(tokens.shape[0], vocab, dtype=torch.float32, device=tokens.device)
    return counts.scatter_add_(1, tokens.clamp(0, vocab - 1), counted.float())


def apply_logits_processors(
    # [B, S, V] raw target logits; slot j predicts the token at position out_pos0 + j
    logits: Tensor,
    # [rows, width] persistent token buffer: verified tokens, then this step's drafts
    token_ids: Tensor,
    # [B] persistent row of each batch row
    idx_mapping: Tensor,
    # [B] int64 position of slot 0's token
    out_pos0: Tensor,
    # host upper bound of out_pos0 + S - 1 over the batch (how many token columns to read)
    max_seq_len: int,
    lp: LogitsProcessorInputs,
) -> Tensor:
    """-> [B, S, V] float32 processed logits (a new tensor; `logits` is left as it was)."""
    B, S, V = logits.shape
    x = logits.float().clone()
    slot = torch.arange(S, device=x.device)
    if lp.stop_rows.numel():
        # Slot j's token is output number out_pos0 + j - prompt_len (0-based).
        out_idx = out_pos0[:, None] + slot[None, :] - lp.prompt_lens[:, None]
        early = (out_idx < lp.min_tokens[:, None]).float()  # [B, S]
        stop = torch.zeros(B, V, dtype=torch.float32, device=x.device)
        # Ids past the vocabulary (a stop id the model never emits) add nothing.
        stop.index_put_(
            (lp.stop_rows, lp.stop_ids.clamp(0, V - 1)),
            (lp.stop_ids < V).float(),
            accumulate=True,
        )
        x.masked_fill_((early[:, :, None] * stop[:, None, :]) > 0, float("-inf"))
    if lp.bias_rows.numel():
        bias = torch.zeros(B, V, dtype=torch.float32, device=x.device)
        bias.index_put_((lp.bias_rows, lp.bias_ids.clamp(0, V - 1)), lp.bias_vals, accumulate=True)
        x += bias[:, None, :]
    if not lp.any_penalty:
        return x
    width = min(max_seq_len, token_ids.shape[1])
    tokens = token_ids[idx_mapping, :width]
    counts = _output_counts(tokens, lp.prompt_lens, out_pos0, V)[:, None, :].repeat(1, S, 1)
    if S > 1:
        # Slot j also counts the drafts d1..dj, which sit at positions out_pos0 .. out_pos0+j-1.
        cols = (out_pos0[:, None] + slot[None, : S - 1]).clamp(max=token_ids.shape[1] - 1)
        drafts = token_ids[idx_mapping[:, None], cols].clamp(0, V - 1)  # [B, S-1]
        onehot = torch.zeros(B, S, V, dtype=torch.float32, device=x.device)
        onehot[:, 1:].scatter_(2, drafts[:, :, None], 1.0)
        counts += onehot.cumsum(dim=1)
    pos = torch.arange(width, device=x.device)[None, :]
    in_prompt = (pos < lp.prompt_lens[:, None]).float()
    prompt_mask = torch.zeros(B, V, dtype=torch.float32, device=x.device)
    prompt_mask.scatter_add_(1, tokens.clamp(0, V - 1), in_prompt)
    seen = (counts > 0) | (prompt_mask > 0)[:, None, :]
    rep = lp.repetition[:, None, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x -= lp.frequency[:, None, None] * counts
    x -= lp.presence[:, None, None] * (counts > 0).float()
    return x


__all__ = ["LogitsProcessorInputs", "apply_logits_processors", "build_logits_processor_inputs"]
