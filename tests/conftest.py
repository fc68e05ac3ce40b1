"""Shared fixtures: tiny random HF checkpoints written with transformers' save_pretrained."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

VOCAB = 384

# The tiny decoder every test checkpoint starts from (families add or override fields).
TINY_DECODER: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _save(model: Any, path: str) -> str:
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_checkpoint(path: str, arch: str = "llama", seed: int = 0, **overrides: Any) -> str:
    """Write a tiny random checkpoint of `arch` (llama | qwen2 | qwen3 | mistral | qwen3_moe |
    glm4_moe | gpt_oss; MoE archs take their expert settings as overrides) to `path`."""
    import transformers as tf

    torch.manual_seed(seed)
    common = {**TINY_DECODER, **overrides}
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
    }[arch]
    cfg = cfg_cls(**common)
    model = model_cls(cfg).eval()
    return _save(model, path)


@pytest.fixture(autouse=True)
def interpreter_builtin_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TRITON_INTERPRET=1: the Triton (3.6) interpreter re-patches triton.language for
    every launch and for every call of a @triton.jit helper inside every program, each time
    listing the modules' members with inspect.getmembers to find the builtins. The list never
    changes, so it is taken once a test (~30% of the router kernel test's time)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    triton = pytest.importorskip("triton")
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as ti

    assert triton.__version__.startswith("3.6"), "re-check _patch_builtin for this version"
    builtins: dict[int, list[tuple[str, Any]]] = {}

    def patch_builtin(pkg: Any, builder: Any, scope: Any) -> None:
        # Listed at the test's first patch, before anything is patched. As upstream, only the
        # members that are builtins now are patched: inside a program, those its launch has
        # not patched already.
        members = builtins.get(id(pkg))
        if members is None:
            members = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
            builtins[id(pkg)] = members
        for name, member in members:
            if getattr(pkg, name, None) is member:
                ti._patch_attr(pkg, name, member, builder, scope)

    monkeypatch.setattr(ti, "_patch_builtin", patch_builtin)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for a module's tests (`pytestmark = pytest.mark.usefixtures(
    "one_torch_thread")`)."""
    # NOTE: these models are tiny (64-wide matmuls gain nothing from a second thread), and on a
    # busy 2-core machine, where an engine thread and an HTTP thread share the cores with the
    # test, OpenMP spin-waiting makes each step up to 10x slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def unfused_shared_experts() -> Iterator[None]:
    """GLM-4.x MoE / DeepSeek-V3 models built during the test keep their shared experts as a
    separate MLP (models/moe.py MoeConfig.fuse_shared_experts False) instead of fusing them."""
    from specserve.tunables import override

    with override(moe_fuse_shared_experts=False):
        yield


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Factory: ckpt_dir(name, arch, **overrides) -> path (cached per session)."""
    root = tmp_path_factory.mktemp("ckpts")
    cache: dict[str, str] = {}

    def get(name: str, arch: str = "llama", **overrides: Any) -> str:
        if name not in cache:
            cache[name] = make_checkpoint(os.path.join(root, name), arch, **overrides)
        return cache[name]

    return get


def hf_model(path: str, dtype: torch.dtype = torch.float32, **kw: Any) -> Any:
    """transformers' model of the checkpoint at `path` (the reference), in eval mode."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()
    honour_swiglu_config(model)
    return model


def honour_swiglu_config(model: Any) -> None:
    """gpt-oss experts take `swiglu_alpha` / `swiglu_limit` from the config, as transformers
    5.24 does. Older releases (5.17, the GPU image's) hard-code 1.702 / 7.0 in GptOssExperts and
    ignore the config: the published checkpoints use exactly those, but the tiny test model's
    limit (0.6, so the clamps matter) then silently became 7.0 in the reference only, and every
    gpt-oss comparison on that machine failed from the first token."""
    cfg = model.config
    if cfg.model_type != "gpt_oss":
        return
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.alpha = float(getattr(cfg, "swiglu_alpha", 1.702))
        experts.limit = float(getattr(cfg, "swiglu_limit", 7.0))


def hf_generate(model: Any, prompt: list[int], max_new_tokens: int, **kw: Any) -> list[int]:
    """transformers' greedy continuation of `prompt` by `model`: exactly max_new_tokens tokens
    (no EOS stop); `kw` goes to generate (use_mtp=True, ...)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            **kw,
        )
    return out[0, len(prompt) :].tolist()


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    return hf_generate(hf_model(path), prompt, max_new_tokens)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (L,), generator=g).tolist() for L in lens]
