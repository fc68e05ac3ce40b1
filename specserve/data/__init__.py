"""Files shipped inside the package: the embedded model family and the held-out prompt sets.

    embedded/target/    a ~8M-parameter Llama trained on Python sources (HF layout)
    embedded/eagle3/    its EAGLE-3 drafter
    code_prompts.jsonl  code-completion prompts (signature + docstring) from held-out files
    chat_prompts.jsonl  instruction-style prompts (the user message) from the same files

The prompt files are written by `specserve.train.corpus.write_prompt_files`; the embedded family by
`benchmarks/build_family.py` on a GPU (see `embedded_model_dir`).
"""

from __future__ import annotations

import json
import os
from typing import Any

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
EMBEDDED_K = 3
_BUILD_HINT = (
    "build it on a GPU with `python benchmarks/build_family.py --family embedded` and unpack the "
    "result with `python benchmarks/build_family.py --install DIR`, or pass --model DIR to use "
    "another local checkpoint"
)


def embedded_model_dir(root: str | None = None) -> tuple[str, dict[str, Any]]:
    """(target dir, speculative_config dict) of the packaged embedded family (EAGLE-3, K=3)."""
    base = os.path.join(root or DATA_DIR, "embedded")
    target, eagle3 = os.path.join(base, "target"), os.path.join(base, "eagle3")
    for d in (target, eagle3):
        for name in ("config.json", "model.safetensors"):
            if not os.path.isfile(os.path.join(d, name)):
                raise FileNotFoundError(
                    f"the embedded model is missing ({os.path.join(d, name)} not found): "
                    + _BUILD_HINT
                )
    spec = {"method": "eagle3", "model": eagle3, "num_speculative_tokens": EMBEDDED_K}
    return target, spec


def load_prompts(kind: str = "code", n: int | None = None) -> list[dict[str, Any]]:
    """The shipped held-out prompts: kind "code" or "chat"; each row has a `prompt` field."""
    if kind not in ("code", "chat"):
        raise ValueError(f"prompt kind must be code or chat, got {kind!r}")
    path = os.path.join(DATA_DIR, f"{kind}_prompts.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:n] if n is not None else rows


def default_prompt() -> str:
    """A held-out code prompt (a short function's signature and docstring) for demos."""
    return load_prompts("code", 1)[0]["prompt"]
