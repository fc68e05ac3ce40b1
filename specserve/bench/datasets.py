"""Benchmark prompt sets: `random` (token ids from the tokenizer's vocabulary), `code` and `chat`
(prompt sets shipped in specserve/data), `custom` (a jsonl file with a `prompt` field),
`prefix_repetition` (vLLM's: random prompts sharing a few random prefixes) and `multi-turn`
(conversations whose every turn resends the history plus a new user message; the benchmark
sends a conversation's turns one after another, each after the previous answer).

Each loader is registered by name in DATASETS; a new set is one function.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class SampleRequest:
    prompt: str
    # Prompt length in tokens by the local tokenizer (0 if there is none); the server's usage
    # numbers replace it in the results when the server reports them.
    prompt_len: int
    expected_output_len: int
    # multi-turn: the conversation (-1: a lone request) and the turn within it; the prompt is
    # the turn's new user message, which the benchmark appends to the history it has seen.
    conversation: int = -1
    turn: int = 0


@dataclass
class DatasetArgs:
    name: str
    num_prompts: int
    output_len: int
    input_len: int = 1024
    path: str | None = None
    seed: int = 0
    # prefix_repetition (vLLM's flags and defaults)
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    prefix_output_len: int = 128
    # multi-turn
    num_conversations: int = 8
    num_turns: int = 4
    turn_input_len: int = 128
    turn_output_len: int = 64


Loader = Callable[[DatasetArgs, Any], list[SampleRequest]]
DATASETS: dict[str, Loader] = {}


def register(name: str) -> Callable[[Loader], Loader]:
    def deco(fn: Loader) -> Loader:
        DATASETS[name] = fn
        return fn

    return deco


def sample_requests(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    if args.name not in DATASETS:
        raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}; got {args.name!r}.")
    if args.num_prompts < 1 and args.name != "multi-turn":
        raise ValueError("--num-prompts must be >= 1.")
    return DATASETS[args.name](args, tokenizer)


def _random_vocab(tokenizer: Any, dataset: str) -> np.ndarray:
    if tokenizer is None:
        raise ValueError(f"the {dataset} dataset needs a tokenizer: pass --tokenizer DIR.")
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special])


def _random_text(
    tokenizer: Any, vocab: np.ndarray, n: int, rng: np.random.Generator
) -> tuple[str, int]:
    """About `n` tokens of random text and its length: ids drawn from the vocabulary, decoded,
    re-encoded and cut (so the server's tokenizer sees about `n` tokens), decoded again."""
    ids = rng.choice(vocab, size=n).tolist()
    ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:n]
    return tokenizer.decode(ids), len(ids)


@register("random")
def random_requests(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    """Prompts of `input_len` random tokens, as `vllm bench serve --dataset-name random`."""
    vocab = _random_vocab(tokenizer, "random")
    if args.input_len < 1:
        raise ValueError("--input-len must be >= 1.")
    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(args.num_prompts):
        text, n = _random_text(tokenizer, vocab, args.input_len, rng)
        out.append(SampleRequest(text, n, args.output_len))
    return out


@register("prefix_repetition")
def prefix_repetition_requests(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    """vLLM's `prefix_repetition`: `num_prefixes` random prefixes of `prefix_len` tokens, each
    followed by random suffixes of `suffix_len` tokens (num_prompts / num_prefixes of them),
    shuffled: what a prefix cache serves from memory."""
    vocab = _random_vocab(tokenizer, "prefix_repetition")
    for flag, v in (
        ("--prefix-repetition-prefix-len", args.prefix_len),
        ("--prefix-repetition-num-prefixes", args.num_prefixes),
        ("--prefix-repetition-output-len", args.prefix_output_len),
    ):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1.")
    if args.suffix_len < 0:
        raise ValueError("--prefix-repetition-suffix-len must be >= 0.")
    if args.num_prompts < args.num_prefixes:
        raise ValueError(
            f"--num-prompts ({args.num_prompts}) must be at least "
            f"--prefix-repetition-num-prefixes ({args.num_prefixes})."
        )
    rng = np.random.default_rng(args.seed)
    out = []
    per_prefix = args.num_prompts // args.num_prefixes
    for _ in range(args.num_prefixes):
        prefix, n_prefix = _random_text(tokenizer, vocab, args.prefix_len, rng)
        for _ in range(per_prefix):
            suffix, n_suffix = "", 0
            if args.suffix_len:
                suffix, n_suffix = _random_text(tokenizer, vocab, args.suffix_len, rng)
            out.append(SampleRequest(prefix + suffix, n_prefix + n_suffix, args.prefix_output_len))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


@register("multi-turn")
def multi_turn_requests(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    """`num_conversations` x `num_turns` new user messages of `turn_input_len` random tokens;
    turn t of a conversation is sent as its turns 0..t-1 (message, then the server's answer)
    and message t (`bench/serve.py`), so every turn shares the previous one's whole prompt."""
    vocab = _random_vocab(tokenizer, "multi-turn")
    for flag, v in (
        ("--multi-turn-num-conversations", args.num_conversations),
        ("--multi-turn-num-turns", args.num_turns),
        ("--multi-turn-input-len", args.turn_input_len),
        ("--multi-turn-output-len", args.turn_output_len),
    ):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1.")
    rng = np.random.default_rng(args.seed)
    out = []
    for c in range(args.num_conversations):
        for t in range(args.num_turns):
            text, n = _random_text(tokenizer, vocab, args.turn_input_len, rng)
            out.append(SampleRequest(text, n, args.turn_output_len, conversation=c, turn=t))
    return out


def read_jsonl_prompts(path: str) -> list[str]:
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not valid JSON: {e}") from e
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{n} needs a string `prompt` field.")
            prompts.append(row["prompt"])
    if not prompts:
        raise ValueError(f"{path} holds no prompts.")
    return prompts


def _from_prompts(prompts: list[str], args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    # Shuffled by --seed and repeated when the set is smaller than --num-prompts.
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(prompts)).tolist()
    picked = [prompts[order[i % len(order)]] for i in range(args.num_prompts)]
    out = []
    for p in picked:
        n = len(tokenizer.encode(p, add_special_tokens=False)) if tokenizer is not None else 0
        out.append(SampleRequest(p, n, args.output_len))
    return out


@register("custom")
def custom_requests(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    if args.path is None:
        raise ValueError("--dataset-name custom needs --dataset-path FILE.jsonl.")
    if not os.path.isfile(args.path):
        raise FileNotFoundError(f"--dataset-path {args.path!r} does not exist.")
    return _from_prompts(read_jsonl_prompts(args.path), args, tokenizer)


def packaged_prompts_path(name: str) -> str:
    """specserve/data/{name}_prompts.jsonl, shipped with the package."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the specserve package
    path = os.path.join(root, "data", f"{name}_prompts.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"the {name!r} prompt set ({path}) is not installed; use --dataset-name random or "
            "custom --dataset-path FILE.jsonl."
        )
    return path


@register("code")
def code_requests(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    return _from_prompts(read_jsonl_prompts(packaged_prompts_path("code")), args, tokenizer)


@register("chat")
def chat_requests(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    # The prompt is the user's message; the openai-chat backend sends it as one user turn.
    return _from_prompts(read_jsonl_prompts(packaged_prompts_path("chat")), args, tokenizer)
