"""Benchmark prompt sets: `random` (token ids from the tokenizer's vocabulary), `code` and `chat`
(prompt sets shipped in specserve/data), `custom` (a jsonl file with a `prompt` field).

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


@dataclass
class DatasetArgs:
    name: str
    num_prompts: int
    output_len: int
    input_len: int = 1024
    path: str | None = None
    seed: int = 0


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
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1.")
    return DATASETS[args.name](args, tokenizer)


@register("random")
def random_requests(args: DatasetArgs, tokenizer: Any) -> list[SampleRequest]:
    """Prompts of `input_len` random tokens, as `vllm bench serve --dataset-name random`: ids
    drawn from the vocabulary (special tokens excluded), decoded to text, re-encoded and cut,
    so the server's tokenizer sees about `input_len` tokens."""
    if tokenizer is None:
        raise ValueError("the random dataset needs a tokenizer: pass --tokenizer DIR.")
    if args.input_len < 1:
        raise ValueError("--input-len must be >= 1.")
    special = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special])
    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(args.num_prompts):
        ids = rng.choice(vocab, size=args.input_len).tolist()
        ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[: args.input_len]
        out.append(SampleRequest(tokenizer.decode(ids), len(ids), args.output_len))
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
    import specserve

    path = os.path.join(os.path.dirname(specserve.__file__), "data", f"{name}_prompts.jsonl")
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
