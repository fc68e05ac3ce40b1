"""Never stuck, on a real server on 127.0.0.1: requests that cannot fit the KV cache
are refused or finished, not queued forever; an idle engine sleeps; huge prompts do not stall
running streams; token ids and bodies are validated; the API is documented."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.engine.kv_cache import KVCacheManager
from specserve.engine.scheduler import Scheduler
from specserve.request import Request, RequestStatus

from .conftest import VOCAB
from .test_server import NGRAM, LiveServer, _config, dirs  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 8 blocks of 16: a 128-token cache under max_model_len 256, which start-up clamps to 128.
SMALL_CACHE = {"num_gpu_blocks_override": 8, "block_size": 16}


@pytest.fixture(scope="module")
def small(dirs: dict[str, str]) -> Iterator[LiveServer]:  # noqa: F811
    s = LiveServer(_config(dirs, NGRAM, **SMALL_CACHE))
    yield s
    s.close()


def _completion(url: str, body: dict[str, Any], timeout: float = 20.0) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def test_small_cache_clamps_max_model_len(
    dirs: dict[str, str],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="specserve"):
        llm = LLM(dirs["model"], max_model_len=256, **SMALL_CACHE)
    assert llm.engine.max_model_len == 128
    assert "max_model_len is clamped to 128" in caplog.text
    with pytest.raises(ValueError, match="maximum context length is 128"):
        llm.generate({"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=2))


def test_prompt_larger_than_cache_is_400_and_queue_moves(small: LiveServer) -> None:
    assert small.engine.engine.max_model_len == 128
    models = httpx.get(small.url + "/v1/models").json()
    assert models["data"][0]["max_model_len"] == 128
    got: dict[str, httpx.Response] = {}
    big = threading.Thread(
        target=lambda: got.update(big=_completion(small.url, {"prompt": [7] * 200}))
    )
    big.start()
    time.sleep(0.1)
    r = _completion(small.url, {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
    big.join()
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert got["big"].status_code == 400
    assert "maximum context length is 128" in got["big"].json()["error"]["message"]
    small.wait_idle()


def test_request_outgrowing_cache_ends_with_length(small: LiveServer) -> None:
    # max_tokens None: up to the context (a larger number is a 400, as in vLLM).
    body = {"prompt": list(range(3, 103)), "max_tokens": None, "ignore_eos": True}
    r = _completion(small.url, body)
    assert r.status_code == 200
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 128 - 100  # it ran to the cache's end
    small.wait_idle()


def test_scheduler_ends_requests_that_can_never_fit() -> None:
    """Inputs the engine's clamp never produces: the scheduler still ends them, logged, and
    the queue behind them moves (it used to preempt such a request forever)."""
    kv = KVCacheManager(num_blocks=4, block_size=4, max_model_len=64)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    sp = SamplingParams(max_tokens=50)
    huge, grows, small = (Request(n, [3] * k, sp) for n, k in (("a", 20), ("b", 14), ("c", 2)))
    for r in (huge, grows):
        sched.add(r)
    out = sched.schedule()
    assert out.ended == [huge] and huge.status is RequestStatus.FINISHED_LENGTH
    assert [s.req for s in out.scheduled] == [grows]
    grows.num_computed_tokens = 14
    grows.output_token_ids = [4, 4, 4]  # 17 tokens now: 5 blocks, the cache has 4
    sched.add(small)
    out = sched.schedule()
    assert out.ended == [grows] and grows.status is RequestStatus.FINISHED_LENGTH
    assert [s.req for s in out.scheduled] == [small]
    assert kv.pool.num_free == 4 - len(small.block_ids)


def _thread_cpu(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_idle_engine_sleeps(small: LiveServer) -> None:
    # A request that cannot fit used to leave the engine loop spinning a core.
    got: dict[str, httpx.Response] = {}

    def send() -> None:
        try:
            got["r"] = _completion(small.url, {"prompt": [7] * 200}, timeout=5)
        except httpx.TimeoutException:
            pass

    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.5)
    tid = small.engine._thread.native_id
    engine0, proc0 = _thread_cpu(tid), time.process_time()
    time.sleep(2.0)
    engine_cpu, proc_cpu = _thread_cpu(tid) - engine0, time.process_time() - proc0
    t.join()
    print(f"idle 2 s: engine thread {engine_cpu:.3f} s CPU, process {proc_cpu:.3f} s CPU")
    assert engine_cpu < 0.05, f"engine thread used {engine_cpu:.2f} s CPU in 2 s of idleness"
    assert proc_cpu < 0.2, f"server process used {proc_cpu:.2f} s CPU in 2 s of idleness"
    assert got["r"].status_code == 400


@pytest.fixture(scope="module")
def roomy(dirs: dict[str, str]) -> Iterator[LiveServer]:  # noqa: F811
    cfg = EngineConfig(model=dirs["model"], tokenizer=dirs["tokenizer"], max_model_len=512)
    s = LiveServer(cfg)
    yield s
    s.close()


def test_huge_prompts_do_not_stall_streams(roomy: LiveServer) -> None:
    arrivals: list[float] = []
    body = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", roomy.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())

    t = threading.Thread(target=stream)
    t.start()
    while len(arrivals) < 5:
        time.sleep(0.01)
    start = time.monotonic()
    # 4 MB of text (~20 s to tokenize: refused from its length alone), then 64 prompts just
    # short of that bound (~2 s of tokenizing, off the engine thread, before their 400).
    huge = _completion(roomy.url, {"prompt": "The quick brown fox. " * 200_000}, timeout=60)
    cap = roomy.engine.engine.max_prompt_chars
    many = _completion(roomy.url, {"prompt": ["hello world " * (cap // 12)] * 64}, timeout=60)
    end = time.monotonic()
    t.join()
    assert huge.status_code == 400 and "characters" in huge.json()["error"]["message"]
    assert many.status_code == 400 and "maximum context length" in many.json()["error"]["message"]
    assert len(arrivals) == 500 and arrivals[-1] > end, "the stream ended before the test did"
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > start and a < end]
    print(f"huge prompts took {end - start:.2f} s; longest stream gap {max(during):.3f} s")
    assert max(during) < 1.0, f"the stream stalled {max(during):.2f} s"


def test_body_size_limit(dirs: dict[str, str]) -> None:  # noqa: F811
    cfg = EngineConfig(model=dirs["model"], tokenizer=dirs["tokenizer"], max_model_len=64)
    s = LiveServer(cfg, max_request_bytes=1 << 16)
    try:
        r = _completion(s.url, {"prompt": "x" * 100_000})
        assert r.status_code == 413
        assert "at most 65536 bytes" in r.json()["error"]["message"]
        assert _completion(s.url, {"prompt": "x", "max_tokens": 1}).status_code == 200
    finally:
        s.close()


def test_validation_allow_and_openapi(small: LiveServer) -> None:
    r = httpx.get(small.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    base = {"prompt": [5, 6], "max_tokens": 2}
    for bad in ([-1], [2**70], [VOCAB]):
        r = _completion(small.url, {**base, "stop_token_ids": bad})
        assert r.status_code == 400, bad
        err = r.json()["error"]
        assert err["param"] == "stop_token_ids" and "vocabulary" in err["message"], err
    r = _completion(small.url, {**base, "prompt": [5, -1]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "prompt.1: Input should be greater than or equal to 0 (got -1)"
    )
    r = _completion(small.url, {**base, "prompt": [5, VOCAB]})
    assert r.status_code == 400
    assert f"prompt token id {VOCAB} (position 1) is outside" in r.json()["error"]["message"]

    spec = httpx.get(small.url + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, req, resp in (
        ("/v1/completions", "CompletionRequest", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse"),
    ):
        op = spec["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{req}"}
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{resp}"}
        assert "text/event-stream" in ok and req in schemas and resp in schemas
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    assert json.dumps(spec)  # every referenced schema resolves: schemathesis loads it too
