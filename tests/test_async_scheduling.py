"""Async scheduling (`async_scheduling=True`): step N+1 is scheduled and launched before step N's
results are read. The tokens must be exactly those of the synchronous engine, whatever finishes
while a step is in flight."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

from .conftest import hf_greedy, random_prompts


def _params(n: int) -> list[SamplingParams]:
    """Greedy and seeded sampled requests with different lengths, some stopped by a token."""
    out = []
    for i in range(n):
        out.append(
            SamplingParams(
                temperature=0.0 if i % 2 else 0.9,
                seed=i,
                max_tokens=4 + 9 * i,
                stop_token_ids=[i * 37 % 300 + 3] if i % 3 == 0 else [],
            )
        )
    return out


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _count_overlaps(llm: LLM) -> dict[str, int]:
    """Count launches made while an earlier step's results were still unread."""
    runner, stats = llm.engine.runner, {"outstanding": 0, "overlapped": 0}
    launch, finish = runner.launch, runner.finish

    def counted_launch(*a, **kw):
        stats["overlapped"] += stats["outstanding"] > 0
        stats["outstanding"] += 1
        return launch(*a, **kw)

    def counted_finish(p):
        stats["outstanding"] -= 1
        return finish(p)

    runner.launch, runner.finish = counted_launch, counted_finish
    return stats


MODES = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 16},
    "preempt": {"num_gpu_blocks_override": 12, "max_num_batched_tokens": 64},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_async_equals_sync(ckpt_dir, mode: str) -> None:
    path = ckpt_dir("llama_gqa", "llama")
    prompts = random_prompts(8, 3, 40, seed=11)
    params = _params(8)
    ref = _run(LLM(path, max_model_len=128, **MODES[mode]), prompts, params)
    llm = LLM(path, max_model_len=128, async_scheduling=True, **MODES[mode])
    stats = _count_overlaps(llm)
    assert _run(llm, prompts, params) == ref
    assert stats["overlapped"] > 10  # steps really were launched ahead
    assert stats["outstanding"] == 0 and llm.engine._inflight is None
    assert llm.engine.kv.usage() == 0.0
    if mode == "preempt":
        assert llm.engine.stats.num_preemptions > 0


def test_async_overlaps_with_the_default_kv_size(ckpt_dir) -> None:
    """The default KV cache holds max_num_seqs * max_model_len tokens and no more: a lone decode
    must still overlap every step but the first and the last few."""
    path = ckpt_dir("llama_gqa", "llama")
    prompts = random_prompts(1, 20, 20, seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = _run(LLM(path, max_model_len=128, max_num_seqs=1), prompts, [sp])
    llm = LLM(path, max_model_len=128, max_num_seqs=1, async_scheduling=True)
    stats = _count_overlaps(llm)
    assert _run(llm, prompts, [sp]) == ref
    assert stats["overlapped"] >= 36


def test_async_greedy_matches_transformers(ckpt_dir) -> None:
    path = ckpt_dir("qwen3_tied", "qwen3", tie_word_embeddings=True, head_dim=32)
    prompts = random_prompts(4, 5, 30, seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = _run(LLM(path, max_model_len=128, async_scheduling=True), prompts, [sp] * 4)
    for p, (toks, _) in zip(prompts, outs):
        assert toks == hf_greedy(path, p, 32)


def test_abort_while_a_step_is_in_flight(ckpt_dir) -> None:
    path = ckpt_dir("llama_gqa", "llama")
    prompts = random_prompts(4, 5, 20, seed=2)
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref = _run(LLM(path, max_model_len=128), prompts, [sp] * 4)
    llm = LLM(path, max_model_len=128, async_scheduling=True)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, sp)
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        steps += 1
        if steps == 6:
            assert eng._inflight is not None  # request 1 is in the step in flight
            eng.abort_request("1")
    assert "1" not in done
    assert [done[str(i)] for i in (0, 2, 3)] == [ref[i][0] for i in (0, 2, 3)]
    assert eng._inflight is None and eng.kv.usage() == 0.0


# ---- behind steps that verify drafts ---------------------------------------------------------
@pytest.fixture(scope="module")
def drafters(ckpt_dir, tmp_path_factory) -> dict[str, str]:
    import os

    from .spec_utils import (
        write_eagle3,
        write_mtp_target,
        write_multi_mtp_target,
        write_ptd_eagle3,
    )

    root = tmp_path_factory.mktemp("async_drafters")
    target = ckpt_dir("llama_gqa", "llama")
    return {
        "target": target,
        "draft_model": ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
        "eagle3": write_eagle3(os.path.join(root, "eagle3")),
        "ptd": write_ptd_eagle3(os.path.join(root, "ptd")),
        "mtp": write_mtp_target(target, os.path.join(root, "mtp")),
        "mtp3": write_multi_mtp_target(target, os.path.join(root, "mtp3"), 3, seed=3),
    }


def _spec(drafters: dict[str, str], method: str, k: int) -> tuple[str, dict]:
    target = drafters["target"]
    if method in ("mtp", "mtp3"):
        return drafters[method], {"method": "mtp", "num_speculative_tokens": k}
    if method == "ptd":
        return target, {
            "method": "eagle3",
            "model": drafters["ptd"],
            "num_speculative_tokens": k,
            "parallel_draft": True,
        }
    return target, {"method": method, "model": drafters[method], "num_speculative_tokens": k}


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "mtp", "ptd", "mtp3"])
@pytest.mark.parametrize("mode", list(MODES))
def test_async_speculative_equals_sync(drafters, method: str, mode: str) -> None:
    """Step N+1 launched before N's accept counts are read: scheduled as if every draft were
    accepted, placed on the device. Same tokens as the synchronous engine (greedy and seeded
    sampling, stops, chunking, preemption), also with self-drafting (all accepted)."""
    target, cfg = _spec(drafters, method, 3)
    prompts = random_prompts(6, 3, 40, seed=12)
    params = _params(6)
    kw = {"max_model_len": 160, **MODES[mode]}
    ref = _run(LLM(target, speculative_config=cfg, **kw), prompts, params)
    llm = LLM(target, speculative_config=cfg, async_scheduling=True, **kw)
    stats = _count_overlaps(llm)
    assert _run(llm, prompts, params) == ref
    assert stats["overlapped"] > 5
    assert llm.engine._inflight is None and llm.engine.kv.usage() == 0.0
    assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0


