"""Strict loading: config math specserve implements matches transformers; a tensor
nothing reads or a config field it does not implement fails the load by name."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import LLM, SamplingParams
from specserve.models.loader import ModelLoadError

from .conftest import hf_greedy, make_checkpoint, random_prompts

SMALL: dict[str, Any] = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

# Configs that loaded silently and gave wrong tokens before (the first three), and the
# other activations the gated MLP implements.
CONFIGS = {
    "attention_bias": ("llama", {"attention_bias": True}),
    "mlp_bias": ("llama", {"mlp_bias": True}),
    "gelu_pytorch_tanh": ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    "gelu": ("llama", {"hidden_act": "gelu"}),
    "qwen3_bias_relu2": ("qwen3", {"attention_bias": True, "hidden_act": "relu2"}),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_math_matches_transformers(tmp_path: Any, name: str) -> None:
    arch, over = CONFIGS[name]
    path = make_checkpoint(str(tmp_path / name), arch, seed=3, **SMALL, **over)
    # transformers initialises biases to zero, which dropping them would not change: make them
    # count, in the checkpoint both implementations read.
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    g = torch.Generator().manual_seed(5)
    for n, t in tensors.items():
        if n.endswith(".bias"):
            tensors[n] = torch.randn(t.shape, generator=g) * 0.5
    save_file(tensors, f, metadata={"format": "pt"})
    if name == "attention_bias":
        assert "model.layers.0.self_attn.o_proj.bias" in tensors
    if name == "mlp_bias":
        assert "model.layers.0.mlp.down_proj.bias" in tensors
    prompts = random_prompts(2, 5, 9, seed=4)
    llm = LLM(path, max_model_len=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for o, p in zip(outs, prompts):
        assert o.outputs[0].token_ids == hf_greedy(path, p, GREEDY.max_tokens)


def _add_tensor(path: str, name: str, tensor: torch.Tensor) -> None:
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    tensors[name] = tensor
    save_file(tensors, f, metadata={"format": "pt"})


def test_unused_tensor_fails_by_name(tmp_path: Any) -> None:
    # An o_proj bias in a checkpoint whose config says attention_bias false: the exact tensor
    # that used to be dropped silently.
    path = make_checkpoint(str(tmp_path / "extra"), "llama", **SMALL)
    _add_tensor(path, "model.layers.1.self_attn.o_proj.bias", torch.zeros(32))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.o_proj\.bias"):
        LLM(path, max_model_len=64)
    # Rotary caches some exporters save are known to be unused: they load.
    ok = make_checkpoint(str(tmp_path / "rotary"), "llama", **SMALL)
    _add_tensor(ok, "model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4))
    LLM(ok, max_model_len=64)


def test_unused_drafter_tensor_fails_by_name(tmp_path: Any) -> None:
    target = make_checkpoint(str(tmp_path / "target"), "llama", **SMALL)
    draft = make_checkpoint(str(tmp_path / "draft"), "llama", seed=1, **SMALL)
    _add_tensor(draft, "model.layers.0.mlp.gate_proj.bias", torch.zeros(64))
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.gate_proj\.bias"):
        LLM(target, max_model_len=64, speculative_config=spec)


@pytest.mark.parametrize(
    "field,value",
    [("hidden_act", "quick_gelu"), ("final_logit_softcapping", 30.0)],
)
def test_unsupported_config_field_fails_naming_it(tmp_path: Any, field: str, value: Any) -> None:
    path = make_checkpoint(str(tmp_path / "cfg"), "llama", **SMALL)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg[field] = value
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ModelLoadError, match=f"{field} = {value!r}"):
        LLM(path, max_model_len=64)
