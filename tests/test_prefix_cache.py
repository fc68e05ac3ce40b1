"""Automatic prefix caching with every drafter: a hit reuses target and drafter KV exactly, so
outputs, the drafts proposed at every step, and per-request drafts / accepted tokens equal a run
without the cache; a hit covers exactly what the rule allows (asserted against an independent
reference over the earlier requests' tokens); preemption, aborts and chunked prefill leak no
block; the pool's reference counts and LRU eviction; every attention variant (GQA, MLA latent,
gpt-oss windows + sinks) and a bf16 KV cache."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from specserve.engine.kv_cache import BlockPool, KVCacheManager

from .conftest import random_prompts
from .mla_utils import mla_ckpt  # noqa: F401
from .spec_utils import (
    write_eagle,
    write_eagle3,
    write_mtp_target,
    write_multi_mtp_target,
    write_ptd_eagle3,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGET = ("llama_gqa", "llama")
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# method -> the drafter's KV lookahead (Speculator.kv_lookahead)
METHODS = {
    "none": 0,
    "ngram": 0,
    "draft_model": 0,
    "eagle": 1,
    "eagle3": 1,
    "mtp": 1,
    "mtp_multi": 2,
    "ptd": 1,
}


@pytest.fixture(scope="module")
def setup(ckpt_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("prefix_cache")
    target = ckpt_dir(*TARGET)
    base = random_prompts(1, 30, 30, seed=5)[0]
    tail = random_prompts(4, 3, 3, seed=6)
    # Shared prefixes of different lengths: block-aligned (12, 16) and not (13, 22), one that
    # ends exactly where a block's lookahead token would be, and the same prompt again.
    prompts = [
        base,
        base[:16] + tail[0],
        base[:13] + tail[1],
        base[:22] + tail[2],
        base[:12] + tail[3][:1] + base[13:20],
        base,
    ]
    return {
        "target": target,
        "prompts": prompts,
        "draft_model": ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
        "eagle": write_eagle(os.path.join(root, "eagle")),
        "eagle3": write_eagle3(os.path.join(root, "eagle3")),
        "mtp": write_mtp_target(target, os.path.join(root, "mtp")),
        "mtp_multi": write_multi_mtp_target(target, os.path.join(root, "mtp2"), 2, seed=3),
        "ptd": write_ptd_eagle3(os.path.join(root, "ptd")),
    }


@pytest.fixture
def engines() -> Iterator[list[LLM]]:
    """LLMs a test builds; afterwards every block of each is free or cached-free with no
    reference left (KVCacheManager.check_no_leaks)."""
    made: list[LLM] = []
    yield made
    for llm in made:
        assert not llm.engine.has_unfinished_requests()
        llm.engine.kv.check_no_leaks()
        assert llm.get_metrics()["kv_cache_usage_perc"] == 0.0


def fixed_budget() -> dict[str, Any]:
    """Speculative-config fields that make every step draft K: the drafts of two runs are then
    comparable step by step (the adaptive budget picks K from measured step times)."""
    names = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    return {"adaptive": False} if "adaptive" in names else {}


def make_llm(setup: dict, method: str, made: list[LLM], fixed_k: bool = True, **kw: Any) -> LLM:
    """`fixed_k`: every step drafts K; else the engine's default budget (K chosen per step)."""
    target = setup["target"]
    k = 2 if method == "mtp_multi" else 3
    spec: dict[str, Any] | None = {"method": method, "num_speculative_tokens": k}
    if fixed_k:
        spec.update(fixed_budget())
    if method == "none":
        spec = None
    elif method in ("draft_model", "eagle", "eagle3"):
        spec["model"] = setup[method]
    elif method in ("mtp", "mtp_multi"):
        spec["method"], target = "mtp", setup[method]
    elif method == "ptd":
        spec.update(method="eagle3", model=setup["ptd"], parallel_draft=True)
    kw.setdefault("block_size", BLOCK)
    llm = LLM(target, max_model_len=128, speculative_config=spec, **kw)
    made.append(llm)
    return llm


def run_one(llm: LLM, prompt: list[int], sp: SamplingParams = GREEDY) -> dict[str, Any]:
    """One request alone: its output, the drafts it holds after every step, and its metrics."""
    eng = llm.engine
    req = eng.add_request(f"r{eng.stats.prompt_tokens}", {"prompt_token_ids": prompt}, sp)
    k = eng.num_spec_tokens
    drafts, out = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        if req.row >= 0 and not req.is_finished():
            n = req.num_tokens
            drafts.append(eng.runner.states.token_ids[req.row, n : n + k].tolist())
    assert out is not None and out.finished
    return {
        "tokens": list(out.outputs[0].token_ids),
        "drafts": drafts,
        "cached": out.num_cached_tokens,
        "num_drafts": out.metrics.num_drafts,
        "accepted": out.metrics.num_accepted_tokens,
    }


