"""Speculation on gpt-oss targets: EAGLE-3 heads in the speculators format and parallel
drafting are lossless for K in {1, 3, 5}; a gpt-oss draft model (sinks, alternating windows)
whose 2-token window is crossed while drafting proposes its own greedy continuation."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

from .conftest import random_prompts
from .draft_utils import drafts_per_step
from .spec_utils import write_ptd_eagle3, write_speculators_eagle3
from .test_gpt_oss import WINDOW, gpt_oss_ckpt

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PREEMPT = {"num_gpu_blocks_override": 8, "max_num_batched_tokens": 32}


def _gen(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def setup(ckpt_dir, tmp_path_factory) -> dict:
    target = gpt_oss_ckpt(ckpt_dir)
    prompts = random_prompts(3, 6, 24, seed=4)
    assert max(map(len, prompts)) > WINDOW
    ref = _gen(LLM(target, max_model_len=128), prompts)
    return {
        "root": tmp_path_factory.mktemp("gpt_oss_spec"),
        "target": target,
        "ref": ref,
        "prompts": prompts,
    }


def _spec_llm(setup: dict, spec: dict, **kw) -> LLM:
    return LLM(setup["target"], max_model_len=128, speculative_config=spec, **kw)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculators_eagle3_lossless(setup: dict, k: int) -> None:
    """Aux taps from sliding and full layers; K = 3: a head narrower (32) than the target (64);
    K = 5 under preemption."""
    narrow = k == 3
    head = write_speculators_eagle3(
        str(setup["root"] / f"eagle3_{k}"),
        aux=[0, 1, 2],
        hidden=32 if narrow else 64,
        with_embed=narrow,
    )
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k}
    if k == 5:  # every step drafts 5, so the small pool must preempt
        spec["adaptive"] = False
    llm = _spec_llm(setup, spec, **(PREEMPT if k == 5 else {}))
    assert _gen(llm, setup["prompts"]) == setup["ref"]
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts_total"] > 0
    if k == 5:
        assert m["num_preemptions_total"] > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_parallel_draft_lossless(setup: dict, k: int) -> None:
    head = write_ptd_eagle3(str(setup["root"] / f"ptd_{k}"))
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k, "parallel_draft": True}
    llm = _spec_llm(setup, spec, **(PREEMPT if k == 5 else {}))
    assert _gen(llm, setup["prompts"]) == setup["ref"]
    assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0


def test_gpt_oss_draft_model_crosses_window(setup: dict, ckpt_dir) -> None:
    """A 2-layer gpt-oss draft model (sliding window 2, then full; sinks) drafting K = 5: every
    draft step moves the window, so the per-window metadata must be rebuilt each step. Its
    drafts equal its own greedy continuation computed from scratch, and the target's output is
    unchanged."""
    draft = gpt_oss_ckpt(ckpt_dir, "gpt_oss_draft", num_hidden_layers=2, sliding_window=2)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 5, "adaptive": False}
    alone = LLM(draft, max_model_len=128)

    def from_scratch(tokens: list[int]) -> list[int]:
        out = alone.generate(
            {"prompt_token_ids": tokens}, SamplingParams(temperature=0, max_tokens=5)
        )
        return out[0].outputs[0].token_ids

    llm = _spec_llm(setup, spec)
    assert {m.self_attn.sliding_window for m in llm.engine.speculator.model.lm.model.layers} == {
        2,
        None,
    }
    seen = drafts_per_step(llm, setup["prompts"][:2], GREEDY)
    assert len(seen) > 4
    assert all(d == from_scratch(toks) for toks, d in seen)
    assert _gen(_spec_llm(setup, spec), setup["prompts"]) == setup["ref"]
