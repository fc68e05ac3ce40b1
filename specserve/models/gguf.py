"""GGUF files as models: `LLM(model="x.gguf")`, `specserve serve x.gguf`.

A GGUF file is converted once into an ordinary Hugging Face directory (config.json, safetensors,
tokenizer) through transformers' GGUF support, which dequantizes the weights; the engine then
loads that directory like any other. The directory is cached under `$SPECSERVE_CACHE` (default
`~/.cache/specserve`) in `gguf/<sha256 of the file>`, so later starts skip the conversion.

transformers' GGUF path leaves two things out that a checkpoint directory needs, so they are
filled in here: `architectures` in config.json (the GGUF metadata names only a model type), and
tied embeddings, which are written once as `model.embed_tokens.weight`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile

from specserve.models.loader import ModelLoadError

logger = logging.getLogger(__name__)

# Bumped when the converted layout changes, so stale cache entries are not reused.
_CONVERSION_VERSION = 1
# GGUF `general.architecture` -> the HF class specserve runs it with. GGUF stores Mistral-style
# models as "llama".
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf")


def cache_root() -> str:
    return os.environ.get("SPECSERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "specserve"
    )


def gguf_architecture(path: str) -> str:
    """The HF architecture for a GGUF file, read from its metadata without loading tensors;
    one clear error line for a file specserve cannot run."""
    try:
        arch = read_gguf_string(path, "general.architecture")
    except (KeyError, ValueError, OSError) as e:  # (a bad UTF-8 name: a ValueError)
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported by specserve "
            f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    return GGUF_ARCHITECTURES[arch]


# GGUF metadata value types: fixed-size scalars by their struct code; 8 is a string, 9 an array.
_GGUF_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_string(path: str, key: str) -> str:
    """A string value of a GGUF file's metadata, read from the header up to `key` only.
    (gguf's GGUFReader parses every field first, the 49k-token vocabulary included: ~4 s of
    every start of the default model, for its first key.)"""
    import struct

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("no GGUF magic")
        # The byte order is the one that reads the version as a small number.
        order = "<" if struct.unpack("<I", f.read(4))[0] < 1 << 16 else ">"

        def read(n: int) -> bytes:
            data = f.read(n)
            if len(data) < n:
                raise ValueError("the header ends early")
            return data

        def take(fmt: str) -> int | float | bool:
            return struct.unpack(order + fmt, read(struct.calcsize(order + fmt)))[0]

        def string() -> bytes:
            return read(int(take("Q")))

        def skip(kind: int) -> None:
            if kind in _GGUF_SCALARS:
                f.seek(struct.calcsize("<" + _GGUF_SCALARS[kind]), os.SEEK_CUR)
            elif kind == _GGUF_STRING:
                f.seek(int(take("Q")), os.SEEK_CUR)
            elif kind == _GGUF_ARRAY:
                item, n = int(take("I")), int(take("Q"))
                if item in _GGUF_SCALARS:
                    f.seek(n * struct.calcsize("<" + _GGUF_SCALARS[item]), os.SEEK_CUR)
                else:
                    for _ in range(n):
                        skip(item)
            else:
                raise ValueError(f"unknown metadata value type {kind}")

        take("Q")  # tensor count
        for _ in range(int(take("Q"))):
            name, kind = string().decode(), int(take("I"))
            if name == key:
                if kind != _GGUF_STRING:
                    raise ValueError(f"{key} is not a string")
                return string().decode()
            skip(kind)
    raise KeyError(key)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve_gguf(path: str) -> str:
    """The converted HF directory of a GGUF file, converting on first use."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    architecture = gguf_architecture(path)
    key = f"{_sha256(path)[:32]}-v{_CONVERSION_VERSION}"
    out = os.path.join(cache_root(), "gguf", key)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    logger.info("converting %s to a Hugging Face checkpoint in %s (once)", path, out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # Convert into a temporary sibling and rename: a killed conversion leaves no half entry.
    tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=os.path.dirname(out))
    try:
        _convert(path, architecture, tmp)
        try:
            os.replace(tmp, out)
        except OSError:
            # Another process (a second server started beside this one) converted the same
            # file meanwhile: its finished entry is as good as this one.
            if not os.path.isfile(os.path.join(out, "config.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _convert(path: str, architecture: str, out: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg["architectures"] = [architecture]
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    tied = bool(cfg.get("tie_word_embeddings"))
    tensors = {}
    for n, t in model.state_dict().items():
        if tied and n == "lm_head.weight":
            continue  # the same tensor as model.embed_tokens.weight, stored once
        tensors[n] = t.detach().contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    model.generation_config.to_json_file(os.path.join(out, "generation_config.json"))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    with open(os.path.join(out, "source.json"), "w") as f:
        json.dump({"gguf": os.path.abspath(path), "architecture": architecture}, f)
