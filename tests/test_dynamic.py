"""Automatic K: the controller picks the K that maximizes expected tokens per second, and an
engine running it stays lossless."""

from __future__ import annotations

import numpy as np
import pytest

from specserve import LLM, SamplingParams
from specserve.spec_decode.dynamic import AutoSpecController

from .conftest import random_prompts


def simulate(acceptance: float, cost_per_draft: float, steps: int = 400, batch: int = 8) -> int:
    """Feed the controller steps whose time is 1 + cost_per_draft * K and whose drafts are each
    accepted with probability `acceptance`; return the K it settles on (most chosen at the end)."""
    rng = np.random.default_rng(0)
    c = AutoSpecController(max_k=6)
    chosen = []
    for _ in range(steps):
        k = c.choose(batch)
        chosen.append(k)
        c.record_step(batch, k, 1.0 + cost_per_draft * k)
        for _ in range(batch):
            n = 0
            while n < k and rng.random() < acceptance:
                n += 1
            c.record_acceptance(k, n)
    return int(np.bincount(chosen[-100:]).argmax())


def best_k(acceptance: float, cost_per_draft: float, max_k: int = 6) -> int:
    ks = np.arange(max_k + 1)
    tokens = np.array([sum(acceptance**i for i in range(k + 1)) for k in ks])
    return int(np.argmax(tokens / (1.0 + cost_per_draft * ks)))


@pytest.mark.parametrize("acceptance, cost", [(0.9, 0.05), (0.6, 0.1), (0.3, 0.3), (0.05, 0.2)])
def test_controller_finds_the_best_k(acceptance: float, cost: float) -> None:
    want = best_k(acceptance, cost)
    got = simulate(acceptance, cost)
    assert abs(got - want) <= 1, (got, want)
    if want == 0:
        assert got == 0


def test_auto_k_engine_is_lossless(ckpt_dir) -> None:
    target = ckpt_dir("llama_gqa", "llama")
    cfg = {
        "method": "draft_model",
        "model": target,  # self-drafting: every draft accepted, so auto should keep K high
        "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": "auto",
    }
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 5, 30, seed=2)]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM(target, max_model_len=256, speculative_config=cfg)
    outs = llm.generate(prompts, sp)
    ref = LLM(target, max_model_len=256).generate(prompts, sp)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    ctl = llm.engine.auto_k
    assert ctl is not None
    assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0
    # The engine fed the controller its decode steps' times (a check made after the step's
    # tokens were appended once saw no decode step at all, and K never moved).
    assert ctl.times and sum(c.sum() for c in ctl.counts.values()) > 0


def test_unreached_positions_keep_their_estimate() -> None:
    """Many steps at K = 1 must not erase what was learned about deeper positions, or the
    controller would never go back to a larger K."""
    c = AutoSpecController(max_k=4)
    for _ in range(50):
        c.record_acceptance(4, 4)  # all accepted: deep positions look good
    before = c.acceptance().copy()
    for _ in range(5000):
        c.record_acceptance(1, 1)
    after = c.acceptance()
    np.testing.assert_allclose(after[1:], before[1:])
    assert after[0] > 0.99


def test_auto_k_config_validation() -> None:
    from specserve.config.speculative import SpeculativeConfig

    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
        SpeculativeConfig.from_dict(
            {"method": "ngram", "num_speculative_tokens_per_batch_size": "fast"}
        )
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
        SpeculativeConfig.from_dict(
            {"method": "ngram", "num_speculative_tokens": 2,
             "num_speculative_tokens_per_batch_size": {"8": 5}}
        )  # fmt: skip
    c = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3,
         "num_speculative_tokens_per_batch_size": {"8": 3, "64": 0}}
    )  # fmt: skip
    assert c.num_speculative_tokens_per_batch_size == {8: 3, 64: 0}


def test_graphs_cover_every_k_the_engine_may_choose() -> None:
    """Under dynamic speculation every K in use has captured target graphs (1 + K tokens per
    request); a K without them would run its target forward eagerly."""
    from specserve.config.speculative import SpeculativeConfig
    from specserve.worker.cudagraph import graph_query_lens

    def spec(**kw: object) -> SpeculativeConfig:
        return SpeculativeConfig(method="ngram", num_speculative_tokens=5, **kw)

    assert graph_query_lens(None) == [1]
    assert graph_query_lens(spec()) == [1, 6]
    assert graph_query_lens(spec(disable_by_batch_size=8)) == [1, 6]
    assert graph_query_lens(spec(num_speculative_tokens_per_batch_size="auto")) == list(range(1, 7))
    sched = spec(num_speculative_tokens_per_batch_size={"4": 5, "16": 3, "64": 1})
    assert graph_query_lens(sched) == [1, 2, 4, 6]
