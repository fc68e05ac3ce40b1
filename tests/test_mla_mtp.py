"""MTP layers stored in MLA checkpoints (DeepSeek-V3, GLM-4.7-Flash) drive `method: mtp`:
speculative greedy output equals no speculation; three layers run the multi-layer MTP path,
also for K > 3 (draft step i runs MTP layer i mod 3, its own KV per step)."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams

from .conftest import random_prompts
from .mla_utils import mla_ckpt  # noqa: F401 - fixture
from .spec_utils import append_mtp_layers, check_tracked_kv_writes

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
MODES = {
    "plain": {},
    "chunked+preempt": {"num_gpu_blocks_override": 8, "max_num_batched_tokens": 24},
}


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def mtp(mla_ckpt, tmp_path_factory) -> dict:  # noqa: F811
    root = tmp_path_factory.mktemp("mla_mtp")
    prompts = random_prompts(4, 4, 30, seed=11)
    out: dict = {"prompts": prompts}
    for name in ("deepseek_v3", "glm4_moe_lite"):
        for n in (1, 3):
            path = append_mtp_layers(mla_ckpt(name), str(root / f"{name}_{n}"), n, seed=n)
            out[name, n] = (path, _generate(LLM(path, max_model_len=128), prompts))
    return out


def _check(path: str, ref: list[list[int]], prompts: list[list[int]], k: int, kw: dict) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": k}
    llm = LLM(path, max_model_len=128, speculative_config=spec, **kw)
    assert _generate(llm, prompts) == ref
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts_total"] > 0
    assert m["kv_cache_usage_perc"] == 0.0
    if "num_gpu_blocks_override" in kw:
        assert m["num_preemptions_total"] > 0
    return llm


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe_lite"])
def test_single_mtp_layer_greedy_equals_no_speculation(mtp: dict, name: str, k: int) -> None:
    """One MTP module (MLA + MoE, its latent KV in the paged pool) reused for all K drafts."""
    from specserve.models.mla import MLAAttention
    from specserve.models.moe import SparseMoE

    path, ref = mtp[name, 1]
    for mode, kw in MODES.items():
        if mode != "plain" and k not in (1, 3):
            continue  # the mode matrix on two K values keeps the file fast
        llm = _check(path, ref, mtp["prompts"], k, kw)
        layer = llm.engine.speculator.model.layer
        assert isinstance(layer.self_attn, MLAAttention) and isinstance(layer.mlp, SparseMoE)
        # target layers + the MTP layer, each one latent row per token
        assert len(llm.engine.runner.kv_caches) == 4
        assert llm.engine.runner.kv_caches[-1].dim() == 3


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe_lite"])
def test_three_mtp_layers_run_multi_layer_mtp(mtp: dict, name: str, k: int, mode: str) -> None:
    """K <= 3 loads the first K layers; K = 5 runs layers 0, 1, 2, 0, 1 (vLLM's
    `spec_step_idx % num_mtp_layers`): steps 3 and 4 share layers 0 and 1's weights (no copy)
    but each step has its own attention layer, hence its own latent KV layer."""
    from specserve.spec_decode.multi_layer_mtp import MultiLayerMTPSpeculator

    path, ref = mtp[name, 3]
    llm = _check(path, ref, mtp["prompts"], k, MODES[mode])
    assert isinstance(llm.engine.speculator, MultiLayerMTPSpeculator)
    modules = llm.engine.speculator.model.mtp
    assert len(modules) == k
    assert len(llm.engine.runner.kv_caches) == 3 + k
    assert len({m.layer.self_attn.kv_index for m in modules}) == k
    for i, m in enumerate(modules):
        src = dict(modules[i % 3].named_parameters())
        assert all(p is src[n] for n, p in m.named_parameters())
    # The drafter holds min(K, 3) layers' own weights (embedding and head are the target's).
    target = {id(p) for p in llm.engine.model.parameters()}
    own = [{id(p) for p in m.parameters()} - target for m in modules]
    assert len(set().union(*own)) == min(k, 3) * len(own[0]) > 0


def test_mtp_module_mask_position0_by_family(mtp: dict) -> None:
    """DeepSeek's MTP zeroes the token embedding at position 0 (vLLM); GLM's does not."""
    for name, masked in (("deepseek_v3", True), ("glm4_moe_lite", False)):
        spec = {"method": "mtp", "num_speculative_tokens": 1}
        llm = LLM(mtp[name, 1][0], max_model_len=128, speculative_config=spec)
        assert llm.engine.speculator.model.mask_position0 is masked
        assert llm.engine.speculator.model.eh_proj.weight.dtype == torch.float32


def test_deepseek_mtp_drafts_equal_transformers_use_mtp(mtp: dict, monkeypatch) -> None:
    """transformers drafts with DeepSeek-V3's MTP layer in `generate(use_mtp=True)` (batch 1).
    It embeds the token at position 0 where vLLM (and our DeepSeek default) zeroes it; with
    that one switch aligned, our K = 1 drafts (MLA + MoE MTP layer, its latent KV in the paged
    pool) are the drafts transformers proposes for the same context, step by step."""
    from specserve.models.deepseek import DeepseekV3ForCausalLM

    from .draft_utils import assert_same_drafts, drafts_per_step, transformers_mtp_drafts

    path, ref = mtp["deepseek_v3", 1]
    prompts = mtp["prompts"][:2]
    outs, theirs = transformers_mtp_drafts(path, prompts, GREEDY.max_tokens, monkeypatch)
    assert outs == ref[:2]
    monkeypatch.setattr(DeepseekV3ForCausalLM, "mtp_mask_position0", False)
    # A fixed K: steps without drafts (adaptive k = 0) would leave no drafts to compare.
    spec = {"method": "mtp", "num_speculative_tokens": 1, "adaptive": False}
    llm = LLM(path, max_model_len=128, speculative_config=spec)
    assert_same_drafts(drafts_per_step(llm, prompts, GREEDY), theirs)


def test_tracked_steps_write_only_the_mla_mtp_kv(mtp: dict) -> None:
    """The adaptive budget's tracked k = 0 steps run the MTP layer's MLA (its latent KV write)
    without its MoE: the latent KV and every later draft equal the full forward's."""
    path, ref = mtp["deepseek_v3", 1]
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    prompts = [{"prompt_token_ids": p} for p in mtp["prompts"]]
    make = lambda: LLM(path, max_model_len=128, speculative_config=spec)  # noqa: E731
    assert check_tracked_kv_writes(make, prompts, GREEDY) == ref
