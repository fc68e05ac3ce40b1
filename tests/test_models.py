"""Prefill logits of every supported architecture against transformers, in float32."""

from __future__ import annotations

import pytest
import torch

from specserve.attention.backend import CommonAttentionMetadata, build_forward_context
from specserve.attention.torch_ref import TorchAttentionBackend
from specserve.models.layers import Attention
from specserve.models.loader import ModelLoadError
from specserve.models.registry import load_model

from .conftest import random_prompts

ARCHS = {
    "llama_gqa": ("llama", {}),
    "llama3_rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "qwen2": ("qwen2", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True, "head_dim": 32}),
    "mistral_swa": ("mistral", {"sliding_window": 24}),
}


def run_prefill(
    model: torch.nn.Module, prompts: list[list[int]], block_size: int = 16
) -> list[torch.Tensor]:
    """One batched prefill of all prompts through the torch backend; returns per-prompt logits."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    num_blocks = sum((len(p) + block_size - 1) // block_size for p in prompts) + 1
    caches = []
    for i, m in enumerate(layers):
        m.kv_index = i
        caches.append(torch.zeros(2, num_blocks + 1, block_size, m.num_kv_heads, m.head_dim))
    max_blocks = max((len(p) + block_size - 1) // block_size for p in prompts)
    bt = torch.full((len(prompts), max_blocks), num_blocks, dtype=torch.int32)
    nxt = 0
    slots, pos, req = [], [], []
    for r, p in enumerate(prompts):
        nb = (len(p) + block_size - 1) // block_size
        # Shuffle-ish: reverse block order so the gather path is exercised.
        blocks = list(range(nxt, nxt + nb))[::-1]
        nxt += nb
        bt[r, :nb] = torch.tensor(blocks, dtype=torch.int32)
        for t in range(len(p)):
            slots.append(blocks[t // block_size] * block_size + t % block_size)
            pos.append(t)
            req.append(r)
    lens = [len(p) for p in prompts]
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        positions=torch.tensor(pos),
        block_table=bt,
        slot_mapping=torch.tensor(slots),
        token_req=torch.tensor(req),
        num_reqs=len(prompts),
        num_tokens=sum(lens),
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    ctx = build_forward_context(TorchAttentionBackend(), common, caches, model.sliding_windows())
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.inference_mode():
        hidden, _ = model(ids, common.positions, ctx)
        logits = model.compute_logits(hidden)
    return list(logits.split(lens))


@pytest.mark.parametrize("name", list(ARCHS))
def test_prefill_logits_match_transformers(ckpt_dir, name: str) -> None:
    import transformers as tf

    arch, over = ARCHS[name]
    path = ckpt_dir(name, arch, **over)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), 512)
    ref = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompts = random_prompts(3, 20, 70, seed=1)
    ours = run_prefill(model, prompts)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0]
        err = (got - want).norm() / want.norm()
        assert err < 1e-4, f"{name}: relative error {err:.2e}"


def test_missing_dir_and_bad_arch(tmp_path, ckpt_dir) -> None:
    import json
    import shutil

    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), 64)
    src = ckpt_dir("llama_gqa", "llama")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(str(bad), torch.float32, torch.device("cpu"), 64)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["hidden_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor .* has shape"):
        load_model(str(bad), torch.float32, torch.device("cpu"), 64)
    for f in bad.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(str(bad), torch.float32, torch.device("cpu"), 64)


def test_sharded_checkpoint(tmp_path) -> None:
    import transformers as tf

    from .conftest import make_checkpoint

    path = make_checkpoint(str(tmp_path / "full"), "llama")
    ref = tf.AutoModelForCausalLM.from_pretrained(path)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a, _ = load_model(path, torch.float32, torch.device("cpu"), 128)
    b, _ = load_model(str(tmp_path / "sharded"), torch.float32, torch.device("cpu"), 128)
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_swa"])
def test_dense_training_path_matches_transformers(ckpt_dir, name: str) -> None:
    """The cache-free dense path used for training gives transformers' logits and gradients."""
    import transformers as tf

    from specserve.attention.dense import dense_context, dense_positions

    arch, over = ARCHS[name]
    path = ckpt_dir(name, arch, **over)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), 512)
    ref = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.tensor(random_prompts(2, 40, 40, seed=3))
    ctx = dense_context(2, 40, ids.device, model.sliding_windows())
    hidden, _ = model(ids.flatten(), dense_positions(2, 40, ids.device), ctx)
    logits = model.compute_logits(hidden).view(2, 40, -1)
    want = ref(ids).logits
    assert ((logits - want).norm() / want.norm()) < 1e-4
    logits.logsumexp(-1).sum().backward()
    assert model.model.layers[0].self_attn.qkv_proj.weight.grad is not None
