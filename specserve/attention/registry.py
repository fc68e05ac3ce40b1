"""Attention backends by name: the engine config's `attention_backend` picks one here.

A backend is an `AttentionBackend` subclass; `create` builds it for a device (and checks that
it can run there). Classes load on first use: the Triton backend imports triton, which CPU-only
installs do not have.
"""

from __future__ import annotations

import importlib

import torch

from specserve.attention.backend import AttentionBackend

# name -> (module, class)
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("specserve.attention.torch_ref", "TorchAttentionBackend"),
    "triton": ("specserve.attention.triton_paged", "TritonAttentionBackend"),
}


def attn_backend_names() -> list[str]:
    """The registered names ("auto" picks one of them by device)."""
    return list(_BACKENDS)


def attn_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        known = ", ".join(["auto", *_BACKENDS])
        raise ValueError(f"attention_backend={name!r} is unknown; use one of {known}.")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def get_attn_backend(
    name: str, device: torch.device, max_model_len: int | None = None
) -> AttentionBackend:
    """The backend `name` for `device` ("auto": Triton on CUDA, torch elsewhere);
    `max_model_len` bounds what a captured graph may see (split-KV counts follow it)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    return attn_backend_class(name).create(device, max_model_len)
