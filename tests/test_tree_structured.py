"""Structured outputs with draft trees, on the embedded model (CPU).

- `fill_tree_masks`: each node's row is the row a chain fill gives after that node's path; the
  matcher ends where it started, and `commit` walks the accepted path.
- JSON schema, regex and choice requests, greedy and seeded (coupled) sampling, mixed with
  unconstrained requests, with a static and a dynamic EAGLE-3 tree: outputs equal plain
  decoding token for token and are valid.
- Logits processors stay refused with draft trees.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from specserve import LLM, SamplingParams, StructuredOutputsParams
from specserve.data import load_prompts

from .test_draft_trees import STATIC
from .test_structured import CHOICES, FAMILY, REGEX, SCHEMA, json_grammar_setup

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DYNAMIC = {"draft_tree": {"topk": 2, "depth": 3}, "num_speculative_tokens": 6}


@pytest.fixture(scope="module")
def family() -> tuple[str, dict[str, Any]]:
    return FAMILY()


def test_tree_masks_follow_each_nodes_path(family: tuple[str, dict[str, Any]]) -> None:
    import xgrammar as xgr

    from specserve.structured.matcher import GrammarViolationError

    tok, so, params, ids, vocab, eos = json_grammar_setup(family)
    g = so.new_request(params)
    row0 = xgr.allocate_token_bitmask(1, vocab)
    g.fill_masks([], row0, 0)
    bad = next(t for t in range(vocab) if not (row0[0, t // 32] >> (t % 32)) & 1)
    # Node: 1 2 3 4 5 6 7 8 9 (0 = root); node 2 is forbidden at the root (its child 7 too),
    # node 8 is the stop token mid-object, node 9 follows node 5 off the text.
    parents = [0, 0, 0, 1, 1, 3, 3, 2, 5, 5]
    tokens = [ids[0], bad, ids[1], ids[2], ids[2], ids[3], ids[0], eos, ids[1]]

    def path(m: int) -> list[int]:
        return path(parents[m]) + [tokens[m - 1]] if m else []

    n = len(tokens)
    bm = xgr.allocate_token_bitmask(n + 3, vocab)
    g.fill_tree_masks(tokens, parents, bm, 2)
    assert g.num_tentative == 0
    assert (bm[:2] == -1).all() and (bm[n + 3 :] == -1).all()
    chain = so.new_request(params)
    for m in range(n + 1):
        want = xgr.allocate_token_bitmask(len(path(m)) + 1, vocab)
        chain.fill_masks(path(m), want, 0)
        assert torch.equal(bm[2 + m], want[-1]), m
    # Verification accepted nodes 1, 3 (ids[0], ids[1]) and emitted ids[2]: all kept.
    assert g.commit([ids[0], ids[1], ids[2]], 2) == 3
    g.fill_masks([], row0, 0)
    chain.fill_masks(ids[:3], want := xgr.allocate_token_bitmask(4, vocab), 0)
    assert torch.equal(row0[0], want[3])
    # A path the grammar forbids: a bug, loud.
    g.fill_tree_masks([bad], [0, 0], bm, 0)
    with pytest.raises(GrammarViolationError):
        g.commit([bad, ids[3]], 1)


def _params() -> list[SamplingParams]:
    kinds = [
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(choice=CHOICES),
        None,
    ]
    greedy = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=s) for s in kinds]
    sampled = [
        SamplingParams(temperature=0.8, seed=7 + i, max_tokens=48, structured_outputs=s)
        for i, s in enumerate(kinds)
    ]
    return greedy + sampled


def _check_valid(sp: SamplingParams, text: str, finish: str | None) -> None:
    so = sp.structured_outputs
    if so is None:
        return
    assert finish == "stop", text
    if so.json is not None:
        jsonschema.validate(json.loads(text), SCHEMA)
    elif so.regex is not None:
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.mark.parametrize("tree", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_tree_structured_equals_plain(family: tuple[str, dict[str, Any]], tree: dict) -> None:
    target, eagle3 = family
    sps = _params()
    prompts = [r["prompt"] for r in load_prompts("code", len(sps))]
    want = [o.outputs[0] for o in LLM(target).generate(prompts, sps, use_tqdm=False)]
    for sp, c in zip(sps, want):
        _check_valid(sp, c.text, c.finish_reason)
    spec = {k: v for k, v in eagle3.items() if k != "num_speculative_tokens"}
    llm = LLM(target, speculative_config={**spec, "adaptive": False, **tree})
    got = [o.outputs[0] for o in llm.generate(prompts, sps, use_tqdm=False)]
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids, (a.text, b.text)
        assert b.finish_reason == a.finish_reason
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens_total"] > 0
    with pytest.raises(ValueError, match="logits processors .* not supported with draft trees"):
        llm.generate(["x"], SamplingParams(logit_bias={1: 1.0}), use_tqdm=False)