def expected_hit(prompt: list[int], earlier: list[list[int]], lookahead: int) -> int:
    """The rule, from the tokens alone: the longest block-aligned prefix m * B that an earlier
    request computed and registered (its KV final: m * B + max(L - 1, 0) <= its computed
    tokens, which are all its tokens but the last), whose tokens and the L after it agree, and
    that leaves the prompt's last token and the lookahead to compute."""
    best = 0
    for seq in earlier:
        m = 0
        while True:
            end = (m + 1) * BLOCK
            if end + max(lookahead, 1) > len(prompt):
                break
            if end + max(lookahead - 1, 0) > len(seq) - 1:
                break
            if prompt[: end + lookahead] != seq[: end + lookahead]:
                break
            m += 1
        best = max(best, m * BLOCK)
    return best


@pytest.mark.parametrize(
    ("method", "async_scheduling"),
    [(m, False) for m in METHODS] + [("eagle", True), ("mtp_multi", True)],
)
def test_hit_is_exact(setup: dict, method: str, async_scheduling: bool, engines: list[LLM]) -> None:
    """Requests one after another sharing prefixes of different lengths: with the cache on,
    outputs, the drafts proposed after every step and per-request drafts / accepted tokens equal
    the cache-off run; each hit is exactly the rule's (and so is what the scheduler computed).
    Async scheduling registers blocks from the results of a step launched behind another."""
    kw = {"async_scheduling": async_scheduling}
    off = make_llm(setup, method, engines, enable_prefix_caching=False, **kw)
    on = make_llm(setup, method, engines, **kw)
    assert on.engine.kv.lookahead == METHODS[method]
    earlier: list[list[int]] = []
    for p in setup["prompts"]:
        a, b = run_one(off, p), run_one(on, p)
        assert a["cached"] == 0
        assert b["cached"] == expected_hit(p, earlier, METHODS[method]), p
        for key in ("tokens", "drafts", "num_drafts", "accepted"):
            assert a[key] == b[key], key
        earlier.append(p + b["tokens"])
    m = on.get_metrics()
    assert m["prefix_cache_hits_total"] > 0
    assert m["prefix_cache_queries_total"] == sum(map(len, setup["prompts"]))
    assert off.get_metrics()["prefix_cache_hits_total"] == 0


@pytest.mark.parametrize("method", ["self", "eagle", "mtp_multi"])
def test_second_request_computes_only_the_rule(
    setup: dict, method: str, engines: list[LLM]
) -> None:
    """The same prompt (29 tokens, blocks of 4) twice: the second computes only what follows
    the hit, which leaves max(L, 1) tokens: 28 cached for L <= 1, 24 for multi-layer MTP's
    L = 2. Drafts and accepted tokens equal the first's; with the target as its own draft
    model ("self") every draft is accepted."""
    if method == "self":
        spec = {"method": "draft_model", "model": setup["target"], "num_speculative_tokens": 3}
        llm = LLM(
            setup["target"],
            max_model_len=128,
            block_size=BLOCK,
            speculative_config={**spec, **fixed_budget()},
        )
        engines.append(llm)
    else:
        llm = make_llm(setup, method, engines)
    prompt = setup["prompts"][0][:29]
    first_step: dict[str, tuple[int, int]] = {}  # request id -> (start, tokens) of its first step
    schedule = llm.engine.scheduler.schedule

    def recording(*a: Any, **kw: Any) -> Any:
        out = schedule(*a, **kw)
        for s in out.scheduled:
            first_step.setdefault(s.req.request_id, (s.start, s.num_tokens))
        return out

    llm.engine.scheduler.schedule = recording  # type: ignore[method-assign]
    first = run_one(llm, prompt)
    second = run_one(llm, prompt)
    hit = {"self": 28, "eagle": 28, "mtp_multi": 24}[method]
    assert second["cached"] == hit
    # The whole prompt the first time; only what follows the hit the second.
    assert sorted(first_step.values()) == [(0, len(prompt)), (hit, len(prompt) - hit)]
    assert (second["tokens"], second["drafts"]) == (first["tokens"], first["drafts"])
    assert (second["num_drafts"], second["accepted"]) == (first["num_drafts"], first["accepted"])
    if method == "self":
        assert first["accepted"] > 0


@pytest.mark.parametrize("method", ["eagle", "mtp_multi", "ptd"])
def test_seeded_sampling_hit_equals_miss(setup: dict, method: str, engines: list[LLM]) -> None:
    sp = SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
    p = setup["prompts"][0]
    miss = run_one(make_llm(setup, method, engines, enable_prefix_caching=False), p, sp)
    on = make_llm(setup, method, engines)
    run_one(on, p, sp)
    hit = run_one(on, p, sp)
    assert hit["cached"] > 0
    assert (hit["tokens"], hit["drafts"]) == (miss["tokens"], miss["drafts"])


MIXED = {"max_num_batched_tokens": 12, "num_gpu_blocks_override": 24, "max_num_seqs": 6}


