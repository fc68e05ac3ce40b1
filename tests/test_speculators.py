"""EAGLE-3 heads in the speculators format and EAGLE-3 / PTD heads on MoE targets: greedy output
with speculation equals output without; config validation names the missing field."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

from .conftest import random_prompts
from .draft_utils import drafts_per_step
from .spec_utils import write_eagle3, write_ptd_eagle3, write_speculators_eagle3
from .test_moe_models import moe_ckpt

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PREEMPT = {"num_gpu_blocks_override": 8, "max_num_batched_tokens": 32}


def _gen(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def setup(ckpt_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("speculators")
    prompts = random_prompts(4, 4, 30, seed=5)
    targets = {
        "qwen3": ckpt_dir("qwen3_dense", "qwen3", num_hidden_layers=3, head_dim=16),
        "qwen3_moe": moe_ckpt(ckpt_dir, "qwen3_moe"),
    }
    refs = {k: _gen(LLM(p, max_model_len=128), prompts) for k, p in targets.items()}
    return {"root": root, "prompts": prompts, "targets": targets, "refs": refs}


def _llm(setup: dict, target: str, head: str, k: int | None = None, **kw) -> LLM:
    spec: dict = {"method": "eagle3", "model": head}
    if k is not None:
        spec["num_speculative_tokens"] = k
    return LLM(setup["targets"][target], max_model_len=128, speculative_config=spec, **kw)


@pytest.mark.parametrize("target", ["qwen3", "qwen3_moe"])
def test_speculators_eagle3_lossless(setup: dict, target: str) -> None:
    head = write_speculators_eagle3(
        str(setup["root"] / f"head_{target}"), aux=[0, 1, 2], speculative_tokens=4
    )
    llm = _llm(setup, target, head)
    assert llm.engine.num_spec_tokens == 4  # speculators_config's speculative_tokens
    assert _gen(llm, setup["prompts"]) == setup["refs"][target]
    assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0
    llm = _llm(setup, target, head, k=2, **PREEMPT)  # the user's K wins
    assert llm.engine.num_spec_tokens == 2
    assert _gen(llm, setup["prompts"]) == setup["refs"][target]
    assert llm.get_metrics()["num_preemptions_total"] > 0


def test_head_hidden_differs_from_target(setup: dict) -> None:
    """A 32-wide head on a 64-wide target: fc maps 3 x 64 -> 32, the head's own embedding."""
    root = setup["root"]
    head = write_speculators_eagle3(str(root / "narrow"), hidden=32, with_embed=True)
    llm = _llm(setup, "qwen3_moe", head, k=3)
    assert llm.engine.speculator.model.fc.weight.shape == (32, 192)
    assert _gen(llm, setup["prompts"]) == setup["refs"]["qwen3_moe"]
    bare = write_speculators_eagle3(str(root / "narrow_bare"), hidden=32)
    with pytest.raises(ValueError, match="needs its own embed_tokens"):
        _llm(setup, "qwen3_moe", bare, k=3)


def test_norm_before_residual_changes_drafts(setup: dict) -> None:
    """Same weights, norm_before_residual on / off: different drafts, both lossless."""
    root = setup["root"]
    drafts = []
    for flag in (True, False):
        head = write_speculators_eagle3(str(root / f"nbr_{flag}"), norm_before_residual=flag)
        llm = _llm(setup, "qwen3", head, k=3)
        drafts.append(drafts_per_step(llm, setup["prompts"][:2], GREEDY))
        assert _gen(llm, setup["prompts"]) == setup["refs"]["qwen3"]
    assert drafts[0] != drafts[1]


@pytest.mark.parametrize(
    "drop",
    [
        "transformer_layer_config",
        "draft_vocab_size",
        "speculators_config",
        "speculators_config.proposal_methods",
        "speculators_config.verifier",
    ],
)
def test_missing_field_is_named(setup: dict, drop: str) -> None:
    head = write_speculators_eagle3(str(setup["root"] / f"drop_{drop}"), drop=drop)
    field = drop.rsplit(".", 1)[-1]
    with pytest.raises(ValueError, match=rf"speculators config is missing \S*{field}$") as e:
        _llm(setup, "qwen3", head, k=3)
    assert "\n" not in str(e.value)


def test_eagle3_and_ptd_on_moe_target(setup: dict) -> None:
    """EAGLE-3 (EAGLE layout, aux taps from MoE and dense layers) and a PTD head on Qwen3-MoE."""
    root = setup["root"]
    eagle3 = write_eagle3(str(root / "eagle3"), aux=[0, 1, 2])
    assert (
        _gen(_llm(setup, "qwen3_moe", eagle3, k=3), setup["prompts"]) == setup["refs"]["qwen3_moe"]
    )
    ptd = write_ptd_eagle3(str(root / "ptd"))
    for k, kw in ((3, {}), (5, PREEMPT)):
        spec = {"method": "eagle3", "model": ptd, "num_speculative_tokens": k}
        spec["parallel_draft"] = True
        llm = LLM(setup["targets"]["qwen3_moe"], max_model_len=128, speculative_config=spec, **kw)
        assert _gen(llm, setup["prompts"]) == setup["refs"]["qwen3_moe"]
        assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0
