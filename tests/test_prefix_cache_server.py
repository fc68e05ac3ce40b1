"""Prefix caching through the real server, with an EAGLE drafter (its KV reads the token after
each position) and a KV cache small enough to preempt: streamed requests sharing prefixes, with
client disconnects, give every completed request its solo output and leak no block; the usage
reports cached_tokens; `bench serve` runs the multi-turn and prefix_repetition datasets."""

from __future__ import annotations

import glob
import json
import os
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from specserve.entrypoints.cli import main

from .conftest import random_prompts
from .load_utils import stream_with_disconnects
from .spec_utils import write_eagle
from .test_server import LiveServer, _config, dirs  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_REQUESTS, CONCURRENCY, DISCONNECT = 64, 16, 0.2
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    eagle = write_eagle(str(tmp_path_factory.mktemp("pc_server") / "eagle"))
    spec = {"method": "eagle", "model": eagle, "num_speculative_tokens": 3}
    # 30 blocks of 16 for 16 concurrent requests of up to 4 blocks each: preemption happens.
    s = LiveServer(_config(dirs, spec, num_gpu_blocks_override=30))
    yield s
    s.close()


def _prompts() -> list[list[int]]:
    """Two long shared prefixes (a system prompt, a document) and short distinct tails; cut at
    block boundaries and off them."""
    heads = random_prompts(2, 40, 40, seed=31)
    tails = random_prompts(8, 2, 9, seed=32)
    return [heads[i % 2][: 16 + 8 * (i % 3)] + t for i, t in enumerate(tails)]


def _complete(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    return r.json()


def test_shared_prefixes_with_disconnects(server: LiveServer) -> None:
    prompts = _prompts()
    solo = [_complete(server.url, p) for p in prompts]
    before = [o["choices"][0]["text"] for o in solo]
    cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in solo]
    assert any(c > 0 for c in cached) and cached[0] == 0
    rng = random.Random(23)
    leave = {i for i in range(NUM_REQUESTS) if rng.random() < DISCONNECT}
    preempted = server.engine.engine.stats.num_preemptions

    got = stream_with_disconnects(server.url, prompts, NUM_REQUESTS, leave, CONCURRENCY, MAX_TOKENS)
    for i, text in enumerate(got):
        if i in leave:
            assert text is None
        else:
            assert text == before[i % len(prompts)], (i, text)
    server.wait_idle()
    m = server.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert m["vllm:prefix_cache_hits_total"] > 0
    assert m["vllm:prefix_cache_queries_total"] >= m["vllm:prefix_cache_hits_total"]
    core = server.engine.engine
    core.kv.check_no_leaks()
    assert core.stats.num_preemptions > preempted, "the load never exhausted the cache"
    again = [_complete(server.url, p) for p in prompts]
    assert [o["choices"][0]["text"] for o in again] == before


def test_bench_multi_turn_and_prefix_repetition(
    server: LiveServer,
    dirs: dict[str, str],  # noqa: F811
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    hits = server.metrics()["vllm:prefix_cache_hits_total"]
    base = ["bench", "serve", "--base-url", server.url, "--tokenizer", dirs["tokenizer"]]
    base += ["--temperature", "0", "--disable-tqdm", "--save-result", "--result-dir"]
    base.append(str(tmp_path))
    argv = base + [
        "--dataset-name", "multi-turn", "--multi-turn-num-conversations", "3",
        "--multi-turn-num-turns", "3", "--multi-turn-input-len", "12",
        "--multi-turn-output-len", "4", "--max-concurrency", "3", "--label", "mt",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "-----------Time to First Token by Turn-----------" in out
    assert "Mean TTFT turn 3 (ms):" in out
    (path,) = glob.glob(os.path.join(tmp_path, "mt-*.json"))
    r = json.load(open(path))
    assert r["completed"] == 9 and r["failed"] == 0 and r["num_prompts"] == 9
    assert server.metrics()["vllm:prefix_cache_hits_total"] > hits
    assert len(r["mean_ttft_ms_by_turn"]) == 3 and len(r["median_ttft_ms_by_turn"]) == 3
    # Each turn resends the history: later turns' prompts are longer than the first's.
    assert r["total_input_tokens"] > 9 * 12
    assert 0 < r["prefix_cache_hit_rate"] < 100
    assert "Prefix cache hit rate (%):" in out

    hits = server.metrics()["vllm:prefix_cache_hits_total"]
    argv = base + [
        "--dataset-name", "prefix_repetition", "--num-prompts", "6",
        "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len", "4",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3",
        "--max-concurrency", "1", "--label", "pr",
    ]  # fmt: skip
    assert main(argv) == 0
    (path,) = glob.glob(os.path.join(tmp_path, "pr-*.json"))
    r = json.load(open(path))
    assert r["completed"] == 6 and r["total_output_tokens"] == 18
    assert server.metrics()["vllm:prefix_cache_hits_total"] > hits
    server.wait_idle()
    server.engine.engine.kv.check_no_leaks()


def test_prefix_repetition_dataset(dirs: dict[str, str]) -> None:  # noqa: F811
    from transformers import AutoTokenizer

    from specserve.bench.datasets import DatasetArgs, sample_requests

    tok = AutoTokenizer.from_pretrained(dirs["tokenizer"])
    args = DatasetArgs("prefix_repetition", 6, 4, prefix_len=20, suffix_len=5, num_prefixes=2)
    reqs = sample_requests(args, tok)
    assert len(reqs) == 6 and reqs == sample_requests(args, tok)
    prefixes = {r.prompt[: len(r.prompt) - 1][:10] for r in reqs}
    assert len(prefixes) == 2
    assert all(r.expected_output_len == 128 for r in reqs)  # vLLM's default output length
    with pytest.raises(ValueError, match="prefix-repetition-num-prefixes"):
        sample_requests(DatasetArgs("prefix_repetition", 1, 4, num_prefixes=2), tok)
    mt = sample_requests(DatasetArgs("multi-turn", 0, 4, num_conversations=2, num_turns=3), tok)
    assert [(r.conversation, r.turn) for r in mt] == [(c, t) for c in range(2) for t in range(3)]
