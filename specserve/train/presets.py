"""The reference family presets: `FamilySpec` and the `embedded` and `gpu` families.

`embedded` is small enough to ship inside the package and run on a CPU; `gpu` is the ~100M target
the GPU benchmarks use. `family.py` builds and evaluates either one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specserve.train.reference import ModelShape, TrainConfig

__all__ = ["FAMILIES", "FamilySpec"]


@dataclass(frozen=True)
class FamilySpec:
    name: str
    shape: ModelShape
    train: TrainConfig
    save_dtype: torch.dtype
    # Corpus: the stdlib, plus installed packages' sources up to `corpus_max_bytes` in all.
    packages: bool
    corpus_max_bytes: int | None
    tokenizer_max_bytes: int
    # Chat-formatted examples (user asks for a function, the answer is its source).
    max_chat_examples: int
    # Drafters: method -> train_drafter keyword arguments (DraftTrainConfig fields).
    drafters: dict[str, dict[str, Any]]
    drafter_text_bytes: int
    num_speculative_tokens: int
    eval_max_tokens: int = 128
    eval_num_prompts: int | None = None
    parse_num_prompts: int = 48


def _drafters(
    steps: int,
    batch_size: int,
    lr: float,
    draft_vocab_size: int,
    *,
    eagle3_steps: int,
    eagle3_ttt_steps: int,
    ptd_k: int | None = None,
    ptd_steps: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Every method's train_drafter arguments (DraftTrainConfig fields): one step count, batch
    and lr, with EAGLE-3 (and PTD, if given) trained longer; EAGLE-3 and PTD draft over a
    reduced vocabulary."""
    common: dict[str, Any] = dict(steps=steps, batch_size=batch_size, lr=lr)
    ptd = {**common, "steps": ptd_steps or steps, "draft_vocab_size": draft_vocab_size}
    if ptd_k is not None:
        ptd["ptd_k"] = ptd_k
    return {
        "eagle3": {
            **common,
            "steps": eagle3_steps,
            "ttt_steps": eagle3_ttt_steps,
            "draft_vocab_size": draft_vocab_size,
        },
        "eagle": {**common, "ttt_steps": 3},
        "mtp": {**common, "ttt_steps": 3},
        "ptd": ptd,
    }


def _family(
    name: str,
    shape: ModelShape,
    *,
    max_steps: int,
    lr: float,
    max_minutes: float,
    corpus_max_bytes: int,
    tokenizer_max_bytes: int,
    max_chat_examples: int,
    drafters: dict[str, dict[str, Any]],
    drafter_text_bytes: int,
    num_speculative_tokens: int,
) -> FamilySpec:
    """A preset: what both families share (bf16 weights, the package corpus, compiled target
    training on 64 blocks of 512 tokens with 200 warm-up steps) around what differs."""
    train = TrainConfig(
        seq_len=512,
        batch_size=64,
        max_steps=max_steps,
        lr=lr,
        warmup_steps=200,
        max_minutes=max_minutes,
        compile=True,
    )
    return FamilySpec(
        name=name,
        shape=shape,
        train=train,
        save_dtype=torch.bfloat16,
        packages=True,
        corpus_max_bytes=corpus_max_bytes,
        tokenizer_max_bytes=tokenizer_max_bytes,
        max_chat_examples=max_chat_examples,
        drafters=drafters,
        drafter_text_bytes=drafter_text_bytes,
        num_speculative_tokens=num_speculative_tokens,
    )


def _families() -> dict[str, FamilySpec]:
    embedded = _family(
        "embedded",
        # 8.4M parameters: 16.8 MB in bf16, 21.6 MB with its EAGLE-3 head and tokenizer.
        ModelShape(
            vocab_size=8192,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        ),
        max_steps=6000,
        lr=1.5e-3,
        max_minutes=3.5,
        corpus_max_bytes=96_000_000,
        tokenizer_max_bytes=24_000_000,
        max_chat_examples=20_000,
        drafters=_drafters(1200, 32, 1e-3, 4096, eagle3_steps=2000, eagle3_ttt_steps=3),
        drafter_text_bytes=24_000_000,
        num_speculative_tokens=3,
    )
    gpu = _family(
        "gpu",
        # 100.7M parameters.
        ModelShape(
            vocab_size=16384,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
        max_steps=4000,
        lr=8e-4,
        max_minutes=6.0,
        corpus_max_bytes=160_000_000,
        tokenizer_max_bytes=32_000_000,
        max_chat_examples=40_000,
        # PTD is trained for the K sweep of the PTD benchmark (K = 2..8), as long as EAGLE-3:
        # its mask slots learn slower than an autoregressive step (700 steps gave tau 1.7).
        drafters=_drafters(
            700, 16, 6e-4, 8192, eagle3_steps=1500, eagle3_ttt_steps=5, ptd_k=8, ptd_steps=1500
        ),
        drafter_text_bytes=32_000_000,
        num_speculative_tokens=5,
    )
    return {"embedded": embedded, "gpu": gpu}


FAMILIES = _families()
