"""Attention backends by name (attention/registry.py): the engine config's choice."""

from __future__ import annotations

import pytest
import torch

from specserve.attention.registry import attn_backend_names, get_attn_backend
from specserve.attention.torch_ref import TorchAttentionBackend


def test_auto_picks_torch_on_cpu() -> None:
    backend = get_attn_backend("auto", torch.device("cpu"), 128)
    assert isinstance(backend, TorchAttentionBackend)
    assert isinstance(get_attn_backend("torch", torch.device("cpu")), TorchAttentionBackend)
    assert attn_backend_names() == ["torch", "triton"]


def test_unknown_name_names_the_field() -> None:
    with pytest.raises(ValueError, match="attention_backend='flash' is unknown"):
        get_attn_backend("flash", torch.device("cpu"))


def test_triton_needs_cuda_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend=triton needs a CUDA device"):
        get_attn_backend("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = get_attn_backend("triton", torch.device("cpu"), 256)
    assert backend.name == "triton" and backend.max_model_len == 256  # type: ignore[attr-defined]
