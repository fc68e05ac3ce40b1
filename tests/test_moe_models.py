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
        # A fixed K: steps without drafts (adaptive k = 0) would leave no drafts to compare.
        speculative_config={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False},
    )
    assert_same_drafts(drafts_per_step(llm, prompts, GREEDY), theirs)


# ---- shared experts fused into the routed ones (models/moe.py) -------------------------------
@pytest.mark.parametrize("n_shared", [1, 2])
def test_fused_shared_experts_equal_the_separate_mlp(n_shared: int) -> None:
    """Shared expert i as routed expert E + i at weight 1.0 (the MLP's intermediate channels
    i * I .. (i + 1) * I) gives the separate MLP's output: router columns, forward and the
    norm-fused forward, float32."""
    from dataclasses import replace

    from torch import nn

    from specserve.models.layers import RMSNorm
    from specserve.models.moe import MoeConfig, SparseMoE

    E, H, inter, k = 8, 64, 16, 2
    m = MoeConfig(
        num_experts=E, top_k=k, intermediate_size=inter, norm_topk_prob=True,
        scoring="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5,
        correction_bias=True, n_shared_experts=n_shared, router_fp32=True,
    )  # fmt: skip
    torch.manual_seed(0)
    unfused, fused = SparseMoE(replace(m, fuse_shared_experts=False), H), SparseMoE(m, H)
    assert fused.shared_experts is None and list(fused.shared_slots) == list(range(E, E + n_shared))
    assert fused.experts.w13.shape == (E + n_shared, 2 * inter, H)
    with torch.no_grad():
        for p in unfused.parameters():
            nn.init.normal_(p, std=0.2)
        unfused.gate.e_score_correction_bias.uniform_(0, 0.2)
        fused.gate.load_state_dict(unfused.gate.state_dict())
        fused.experts.w13[:E] = unfused.experts.w13
        fused.experts.w2[:E] = unfused.experts.w2
        gate, up = unfused.shared_experts.gate_up_proj.weight.chunk(2)
        down = unfused.shared_experts.down_proj.weight
        for i in range(n_shared):
            ch = slice(i * inter, (i + 1) * inter)
            fused.experts.w13[E + i] = torch.cat([gate[ch], up[ch]])
            fused.experts.w2[E + i] = down[:, ch]
    x, res = torch.randn(5, H), torch.randn(5, H)
    with torch.no_grad():
        weights, ids = fused.gate(x)
        ref_w, ref_ids = unfused.gate(x)
        assert torch.equal(ids[:, :k], ref_ids) and torch.equal(weights[:, :k], ref_w)
        assert ids[:, k:].tolist() == [list(range(E, E + n_shared))] * 5
        assert torch.equal(weights[:, k:], torch.ones(5, n_shared))  # not routed_scaling_factor
        torch.testing.assert_close(fused(x), unfused(x), rtol=1e-5, atol=1e-6)
        norm = RMSNorm(H, 1e-6)
        (a, a_res), (b, b_res) = (
            fused.norm_forward(norm, x, res),
            unfused.norm_forward(norm, x, res),
        )
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert torch.equal(a_res, b_res)


def _glm_shared_ckpt(ckpt_dir, n_shared: int) -> str:
    if n_shared == 1:
        return moe_ckpt(ckpt_dir, "glm4_moe")
    over = {**MOE_ARCHS["glm4_moe"][1], "n_shared_experts": n_shared}
    path = ckpt_dir(f"glm4_moe_shared{n_shared}", "glm4_moe", **over)
    _randomize_correction_bias(path)
    return path


@pytest.mark.parametrize("n_shared", [1, 2])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_glm_shared_experts_fused_or_not_match_transformers(
    ckpt_dir, hf_refs, request, n_shared: int, fused: bool
) -> None:
    """A transformers-written GLM-4.5 MoE checkpoint (shared MLP of n * I channels) loads with
    its shared experts fused (slots E.., two of I for n = 2) or as the separate MLP, and both
    give transformers' greedy tokens."""
    from specserve.models.moe import SparseMoE

    if not fused:
        request.getfixturevalue("unfused_shared_experts")
    path = _glm_shared_ckpt(ckpt_dir, n_shared)
    prompts = hf_refs["_prompts"]
    ref = hf_refs["glm4_moe"] if n_shared == 1 else [hf_greedy(path, p, 24) for p in prompts]
    llm = LLM(path, max_model_len=128)
    blocks = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoE)]
    assert len(blocks) == 2
    for b in blocks:
        assert len(b.shared_slots) == (n_shared if fused else 0)
        assert (b.shared_experts is None) == fused
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_fused_shared_expert_loading_is_strict(ckpt_dir, tmp_path) -> None:
    """The shared MLP's tensors land in slot E (+ i) of the stacked experts; a missing one
    fails the load naming the stacked parameter, a wrongly shaped one naming the tensor."""
    import shutil

    from specserve.models.loader import ModelLoadError
    from specserve.models.registry import load_model

    src = _glm_shared_ckpt(ckpt_dir, 2)
    model, _ = load_model(src, torch.float32, "cpu", 256)
    w = load_file(os.path.join(src, "model.safetensors"))
    p = "model.layers.1.mlp."
    experts = model.model.layers[1].mlp.experts
    gate, up = w[p + "shared_experts.gate_proj.weight"], w[p + "shared_experts.up_proj.weight"]
    down = w[p + "shared_experts.down_proj.weight"]
    for i in range(2):
        ch = slice(i * 32, (i + 1) * 32)
        assert torch.equal(experts.w13[8 + i], torch.cat([gate[ch], up[ch]]))
        assert torch.equal(experts.w2[8 + i], down[:, ch])
    dst = str(tmp_path / "broken")
    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    broken = {k: t for k, t in w.items() if k != p + "shared_experts.down_proj.weight"}
    save_file(broken, f, metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"missing 1 weight\(s\): model.layers.1.mlp.experts.w2"
    ):
        load_model(dst, torch.float32, "cpu", 256)
    broken[p + "shared_experts.down_proj.weight"] = down[:, :60].contiguous()
    save_file(broken, f, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="shared_experts.down_proj.weight has shape"):
        load_model(dst, torch.float32, "cpu", 256)
