"""Training text for drafters: reading files, one token stream, batches and the draft vocabulary.

Everything here is deterministic: files are read in sorted order, batches are drawn from a
generator seeded by the caller, and frequency ties break on the lower token id.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")


def _read_jsonl(path: str) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            text = row.get("text", row.get("prompt")) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ValueError(f'{path}:{n}: a .jsonl row needs a string "text" or "prompt"')
            out.append(text)
    return out


def read_texts(paths: list[str]) -> list[str]:
    """Texts from files (plain text, .py, .jsonl with "text"/"prompt") and directories of them.

    Directories are walked in sorted order and contribute files ending in TEXT_SUFFIXES.
    """
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, names in os.walk(p):
                dirs.sort()
                files += [os.path.join(root, n) for n in sorted(names) if n.endswith(TEXT_SUFFIXES)]
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"--data: {p!r} is neither a file nor a directory")
    texts: list[str] = []
    for f in files:
        if f.endswith(".jsonl"):
            texts += _read_jsonl(f)
        else:
            with open(f, encoding="utf-8", errors="replace") as fh:
                texts.append(fh.read())
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"--data: no text found in {paths}")
    return texts


def tokenize(tokenizer: Any, docs: Sequence[str | list[int]]) -> list[list[int]]:
    """Token ids of each document: a text gets the tokenizer's BOS (if it adds one) and EOS; a
    list of ids (pre-tokenized, e.g. the target's own generations) is taken as it is."""
    texts = [d for d in docs if isinstance(d, str)]
    if not texts:
        return [list(d) for d in docs]
    enc = iter(tokenizer(texts, add_special_tokens=True)["input_ids"])
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [list(next(enc)) + eos if isinstance(d, str) else list(d) for d in docs]


def split_heldout(docs: list[list[int]], frac: float = 0.05) -> tuple[list[int], list[int]]:
    """(train stream, held-out stream): the last documents (at least one) are held out; a single
    document is split by tokens instead."""
    if len(docs) >= 2:
        n = max(1, int(len(docs) * frac))
        return [t for d in docs[:-n] for t in d], [t for d in docs[-n:] for t in d]
    doc = docs[0]
    cut = max(1, int(len(doc) * (1 - 2 * frac)))
    return doc[:cut], doc[cut:]


def prompts_from_stream(stream: list[int], num: int, length: int) -> list[list[int]]:
    """`num` prompts of `length` tokens taken at evenly spaced offsets of a held-out stream."""
    if not stream:
        return []
    length = min(length, len(stream))
    last = len(stream) - length
    starts = sorted({round(i * last / max(num - 1, 1)) for i in range(num)})
    return [stream[s : s + length] for s in starts]


def batch_starts(
    num_tokens: int, steps: int, batch_size: int, seq_len: int, seed: int
) -> torch.Tensor:
    """[steps, batch_size] window offsets into the token stream: the whole data order, drawn up
    front from `seed` (same seed, same batches; no host-to-device copy per step)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_tokens - seq_len + 1, (steps, batch_size), generator=gen)


def gather_windows(
    # [num_tokens] int64, on the training device
    stream: torch.Tensor,
    # [batch] int64 window offsets
    starts: torch.Tensor,
    seq_len: int,
) -> torch.Tensor:
    """[batch, seq_len] token windows."""
    return stream[starts[:, None] + torch.arange(seq_len, device=stream.device)]


def draft_vocab(
    # [num_tokens] int64
    stream: torch.Tensor,
    vocab_size: int,
    draft_vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's reduced vocabulary: the `draft_vocab_size` most frequent tokens of the data.

    Returns d2t [draft_vocab_size] int64 (draft id + d2t[draft id] = target id, draft ids in
    ascending target-id order) and t2d [vocab_size] bool (target id is in the draft vocabulary).
    """
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(
            f"draft_vocab_size must be in 1..{vocab_size} (the target's vocab), "
            f"got {draft_vocab_size}"
        )
    counts = torch.bincount(stream, minlength=vocab_size)[:vocab_size]
    # Descending count, ties to the lower id: a stable sort on -count over ascending ids.
    order = torch.sort(-counts, stable=True).indices
    ids = torch.sort(order[:draft_vocab_size]).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=ids.device)
    t2d[ids] = True
    return ids - torch.arange(draft_vocab_size, device=ids.device), t2d


def load_tokenizer(target_dir: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{target_dir}: no usable tokenizer ({e}); train-draft tokenizes text with the "
            "target's tokenizer, so the target directory needs its tokenizer files"
        ) from e


def training_data(
    target_dir: str,
    texts: Sequence[str | list[int]],
    eval_prompts: Sequence[str | list[int]] | None,
    seq_len: int,
    num_prompts: int,
    prompt_tokens: int,
) -> tuple[torch.Tensor, list[list[int]]]:
    """(training token stream [N] int64, evaluation prompts as token ids).

    Without `eval_prompts`, the prompts are windows of held-out documents (`split_heldout`).
    The target's tokenizer is loaded only when some document is a string.
    """
    if not texts:
        raise ValueError("texts: no training documents given")
    docs = list(texts) + list(eval_prompts or [])
    tok = load_tokenizer(target_dir) if any(isinstance(d, str) for d in docs) else None
    ids = tokenize(tok, texts)
    if eval_prompts is None:
        train_ids, heldout = split_heldout(ids)
        prompt_ids = prompts_from_stream(heldout, num_prompts, prompt_tokens)
    else:
        train_ids = [t for d in ids for t in d]
        prompt_ids = [
            list(p) if not isinstance(p, str) else tok(p, add_special_tokens=True)["input_ids"]
            for p in eval_prompts
        ]
    if len(train_ids) < seq_len:
        raise ValueError(
            f"seq_len {seq_len} is longer than the training data ({len(train_ids)} tokens); "
            "pass more data or a smaller seq_len"
        )
    return torch.tensor(train_ids, dtype=torch.int64), prompt_ids
