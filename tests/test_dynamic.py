"""The adaptive draft budget in the engine: lossless, fed by the engine's steps, and off
where the config fixes K (the controller's decisions: tests/test_draft_budget.py)."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

from .conftest import random_prompts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_adaptive_engine_is_lossless(ckpt_dir, temperature: float, async_scheduling: bool) -> None:
    target = ckpt_dir("llama_gqa", "llama")
    cfg = {"method": "draft_model", "model": target, "num_speculative_tokens": 4}
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 5, 30, seed=2)]
    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=40, ignore_eos=True)
    llm = LLM(target, max_model_len=256, speculative_config=cfg, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, sp)
    ref = LLM(target, max_model_len=256).generate(prompts, sp)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    budget = llm.engine.budget
    assert budget is not None
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts_total"] > 0
    assert 0 <= m["spec_decode_mean_draft_budget"] <= 4
    # The engine fed the controller steady decode steps' times.
    assert sum(c.n.sum() for c in budget.costs.values()) > 0


def assert_same_tokens_and_logprobs(outs: list, ref: list) -> None:
    """Each request's tokens equal the reference's, and its logprobs within 1e-4."""
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t] == pytest.approx(b[t], abs=1e-4)


def test_logprobs_of_steps_without_drafts(ckpt_dir) -> None:
    """Steps at k = 0 compute one logits row a request (not K + 1 copies): their logprobs and
    top logprobs equal plain decoding's, as the drafted steps' do."""
    target = ckpt_dir("llama_gqa", "llama")
    cfg = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 5, 20, seed=4)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    llm = LLM(target, max_model_len=256, speculative_config=cfg)
    chosen: list[int] = []
    choose = llm.engine.budget.choose

    def spy(batch: int, requests: list) -> int:
        chosen.append(choose(batch, requests))
        return chosen[-1]

    llm.engine.budget.choose = spy
    outs = llm.generate(prompts, sp)
    ref = LLM(target, max_model_len=256).generate(prompts, sp)
    assert 0 in chosen and max(chosen) > 0  # both kinds of step ran
    assert_same_tokens_and_logprobs(outs, ref)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_steps_verify_only_the_drafts_they_have(ckpt_dir, temperature: float) -> None:
    """A step whose requests verify at most d < K drafts computes d + 1 logits rows a request,
    not K + 1 (the budget's k = 1 under K = 3 verifies two rows): outputs and logprobs equal
    plain decoding's."""
    target = ckpt_dir("llama_gqa", "llama")
    cfg = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 5, 20, seed=5)]
    sp = SamplingParams(temperature=temperature, seed=7, max_tokens=24, ignore_eos=True, logprobs=1)
    llm = LLM(target, max_model_len=256, speculative_config=cfg)
    pattern = [2, 2, 1, 1, 0, 0]
    calls = iter(range(10**6))
    llm.engine.budget.choose = lambda batch, requests: pattern[next(calls) % len(pattern)]
    model = llm.engine.runner.model
    rows: list[int] = []
    compute = model.compute_logits

    def spy(hidden):  # noqa: ANN001, ANN202
        rows.append(hidden.shape[0])
        return compute(hidden)

    model.compute_logits = spy
    outs = llm.generate(prompts, sp)
    ref = LLM(target, max_model_len=256).generate(prompts, sp)
    assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0
    assert 3 * 3 in rows and 3 * 4 not in rows  # two drafts verified as 3 rows; never K + 1
    assert_same_tokens_and_logprobs(outs, ref)


def test_fixed_k_opt_outs() -> None:
    from specserve.config.speculative import SpeculativeConfig

    def spec(**kw: object) -> SpeculativeConfig:
        return SpeculativeConfig(method="ngram", num_speculative_tokens=3, **kw)

    assert spec().adaptive_budget
    assert not spec(adaptive=False).adaptive_budget
    assert not spec(num_speculative_tokens_per_batch_size={"8": 3}).adaptive_budget
    assert spec(adaptive=False, num_speculative_tokens_per_batch_size="auto").adaptive_budget
    with pytest.raises(ValueError, match="adaptive"):
        spec(adaptive="no")


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
    assert graph_query_lens(spec()) == list(range(1, 7))  # the adaptive default
    assert graph_query_lens(spec(adaptive=False)) == [1, 6]
    assert graph_query_lens(spec(disable_by_batch_size=8)) == [1, 6]
    assert graph_query_lens(spec(num_speculative_tokens_per_batch_size="auto")) == list(range(1, 7))
    sched = spec(num_speculative_tokens_per_batch_size={"4": 5, "16": 3, "64": 1})
    assert graph_query_lens(sched) == [1, 2, 4, 6]


def test_drafting_off_still_writes_the_drafters_prompt_kv(ckpt_dir) -> None:
    """With the budget at 0 and the drafter's KV no longer kept, pure decode steps run no
    drafter (NO_DRAFTER), but a step with a prompt chunk runs the draft prefill: a request that
    arrives while drafting is off has its whole prompt in the drafter's KV."""
    from specserve.spec_decode.interface import NO_DRAFTER

    target = ckpt_dir("llama_gqa", "llama")
    cfg = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    llm = LLM(target, max_model_len=256, speculative_config=cfg, max_num_batched_tokens=16)
    eng = llm.engine
    eng.budget.choose = lambda batch, reqs: 0  # type: ignore[method-assign]
    eng.budget._since_draft = 10**9  # long past the last k > 0: the KV is not kept
    calls: list[tuple[bool, int | None]] = []
    launch = eng.runner.launch

    def recording(sched, lp, num_drafts=None):
        prompt = any(s.num_tokens != 1 + s.num_draft for s in sched.scheduled)
        calls.append((prompt, num_drafts))
        return launch(sched, lp, num_drafts)

    eng.runner.launch = recording  # type: ignore[method-assign]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 20, 40, seed=4)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    ref = LLM(target, max_model_len=256).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert {d for prompt, d in calls if prompt} == {0}
    assert NO_DRAFTER in {d for prompt, d in calls if not prompt}
