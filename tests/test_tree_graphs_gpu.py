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

from __future__ import annotations

import os

import pytest
import torch

from specserve import LLM, SamplingParams

from .conftest import random_prompts
from .spec_utils import write_eagle, write_eagle3, write_mtp_target

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
DYNAMIC = {"draft_tree": {"topk": 3, "depth": 3}, "num_speculative_tokens": 8}
STATIC = {"speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
MODES = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 32},
    "preempt": {"num_gpu_blocks_override": 12, "max_num_batched_tokens": 64},
}


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="module")
def setup(ckpt_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tree_graphs")
    target = ckpt_dir("llama_gqa", "llama")
    return {
        "target": target,
        "draft_model": ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
        "eagle": write_eagle(os.path.join(root, "eagle")),
        "eagle3": write_eagle3(os.path.join(root, "eagle3")),
        "mtp": write_mtp_target(target, os.path.join(root, "mtp_target")),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, 5, 60, seed=3)


def tree_llm(setup: dict, kind: str, tree: dict, **kw: object) -> LLM:
    target = setup["target"]
    cfg: dict = {"adaptive": False, **tree, **kw.pop("spec", {})}  # type: ignore[arg-type]
    if kind == "mtp":
        cfg["method"], target = "mtp", setup["mtp"]
    else:
        cfg |= {"method": kind, "model": setup[kind]}
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)  # graphs of batch 1, 2, 4, 8 only
    return LLM(target, device="cuda", speculative_config=cfg, **kw)


def plain_llm(setup: dict, kind: str, **kw: object) -> LLM:
    target = setup["mtp"] if kind == "mtp" else setup["target"]
    kw.setdefault("dtype", "float32")
    return LLM(target, device="cuda", max_model_len=256, max_num_seqs=8, **kw)


def tokens(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def trees_per_step(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[tuple]:
    """Run to completion; after every step record, per running request, (its tokens so far,
    the K nodes it holds for the next step, their parents)."""
    eng = llm.engine
    k = eng.num_spec_tokens
    state = eng.runner.tree.state
    for i, p in enumerate(prompts):
        eng.add_request(f"t{i}", {"prompt_token_ids": p}, sp)
    seen = []
    while eng.has_unfinished_requests():
        eng.step()
        tok = eng.runner.states.token_ids
        for r in sorted(eng.requests.values(), key=lambda r: r.request_id):
            n = len(r.all_token_ids)
            if r.row >= 0 and not r.is_finished() and r.num_computed_tokens == n - 1:
                nodes = tok[r.row, n : n + k].tolist()
                seen.append((list(r.all_token_ids), nodes, state.parent[r.row].tolist()))
    return seen


@pytest.mark.parametrize("kind", ["draft_model", "eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("tree", [DYNAMIC, STATIC], ids=["dynamic", "static"])
@pytest.mark.parametrize("mode", list(MODES))
def test_tree_graphs_greedy_equal_plain(setup, prompts, kind: str, tree: dict, mode: str) -> None:
    ref = tokens(plain_llm(setup, kind, **MODES[mode]), prompts, GREEDY)
    llm = tree_llm(setup, kind, tree, **MODES[mode])
    assert llm.engine.runner.draft_graphs is not None
    assert tokens(llm, prompts, GREEDY) == ref
    # (A random EAGLE-3 head may have every draft rejected: drafts proposed is what shows.)
    assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0


@pytest.mark.parametrize("kind", ["draft_model", "eagle3"])
def test_tree_graphs_adaptive_equal_plain(setup, prompts, kind: str) -> None:
    """The adaptive budget verifies prefixes of the drafted tree (every q graph)."""
    ref = tokens(plain_llm(setup, kind), prompts, GREEDY)
    llm = tree_llm(setup, kind, DYNAMIC, spec={"adaptive": True})
    assert tokens(llm, prompts, GREEDY) == ref


@pytest.mark.parametrize("kind", ["draft_model", "eagle3", "mtp"])
@pytest.mark.parametrize("tree", [DYNAMIC, STATIC], ids=["dynamic", "static"])
@pytest.mark.parametrize("sampled", [False, True])
def test_tree_graph_replay_equals_eager(setup, prompts, kind, tree, sampled) -> None:
    sp = SamplingParams(temperature=0.8 if sampled else 0.0, seed=3, max_tokens=24, ignore_eos=True)
    runs, acc = {}, {}
    for name, kw in {
        "graphs": {},
        "eager_drafting": {"draft_graph_mode": "eager"},
        "eager": {"enforce_eager": True},
    }.items():
        llm = tree_llm(setup, kind, tree, **kw)
        runs[name] = trees_per_step(llm, prompts[:4], sp)
        acc[name] = llm.get_metrics()["spec_decode_num_accepted_tokens_total"]
    assert runs["graphs"] == runs["eager"]
    assert runs["eager_drafting"] == runs["eager"]
    assert acc["graphs"] == acc["eager"]


def test_tree_graphs_seeded_equal_plain(setup, prompts) -> None:
    sps = [
        SamplingParams(temperature=0.9, seed=11 + i, max_tokens=32, ignore_eos=True)
        for i in range(len(prompts))
    ]
    ref = plain_llm(setup, "eagle3").generate(
        [{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False
    )
    llm = tree_llm(setup, "eagle3", DYNAMIC)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
