"""Per-request logits processors applied to the raw target logits before sampling and
verification: min_tokens, logit_bias, allowed_token_ids, bad_words, then vLLM's repetition,
frequency and presence penalties.

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

from specserve.request import Request


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
    # [A] int64, [A] int64: allowed_token_ids (batch row, token id); rows with none are free
    allow_rows: Tensor
    allow_ids: Tensor
    # [W] int64 batch row, [W] int64 length, [W, L] int64 token ids (padded with 0): the bad
    # words of the batch's requests (L: the longest)
    word_rows: Tensor
    word_lens: Tensor
    word_ids: Tensor
    any_penalty: bool


def build_logits_processor_inputs(
    reqs: list[Request], eos_token_ids: Set[int], device: torch.device
) -> LogitsProcessorInputs | None:
    """The step's processor inputs (one upload each for ints and floats), or None when no
    request in the batch uses a processor."""
    if not any(r.sampling_params.uses_logits_processors for r in reqs):
        return None
    # Host lists named as LogitsProcessorInputs' fields: one upload for the ints, one for the
    # floats, split back by the lists' own lengths.
    ints: dict[str, list[int]] = {
        name: []
        for name in ("prompt_lens", "min_tokens", "bias_rows", "bias_ids", "stop_rows")
        + ("stop_ids", "allow_rows", "allow_ids", "word_rows", "word_lens", "word_ids")
    }
    floats: dict[str, list[float]] = {
        name: [] for name in ("presence", "frequency", "repetition", "bias_vals")
    }
    width = max((len(w) for r in reqs for w in r.bad_words_token_ids), default=0)
    for b, r in enumerate(reqs):
        sp = r.sampling_params
        ints["prompt_lens"].append(r.num_prompt_tokens)
        ints["min_tokens"].append(sp.min_tokens)
        floats["presence"].append(sp.presence_penalty)
        floats["frequency"].append(sp.frequency_penalty)
        floats["repetition"].append(sp.repetition_penalty)
        for tid, v in (sp.logit_bias or {}).items():
            ints["bias_rows"].append(b)
            ints["bias_ids"].append(tid)
            floats["bias_vals"].append(v)
        if sp.min_tokens > 0 and r.num_output_tokens < sp.min_tokens and r.grammar is None:
            stops: Iterable[int] = set(sp.stop_token_ids or [])
            if not sp.ignore_eos:
                stops = set(stops) | set(eos_token_ids)
            for tid in stops:
                ints["stop_rows"].append(b)
                ints["stop_ids"].append(tid)
        for tid in sp.allowed_token_ids or []:
            ints["allow_rows"].append(b)
            ints["allow_ids"].append(tid)
        for word in r.bad_words_token_ids:
            ints["word_rows"].append(b)
            ints["word_lens"].append(len(word))
            ints["word_ids"] += word + [0] * (width - len(word))
    ip = torch.tensor([x for part in ints.values() for x in part], dtype=torch.int64)
    fp = torch.tensor([x for part in floats.values() for x in part], dtype=torch.float32)
    if device.type == "cuda":
        ip = ip.pin_memory().to(device, non_blocking=True)
        fp = fp.pin_memory().to(device, non_blocking=True)
    it = dict(zip(ints, torch.split(ip, [len(v) for v in ints.values()])))
    ft = dict(zip(floats, torch.split(fp, [len(v) for v in floats.values()])))
    it["word_ids"] = it["word_ids"].view(len(ints["word_rows"]), width)
    return LogitsProcessorInputs(
        **it,
        **ft,
        any_penalty=any(
            r.sampling_params.presence_penalty != 0.0
            or r.sampling_params.frequency_penalty != 0.0
            or r.sampling_params.repetition_penalty != 1.0
            for r in reqs
        ),
    )


def _mask_bad_words_(
    # [B, S, V] float32 logits, contiguous; masked in place
    x: Tensor,
    # [rows, width] persistent token buffer: verified tokens, then this step's drafts
    token_ids: Tensor,
    # [B] persistent row of each batch row
    idx_mapping: Tensor,
    # [B] int64 position of slot 0's token
    out_pos0: Tensor,
    lp: LogitsProcessorInputs,
) -> None:
    """vLLM's bad-words rule at every slot: a word of n tokens forbids its last one where the
    n - 1 tokens before the slot are the rest of it, all of them output tokens (the prompt does
    not count, as in vLLM); a one-token word forbids its token everywhere. Slot j's context
    ends with the drafts d1..dj, as for the penalties."""
    B, S, V = x.shape
    rows, lens, words = lp.word_rows, lp.word_lens, lp.word_ids  # [W], [W], [W, L]
    L = words.shape[1]
    k = torch.arange(max(L - 1, 1), device=words.device)
    slot = torch.arange(S, device=words.device)
    # Position of prefix token k of word w before slot j: [W, S, L-1].
    pos = (out_pos0[rows] - (lens - 1))[:, None, None] + slot[None, :, None] + k[None, None, :]
    in_prefix = k[None, None, :] < (lens - 1)[:, None, None]
    got = token_ids[idx_mapping[rows][:, None, None], pos.clamp(0, token_ids.shape[1] - 1)]
    want = words[:, None, : k.numel()] if L > 1 else torch.zeros_like(got[:, :1])
    ok = (got == want) & (pos >= lp.prompt_lens[rows][:, None, None])
    hit = (ok | ~in_prefix).all(dim=2)  # [W, S]
    last = words.gather(1, (lens - 1)[:, None]).clamp(0, V - 1)  # [W, 1]
    # A min with -inf where a word fires and +inf where not: no [B, S, V] mask, no host sync,
    # and two words ending in one token combine whichever order they land in.
    flat = (rows[:, None] * S + slot[None, :]) * V + last  # [W, S]
    fill = torch.where(hit, float("-inf"), float("inf"))
    x.view(-1).scatter_reduce_(0, flat.flatten(), fill.flatten(), reduce="amin")


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
    x = logits.float().clone(memory_format=torch.contiguous_format)  # viewed flat below
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
    if lp.allow_rows.numel():
        allowed = torch.zeros(B, V, dtype=torch.bool, device=x.device)
        allowed[lp.allow_rows, lp.allow_ids.clamp(0, V - 1)] = True
        free = ~allowed.any(dim=1)  # rows without allowed_token_ids
        x.masked_fill_(~(allowed | free[:, None])[:, None, :], float("-inf"))
    if lp.word_rows.numel():
        _mask_bad_words_(x, token_ids, idx_mapping, out_pos0, lp)
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
