"""Draft trees in CUDA graphs (worker/cudagraph.py tree fields, worker/draft_graphs.py "tree").

- Greedy output of a tree engine with graphs equals plain decoding, for every tree-capable
  method, dynamic and static trees, with chunked prefill and preemption mixed in, and with the
  adaptive budget verifying prefixes of the tree.
- Graph replay equals eager, bit for bit: the trees proposed at every step (tokens and
  parents) and the accepted counts are the same with the draft graph, with eager drafting
  behind a replayed target, and with no graphs at all.
- Seeded coupled sampling with trees in graphs equals plain sampling token for token.

Run with `pytest -m gpu`.
"""
# ruff: noqa: F811 (test arguments named as the fixtures imported from test_gpu)

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams

from .draft_utils import drafts_per_step

# The GPU tests' fixtures (an autouse TF32 switch-off, the drafter checkpoints, the prompts),
# engine settings and engines.
from .test_gpu import GREEDY, MODES, _no_tf32, cuda_llm, drafters, prompts  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
DYNAMIC = {"draft_tree": {"topk": 3, "depth": 3}, "num_speculative_tokens": 8}
STATIC = {"speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"}


def tree_llm(drafters: dict, kind: str, tree: dict, **kw: object) -> LLM:
    target = drafters["target"]
    cfg: dict = {"adaptive": False, **tree, **kw.pop("spec", {})}  # type: ignore[arg-type]
    if kind == "mtp":
        cfg["method"], target = "mtp", drafters["mtp"]
    else:
        cfg |= {"method": kind, "model": drafters[kind]}
    return cuda_llm(target, speculative_config=cfg, **kw)


def plain_llm(drafters: dict, kind: str, **kw: object) -> LLM:
    return cuda_llm(drafters["mtp"] if kind == "mtp" else drafters["target"], **kw)


def tokens(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", ["draft_model", "eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("tree", [DYNAMIC, STATIC], ids=["dynamic", "static"])
@pytest.mark.parametrize("mode", list(MODES))
def test_tree_graphs_greedy_equal_plain(
    drafters, prompts, kind: str, tree: dict, mode: str
) -> None:
    ref = tokens(plain_llm(drafters, kind, **MODES[mode]), prompts, GREEDY)
    llm = tree_llm(drafters, kind, tree, **MODES[mode])
    assert llm.engine.runner.draft_graphs is not None
    assert tokens(llm, prompts, GREEDY) == ref
    # (A random EAGLE-3 head may have every draft rejected: drafts proposed is what shows.)
    assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0


@pytest.mark.parametrize("kind", ["draft_model", "eagle3"])
def test_tree_graphs_adaptive_equal_plain(drafters, prompts, kind: str) -> None:
    """The adaptive budget verifies prefixes of the drafted tree (every q graph)."""
    ref = tokens(plain_llm(drafters, kind), prompts, GREEDY)
    llm = tree_llm(drafters, kind, DYNAMIC, spec={"adaptive": True})
    assert tokens(llm, prompts, GREEDY) == ref


@pytest.mark.parametrize("kind", ["draft_model", "eagle3", "mtp"])
@pytest.mark.parametrize("tree", [DYNAMIC, STATIC], ids=["dynamic", "static"])
@pytest.mark.parametrize("sampled", [False, True])
def test_tree_graph_replay_equals_eager(drafters, prompts, kind, tree, sampled) -> None:
    sp = SamplingParams(temperature=0.8 if sampled else 0.0, seed=3, max_tokens=24, ignore_eos=True)
    runs, acc = {}, {}
    for name, kw in {
        "graphs": {},
        "eager_drafting": {"draft_graph_mode": "eager"},
        "eager": {"enforce_eager": True},
    }.items():
        llm = tree_llm(drafters, kind, tree, **kw)
        runs[name] = drafts_per_step(llm, prompts[:4], sp, with_parents=True)
        acc[name] = llm.get_metrics()["spec_decode_num_accepted_tokens_total"]
    assert runs["graphs"] == runs["eager"]
    assert runs["eager_drafting"] == runs["eager"]
    assert acc["graphs"] == acc["eager"]


def test_tree_graphs_seeded_equal_plain(drafters, prompts) -> None:
    sps = [
        SamplingParams(temperature=0.9, seed=11 + i, max_tokens=32, ignore_eos=True)
        for i in range(len(prompts))
    ]
    ref = plain_llm(drafters, "eagle3").generate(
        [{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False
    )
    llm = tree_llm(drafters, "eagle3", DYNAMIC)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
