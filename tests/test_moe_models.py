"""MoE targets (Qwen3-MoE, GLM-4.x MoE) against transformers' generate, and their loading."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import LLM, SamplingParams

from .conftest import hf_greedy, random_prompts

# Tiny MoE shapes: 8 experts, top-2, a dense layer mixed in.
MOE_ARCHS = {
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "glm4_moe": (
        "glm4_moe",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            attention_bias=True,
            use_qk_norm=True,
        ),
    ),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def moe_ckpt(ckpt_dir, name: str) -> str:
    arch, over = MOE_ARCHS[name]
    path = ckpt_dir(name, arch, **over)
    if name == "glm4_moe":
        _randomize_correction_bias(path)
    return path


def _randomize_correction_bias(path: str) -> None:
    """transformers initializes e_score_correction_bias to zeros; a nonzero one checks that the
    bias steers the choice but not the weights."""
    f = os.path.join(path, "model.safetensors")
    w = load_file(f)
    g = torch.Generator().manual_seed(1)
    changed = False
    for k, t in w.items():
        if k.endswith("e_score_correction_bias") and not t.any():
            w[k] = torch.rand(t.shape, generator=g) * 0.2
            changed = True
    if changed:
        save_file(w, f, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hf_refs(ckpt_dir) -> dict:
    prompts = random_prompts(4, 5, 40, seed=7)
    refs: dict = {"_prompts": prompts}
    for name in MOE_ARCHS:
        path = moe_ckpt(ckpt_dir, name)
        refs[name] = [hf_greedy(path, p, GREEDY.max_tokens) for p in prompts]
    return refs


@pytest.mark.parametrize("name", list(MOE_ARCHS))
@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill
        {"num_gpu_blocks_override": 6, "max_num_batched_tokens": 64},  # preemption
    ],
    ids=["plain", "chunked", "preempt"],
)
def test_greedy_matches_transformers(ckpt_dir, hf_refs, name: str, engine_kw: dict) -> None:
    llm = LLM(moe_ckpt(ckpt_dir, name), max_model_len=128, **engine_kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in hf_refs["_prompts"]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_refs[name]
    if "num_gpu_blocks_override" in engine_kw:
        assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.kv.usage() == 0.0


def test_fused_expert_layout_loads_the_same(ckpt_dir, tmp_path) -> None:
    """transformers' in-memory fused experts (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]) load into the same stacked weights as per-expert tensors."""
    import shutil

    from specserve.models.registry import load_model

    src = moe_ckpt(ckpt_dir, "qwen3_moe")
    dst = str(tmp_path / "fused")
    shutil.copytree(src, dst)
    w = load_file(os.path.join(dst, "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts."
        if p + "0.gate_proj.weight" not in w:
            continue
        n = sum(1 for k in w if k.startswith(p) and k.endswith("gate_proj.weight"))
        gate_up = [
            torch.cat([w.pop(f"{p}{e}.gate_proj.weight"), w.pop(f"{p}{e}.up_proj.weight")])
            for e in range(n)
        ]
        fused[p + "gate_up_proj"] = torch.stack(gate_up)
        fused[p + "down_proj"] = torch.stack([w.pop(f"{p}{e}.down_proj.weight") for e in range(n)])
    assert fused
    save_file({**w, **fused}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    a, _ = load_model(src, torch.float32, "cpu", 256)
    b, _ = load_model(dst, torch.float32, "cpu", 256)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_glm_correction_bias_loads(ckpt_dir) -> None:
    from specserve.models.registry import load_model

    model, _ = load_model(moe_ckpt(ckpt_dir, "glm4_moe"), torch.float32, "cpu", 256)
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert len(gates) == 2  # first_k_dense_replace = 1 of 3 layers
    assert all(g.e_score_correction_bias.abs().sum() > 0 for g in gates)
    assert all(g.weight.dtype == torch.float32 for g in gates)
    assert model.model.layers[0].self_attn.rope.rotary_dim == 8  # partial_rotary_factor 0.5


@pytest.fixture(scope="module")
def glm_mtp(ckpt_dir, tmp_path_factory) -> dict:
    from .spec_utils import append_mtp_layers

    target = moe_ckpt(ckpt_dir, "glm4_moe")
    path = append_mtp_layers(target, str(tmp_path_factory.mktemp("glm_mtp") / "ckpt"))
    prompts = random_prompts(4, 4, 30, seed=11)
    ref = LLM(path, max_model_len=128).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return {"path": path, "prompts": prompts, "ref": [o.outputs[0].token_ids for o in ref]}


@pytest.mark.parametrize("k", [1, 3])
def test_glm_mtp_greedy_equals_no_speculation(glm_mtp: dict, k: int) -> None:
    """`method: mtp` with no drafter directory reads the GLM checkpoint's own MTP layer (an MoE
    decoder layer); greedy output with speculation equals the output without."""
    from specserve.models.moe import SparseMoE

    spec = {"method": "mtp", "num_speculative_tokens": k}
    for kw in ({}, {"num_gpu_blocks_override": 8, "max_num_batched_tokens": 32}):
        llm = LLM(glm_mtp["path"], max_model_len=128, speculative_config=spec, **kw)
        assert isinstance(llm.engine.speculator.model.layer.mlp, SparseMoE)
        outs = llm.generate([{"prompt_token_ids": p} for p in glm_mtp["prompts"]], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == glm_mtp["ref"]
        m = llm.get_metrics()
        assert m["spec_decode_num_drafts_total"] > 0
        assert m["kv_cache_usage_perc"] == 0.0


def test_glm_mtp_drafts_equal_transformers_use_mtp(glm_mtp: dict, monkeypatch) -> None:
    """transformers (5.x) drafts with the checkpoint's MTP layer in `generate(use_mtp=True)`
    (batch 1). With K = 1 our drafts, step by step, are the drafts it proposes for the same
    context, so acceptance is the same too."""
    from .draft_utils import assert_same_drafts, drafts_per_step, transformers_mtp_drafts

    prompts = glm_mtp["prompts"][:2]
    outs, theirs = transformers_mtp_drafts(glm_mtp["path"], prompts, GREEDY.max_tokens, monkeypatch)
    assert outs == glm_mtp["ref"][:2]
    llm = LLM(
        glm_mtp["path"],
        max_model_len=128,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )
    assert_same_drafts(drafts_per_step(llm, prompts, GREEDY), theirs)