def test_async_self_drafting_accepts_everything(drafters) -> None:
    """Every draft accepted: the upper-bound start is the true one (delta 0 on the device)."""
    target = drafters["target"]
    # Fixed K: the adaptive budget's stretches without drafting leave holes in the drafter's KV.
    cfg = {"method": "draft_model", "model": target, "num_speculative_tokens": 4, "adaptive": False}
    prompts = random_prompts(3, 5, 20, seed=4)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM(target, speculative_config=cfg, async_scheduling=True, max_model_len=160)
    stats = _count_overlaps(llm)
    outs = _run(llm, prompts, [sp] * 3)
    ref = _run(LLM(target, max_model_len=160), prompts, [sp] * 3)
    assert outs == ref and stats["overlapped"] > 3
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens_total"] == m["spec_decode_num_draft_tokens_total"]


def test_async_kv_follows_the_accepted_tokens(drafters) -> None:
    """Each step behind one that verifies drafts holds KV for the host's true count plus two
    steps' drafts, not for a bound built on the last step's bound (which grew by 1 + K
    positions a step whatever was accepted, filled the cache and stopped the overlap)."""
    target, cfg = _spec(drafters, "eagle3", 3)
    cfg["adaptive"] = False  # K = 3 every step; the random head's drafts are all rejected
    llm = LLM(target, speculative_config=cfg, async_scheduling=True, max_model_len=480)
    eng, kv = llm.engine, llm.engine.kv
    stats = _count_overlaps(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    eng.add_request("a", {"prompt_token_ids": random_prompts(1, 20, 21, seed=3)[0]}, sp)
    worst = 0
    while eng.has_unfinished_requests():
        eng.step()
        for req in eng.scheduler.running:
            slack = len(req.block_ids) - kv.blocks_needed(req.num_computed_tokens)
            worst = max(worst, slack)
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens_total"] < m["spec_decode_num_draft_tokens_total"] / 2
    assert stats["overlapped"] > 50
    # Two steps of 1 + K = 4 positions and the drafter's lookahead: at most one block past
    # the computed tokens' (16-token blocks), where the compounding bound reached 21.
    assert worst <= kv.blocks_needed(2 * 4 + kv.lookahead) + 1, worst


@pytest.mark.parametrize("speculative", [False, True])
def test_preemption_while_a_step_is_in_flight(ckpt_dir, drafters, monkeypatch, speculative) -> None:
    """Overlap forced even when the KV cache is nearly full: requests preempted while the step
    before is in flight restart from their host tokens; the outputs do not change."""
    from specserve.engine.engine import LLMEngine

    target, cfg = _spec(drafters, "eagle3", 3) if speculative else (drafters["target"], None)
    prompts = random_prompts(6, 10, 40, seed=8)
    params = _params(6)
    kw = {"max_model_len": 160, "num_gpu_blocks_override": 12, "max_num_batched_tokens": 64}
    ref = _run(LLM(target, speculative_config=cfg, **kw), prompts, params)
    llm = LLM(target, speculative_config=cfg, async_scheduling=True, **kw)
    monkeypatch.setattr(LLMEngine, "_can_overlap", lambda self, sched: True)
    stats = _count_overlaps(llm)
    assert _run(llm, prompts, params) == ref
    assert stats["overlapped"] > 5 and llm.engine.stats.num_preemptions > 0
    assert llm.engine.kv.usage() == 0.0


def test_async_default_follows_the_device(tmp_path) -> None:
    """async_scheduling=None (the default) is on for CUDA, as in vLLM, and off on CPU, where
    the host runs the kernels itself and there is nothing to overlap; an explicit value wins."""
    from specserve.config import EngineConfig

    d = str(tmp_path)
    assert EngineConfig(model=d, device="cpu").async_scheduling is False
    assert EngineConfig(model=d, device="cuda").async_scheduling is True
    assert EngineConfig(model=d, device="cuda:0").async_scheduling is True
    assert EngineConfig(model=d, device="cuda", async_scheduling=False).async_scheduling is False
    assert EngineConfig(model=d, device="cpu", async_scheduling=True).async_scheduling is True
    assert EngineConfig(model=d).decode_matmul == "auto"
