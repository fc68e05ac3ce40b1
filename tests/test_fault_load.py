"""Fault load and API fuzzing, on a real server on 127.0.0.1 with n-gram speculation
and a KV cache small enough to preempt: 200 streamed requests at concurrency 32 with 20% client
disconnects lose nothing, leak nothing and leave greedy output unchanged; schemathesis finds no
server error and no response outside /openapi.json."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from specserve.config import EngineConfig

from .conftest import random_prompts
from .load_utils import stream_with_disconnects
from .test_server import NGRAM, LiveServer, _config, dirs  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_REQUESTS, CONCURRENCY, DISCONNECT = 200, 32, 0.2
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def server(dirs: dict[str, str]) -> Iterator[LiveServer]:  # noqa: F811
    # 40 blocks of 16 for 32 concurrent requests of up to ~3 blocks each: preemption happens.
    s = LiveServer(_config(dirs, NGRAM, num_gpu_blocks_override=40))
    yield s
    s.close()


def _greedy(url: str, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:
        body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200
        out.append(r.json())
    # The tiny tokenizer's text is lossy for random ids; the usage and text pin the output.
    return [[o["choices"][0]["text"], o["usage"]["completion_tokens"]] for o in out]


def test_fault_load(server: LiveServer) -> None:
    prompts = random_prompts(8, 4, 40, seed=11)
    before = _greedy(server.url, prompts)
    rng = random.Random(19)
    leave = {i for i in range(NUM_REQUESTS) if rng.random() < DISCONNECT}
    preempted_before = server.engine.engine.stats.num_preemptions

    got = stream_with_disconnects(server.url, prompts, NUM_REQUESTS, leave, CONCURRENCY, MAX_TOKENS)
    for i, text in enumerate(got):
        if i in leave:
            assert text is None
        else:  # not lost, and the same greedy text as when the request ran alone
            assert text == before[i % len(prompts)][0], (i, text)
    server.wait_idle()
    m = server.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    core = server.engine.engine
    assert core.kv.pool.num_free == core.kv.pool.num_blocks  # no leaked blocks
    assert core.stats.num_preemptions > preempted_before, "the load never exhausted the cache"
    assert _greedy(server.url, prompts) == before


@pytest.fixture(scope="module")
def short_server(dirs: dict[str, str]) -> Iterator[LiveServer]:  # noqa: F811
    # Short contexts keep fuzzed requests (n up to 128, any max_tokens) quick.
    cfg = EngineConfig(
        model=dirs["model"], tokenizer=dirs["tokenizer"], max_model_len=48, speculative_config=NGRAM
    )
    s = LiveServer(cfg)
    yield s
    s.close()


def test_schemathesis(short_server: LiveServer, tmp_path: Path) -> None:
    """Positive and negative cases for the documented operations, as many as 25 s allow
    (the coverage phase takes the operations in turn, and on a 2-core machine the first one
    can use the whole time: 85-120 cases)."""
    server = short_server
    checks = [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "unsupported_method",
    ]
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json"]
    cmd += ["--phases", "coverage,fuzzing", "--max-examples", "25", "--seed", "19"]
    cmd += ["--checks", ",".join(checks), "--no-color", "--max-time", "25"]
    cmd += ["--request-timeout", "60"]
    # (cwd: schemathesis writes a cache directory there)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    # Every case passed every check (none failed, none errored), and there were plenty.
    m = re.search(r"(\d+) generated, (\d+) passed\n", r.stdout)
    assert m and m[1] == m[2] and int(m[1]) >= 50, r.stdout[-3000:]
    server.wait_idle()
