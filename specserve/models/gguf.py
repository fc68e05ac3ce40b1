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
        import gguf
    except ImportError as e:  # the `gguf` package is a dependency; keep the message useful
        raise ModelLoadError(f"{path}: reading GGUF files needs the `gguf` package ({e})") from e
    try:
        field = gguf.GGUFReader(path).fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported by specserve "
            f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    return GGUF_ARCHITECTURES[arch]


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