@pytest.mark.parametrize(
    ("method", "async_scheduling"),
    [(m, False) for m in METHODS] + [("eagle", True), ("mtp_multi", True), ("none", True)],
)
def test_mixed_load(setup: dict, method: str, async_scheduling: bool, engines: list[LLM]) -> None:
    """Shared prefixes in one batch with chunked prefill, a cache small enough to preempt and
    aborts (one mid-prefill, one mid-decode), with and without async scheduling, the draft
    budget the engine's default (K may change per step): every completed output equals the
    cache-off output; nothing leaks."""
    prompts = setup["prompts"] * 2
    ref_llm = make_llm(setup, method, engines, enable_prefix_caching=False)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY
    )]  # fmt: skip
    kw = {"async_scheduling": async_scheduling, **MIXED}
    eng = make_llm(setup, method, engines, fixed_k=False, **kw).engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        steps += 1
        if steps == 1:
            eng.abort_request("1")  # mid-prefill
        if steps == 6:
            eng.abort_request("7")
    assert "1" not in done
    for i, toks in done.items():
        assert toks == ref[int(i)], i
    assert len(done) >= len(prompts) - 2
    m = eng.metrics_snapshot()
    assert m["num_preemptions_total"] > 0 and m["prefix_cache_hits_total"] > 0


@pytest.mark.parametrize("method", ["eagle", "mtp_multi", "ptd", "draft_model"])
def test_shared_blocks_are_read_only(setup: dict, method: str, engines: list[LLM]) -> None:
    """Every KV layer (target and drafter) of the blocks a request hits is bit for bit what it
    was before that request ran: no step writes below a hit."""
    import torch

    llm = make_llm(setup, method, engines)
    eng = llm.engine
    run_one(llm, setup["prompts"][0])
    pool = eng.kv.pool
    cached = sorted(pool.cached.values())
    assert cached
    before = [c[:, cached].clone() for c in eng.runner.kv_caches]
    for p in setup["prompts"][1:]:
        assert run_one(llm, p)["cached"] > 0 or p is setup["prompts"][4]
    # Blocks the later requests hit are still cached (nothing was evicted: a large pool).
    assert set(cached) <= set(pool.cached.values())
    for b, c in zip(before, eng.runner.kv_caches):
        assert torch.equal(b, c[:, cached])


# ---- attention variants and the KV dtype ------------------------------------------------


def _variant_equal(target: str, prompts: list[list[int]], made: list[LLM], **kw: Any) -> None:
    outs = []
    for cache in (False, True):
        llm = LLM(target, max_model_len=128, block_size=BLOCK, enable_prefix_caching=cache, **kw)
        made.append(llm)
        outs.append([run_one(llm, p)["tokens"] for p in prompts])
        if cache:
            assert llm.get_metrics()["prefix_cache_hits_total"] > 0
    assert outs[0] == outs[1]


def test_gpt_oss_windows_and_sinks(ckpt_dir: Any, setup: dict, engines: list[LLM]) -> None:
    """Alternating windowed (8) and full layers with sinks: hits far past the window."""
    from .test_gpt_oss import gpt_oss_ckpt

    _variant_equal(gpt_oss_ckpt(ckpt_dir), setup["prompts"][:4], engines)


def test_mla_latent_cache(mla_ckpt: Any, setup: dict, engines: list[LLM]) -> None:  # noqa: F811
    _variant_equal(mla_ckpt("deepseek_v3"), setup["prompts"][:3], engines)


def test_bf16_kv(setup: dict, engines: list[LLM]) -> None:
    _variant_equal(setup["target"], setup["prompts"][:3], engines, dtype="bfloat16")
    a = KVCacheManager(8, BLOCK, 64, True, salt=("m", "None", "torch.float32"))
    b = KVCacheManager(8, BLOCK, 64, True, salt=("m", "None", "torch.bfloat16"))
    assert a.root != b.root  # the KV dtype is part of every key


# ---- the pool -------------------------------------------------------------------------------


def test_block_pool_refcounts_and_lru() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.publish(0, b"k0") and pool.publish(1, b"k1")
    assert not pool.publish(2, b"k0")  # a key held by another block stays private
    pool.touch([0])  # a second request shares block 0
    assert pool.ref_count[0] == 2 and pool.usage() == 0.5  # a shared block counts once
    pool.free(a)
    assert pool.ref_count[0] == 1 and pool.num_free == 3  # block 1 is cached-free
    pool.free([0])
    assert pool.num_free == 4 and pool.usage() == 0.0 and set(pool.cached) == {b"k0", b"k1"}
    pool.check_no_leaks()
    # Free blocks first, then cached ones, the least recently freed first (1 before 0:
    # a request's blocks are freed tail first).
    assert pool.allocate(3) == [2, 3, 1] and set(pool.cached) == {b"k0"}
    pool.touch([0])
    with pytest.raises(AssertionError, match="still referenced"):
        pool.check_no_leaks()
    pool.free([0, 1, 2, 3])
    pool.check_no_leaks()


def test_disabled_and_flag(setup: dict, engines: list[LLM]) -> None:
    import argparse

    from specserve.entrypoints.cli import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--model", "m"]).enable_prefix_caching is True
    assert (
        p.parse_args(["--model", "m", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    )
    llm = make_llm(setup, "none", engines, enable_prefix_caching=False)
    run_one(llm, setup["prompts"][0])
    assert run_one(llm, setup["prompts"][0])["cached"] == 0
    assert llm.get_metrics()["prefix_cache_queries_total"] == 0
