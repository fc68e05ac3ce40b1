"""The OpenAI-compatible server, end to end: a real uvicorn server on 127.0.0.1 (free port),
tiny random checkpoints with a real tokenizer, the official `openai` client and httpx."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.entrypoints.openai.server import build_app

from .conftest import make_checkpoint
from .tok_utils import make_tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
MAX_MODEL_LEN = 256


class LiveServer:
    """`build_app(config)` served by uvicorn in a background thread on a free local port."""

    def __init__(self, config: EngineConfig, api_key: str | None = None, **app_kw: Any) -> None:
        import uvicorn

        self.app = build_app(config, api_key=api_key, **app_kw)
        self.engine = self.app.state.engine
        self.model = config.served_model_name or config.model
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # the OS picks the port; the socket is handed to uvicorn
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        cfg = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def metrics(self) -> dict[str, float]:
        """Flat {sample name + sorted labels (without model_name): value}."""
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name"
                )
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until the engine holds no request and every KV block is back in the pool."""
        core = self.engine.engine
        deadline = time.monotonic() + timeout
        while core.requests or core.kv.pool.num_free != core.kv.pool.num_blocks:
            assert time.monotonic() < deadline, f"engine still busy: {list(core.requests)}"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Target, 1-layer draft and tokenizer dirs; written once per session (test_bench.py reuses
    them through the session's base temp dir)."""
    root = tmp_path_factory.getbasetemp() / "server-ckpts"
    out = {"model": str(root / "target"), "draft": str(root / "draft")}
    out["tokenizer"] = str(root / "tokenizer")
    if not os.path.isdir(out["tokenizer"]):
        make_checkpoint(out["model"], "llama")
        make_checkpoint(out["draft"], "llama", seed=1, num_hidden_layers=1)
        make_tokenizer(root)
    return out


def _config(dirs: dict[str, str], spec: dict[str, Any] | None, **kw: Any) -> EngineConfig:
    return EngineConfig(
        model=dirs["model"],
        tokenizer=dirs["tokenizer"],
        speculative_config=spec,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=32,
        **kw,
    )


@pytest.fixture(scope="module")
def server(dirs: dict[str, str]) -> Iterator[LiveServer]:
    s = LiveServer(_config(dirs, NGRAM))
    yield s
    s.close()


@pytest.fixture(scope="module")
def llm(dirs: dict[str, str]) -> LLM:
    """The offline engine with the server's configuration: the reference for outputs."""
    return LLM(
        dirs["model"],
        tokenizer=dirs["tokenizer"],
        speculative_config=NGRAM,
        max_model_len=MAX_MODEL_LEN,
    )


# ---- outputs -----------------------------------------------------------------------------------


def test_completions_and_chat_equal_llm_generate(server: LiveServer, llm: LLM) -> None:
    c = server.client()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = llm.generate(["Hello world"], greedy, use_tqdm=False)[0].outputs[0]
    r = c.completions.create(
        model=server.model,
        prompt="Hello world",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == ref.text
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert r.choices[0].finish_reason == "length"

    # Seeded sampling, n=2: choice i uses seed + i, as LLM.generate does.
    sp = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=10, ignore_eos=True)
    ref2 = llm.generate(["The quick brown fox"], sp, use_tqdm=False)[0].outputs
    r = c.completions.create(
        model=server.model, prompt="The quick brown fox", max_tokens=10, temperature=1.0,
        seed=7, n=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [ch.index for ch in r.choices] == [0, 1]
    assert [ch.text for ch in r.choices] == [o.text for o in ref2]
    assert r.usage is not None and r.usage.completion_tokens == 20

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ref3 = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    r3 = c.chat.completions.create(
        model=server.model, messages=msgs, max_completion_tokens=8, temperature=0
    )  # type: ignore[arg-type]
    assert r3.object == "chat.completion"
    assert r3.choices[0].message.role == "assistant"
    assert r3.choices[0].message.content == ref3.outputs[0].text
    assert r3.usage is not None and r3.usage.prompt_tokens == len(ref3.prompt_token_ids)


def test_streaming_matches_non_streaming(server: LiveServer) -> None:
    c = server.client()
    kw: dict[str, Any] = dict(
        model=server.model, prompt="Hello", max_tokens=9, temperature=0.8, seed=3
    )
    full = c.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(
        c.completions.create(
            **kw,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(ch.object == "text_completion" for ch in chunks)
    token_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(ch.choices[0].text for ch in token_chunks) == full
    # finish_reason rides on the last token chunk only; the usage chunk has no choices.
    assert [ch.choices[0].finish_reason for ch in token_chunks][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in token_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 9

    msgs = [{"role": "user", "content": "hi"}]
    full_chat = c.chat.completions.create(
        model=server.model, messages=msgs, max_tokens=6, temperature=0
    )  # type: ignore[arg-type]
    stream = list(
        c.chat.completions.create(
            model=server.model, messages=msgs, max_tokens=6, temperature=0, stream=True
        )
    )  # type: ignore[arg-type]
    assert all(ch.object == "chat.completion.chunk" for ch in stream)
    assert stream[0].choices[0].delta.role == "assistant"
    assert all(ch.choices[0].delta.role is None for ch in stream[1:])
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in stream)
        == full_chat.choices[0].message.content
    )
    assert stream[-1].choices[0].finish_reason is not None
    assert stream[-1].usage is None  # no usage chunk unless asked for


def test_sse_wire_format(server: LiveServer) -> None:
    body = {
        "prompt": "Hi",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    assert "usage" in json.loads(events[-3][len("data: ") :])


def test_sampling_parameters(server: LiveServer, llm: LLM) -> None:
    c = server.client()
    m = server.model
    ref = llm.generate(
        ["Hello world"],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    text, ids = ref.text, ref.token_ids

    # stop strings cut the text before the stop string
    stop = text[4:7]
    r = c.completions.create(
        model=m,
        prompt="Hello world",
        max_tokens=16,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop"

    # stop_token_ids end the request on that token (it counts as generated)
    tid = ids[5]
    r = c.completions.create(
        model=m,
        prompt="Hello world",
        max_tokens=16,
        temperature=0,
        extra_body={"stop_token_ids": [tid], "ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == ids.index(tid) + 1

    # allowed_token_ids and bad_words (vLLM's): the same tokens as the offline engine
    tok = llm.get_tokenizer()
    word = next(  # one output token whose text encodes back to it: banning it changes the text
        w for t in ids for w in [tok.decode([t])] if tok.encode(w, add_special_tokens=False) == [t]
    )
    for extra in ({"allowed_token_ids": list(range(100, 140))}, {"bad_words": [word]}):
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **extra)
        want = llm.generate(["Hello world"], sp, use_tqdm=False)[0].outputs[0].text
        r = c.completions.create(
            model=m,
            prompt="Hello world",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )
        assert r.choices[0].text == want and want != text, extra

    # truncate_prompt_tokens (vLLM's): the output follows the prompt's last tokens
    r = c.completions.create(
        model=m, prompt="Hello world", max_tokens=6, temperature=0,
        extra_body={"truncate_prompt_tokens": 2, "ignore_eos": True},
    )  # fmt: skip
    prompt_ids = llm.get_tokenizer().encode("Hello world")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate([{"prompt_token_ids": prompt_ids[-2:]}], sp, use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == want.text and r.usage is not None
    assert r.usage.prompt_tokens == 2
    # ... also for a text too long to fit (tokenized by its tail) and a chat request
    long_text = "The quick brown fox jumps over the lazy dog. " * 1000
    assert len(long_text) > server.engine.engine.max_prompt_chars
    r = c.completions.create(
        model=m, prompt=long_text, max_tokens=6, temperature=0,
        extra_body={"truncate_prompt_tokens": 10, "ignore_eos": True},
    )  # fmt: skip
    tail = llm.get_tokenizer().encode(long_text)[-10:]
    want = llm.generate([{"prompt_token_ids": tail}], sp, use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == want.text and r.usage is not None
    assert r.usage.prompt_tokens == 10
    rc = c.chat.completions.create(
        model=m, messages=[{"role": "user", "content": long_text}], max_tokens=2,
        extra_body={"truncate_prompt_tokens": 10},
    )  # fmt: skip
    assert rc.usage is not None and rc.usage.prompt_tokens == 10

    # echo prepends the prompt
    r = c.completions.create(model=m, prompt="Hello world", max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Hello world")

    # logprobs: greedy picks the top token; each step lists the top-2 plus the sampled one
    r = c.completions.create(
        model=m,
        prompt="Hello world",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert (
        lp is not None
        and lp.tokens is not None
        and lp.top_logprobs is not None
        and lp.token_logprobs is not None
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for got, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3
        assert got == pytest.approx(max(top.values()), abs=1e-5)

    rc = c.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = rc.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for e in content:
        assert len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)

    # seeds reproduce; top_k / min_p / min_tokens / max_completion_tokens are accepted
    kw: dict[str, Any] = dict(model=m, prompt="abc", max_tokens=8, temperature=1.0, seed=11)
    extra = {"top_k": 20, "min_p": 0.01, "min_tokens": 2, "ignore_eos": True}
    a = c.completions.create(**kw, extra_body=extra).choices[0].text
    b = c.completions.create(**kw, extra_body=extra).choices[0].text
    assert a == b
    rc = c.chat.completions.create(
        model=m,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert rc.usage is not None and rc.usage.completion_tokens == 3


def test_models_health_metrics(server: LiveServer) -> None:
    models = httpx.get(server.url + "/v1/models").json()
    card = models["data"][0]
    assert card["id"] == server.model and card["root"] == server.model
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url + "/health").status_code == 200

    before = server.metrics()
    server.client().completions.create(
        model=server.model,
        prompt="Hello world",  # greedy, it falls into a loop the n-gram drafter predicts
        max_tokens=32,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = server.metrics()
    for name in (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
    ):
        assert after[name] > before[name], name
    assert (
        after["vllm:spec_decode_num_accepted_tokens_total"]
        >= before["vllm:spec_decode_num_accepted_tokens_total"]
    )
    per_pos = {
        k: v
        for k, v in after.items()
        if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")
    }
    assert set(per_pos) == {
        f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}" for i in range(3)
    }
    assert sum(per_pos.values()) == after["vllm:spec_decode_num_accepted_tokens_total"]
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert name in after
    for h in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert after[h + "_count"] > before.get(h + "_count", 0), h


# ---- errors --------------------------------------------------------------------------------


BAD_COMPLETIONS: list[tuple[Any, str | None]] = [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "hi", "n": 1.5}, "n"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**7]}, "prompt"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "logprobs": 1000}, "logprobs"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),  # the engine's max_logprobs: 20
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "allowed_token_ids": [5, 10**6]}, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "hi", "bad_words": ["ok", " "]}, "bad_words"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "hi", "truncate_prompt_tokens": 2, "echo": True}, "truncate_prompt_tokens"),
    ({"prompt": "hi", "seed": 2**70}, "seed"),
    ({"prompt": "hi", "seed": 2**63 - 1, "n": 2}, "seed"),
    ({"prompt": "hi", "stop": ""}, "stop"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    # (Past int64 it once reached the penalty step's upload and killed the engine loop.)
    ({"prompt": "hi", "min_tokens": 2**63}, "min_tokens"),
    ({"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"prompt": "hi", "tools": [{"type": "function"}]}, "tools"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({}, "prompt"),
    ([1, 2], None),
]
BAD_CHAT: list[tuple[Any, str | None]] = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    # The test tokenizer's template reads neither.
    (
        {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low"},
        "reasoning_effort",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": 1}},
        "chat_template_kwargs",
    ),
]


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_bad_requests_are_400(server: LiveServer) -> None:
    url = server.url + "/v1"
    for body, param in BAD_COMPLETIONS:
        _assert_error(httpx.post(url + "/completions", json=body), 400, param)
    for body, param in BAD_CHAT:
        _assert_error(httpx.post(url + "/chat/completions", json=body), 400, param)
    for raw in (
        b"{bad json",
        b"",
        b"null",
        b'{"prompt": NaN}',
        b'{"prompt": "x", "temperature": Infinity}',
    ):
        _assert_error(httpx.post(url + "/completions", content=raw), 400)

    long_prompt = {"prompt": list(range(3, 3 + MAX_MODEL_LEN + 10))}
    err = _assert_error(httpx.post(url + "/completions", json=long_prompt), 400, "prompt")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
    assert f"your request has {MAX_MODEL_LEN + 10} input tokens" in err["message"]

    err = _assert_error(
        httpx.post(url + "/completions", json={"prompt": "hi", "model": "nope"}), 404, "model"
    )
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=server.model, prompt="hi", temperature=-0.5)
    _assert_error(httpx.get(url + "/no-such-route"), 404)
    assert httpx.get(server.url + "/health").status_code == 200


def test_fuzz_never_500(server: LiveServer) -> None:
    rng = random.Random(0)
    values: list[Any] = [
        None, True, False, 0, 1, 2, -1, 3.5, -2.0, 1e308, 2**63, 2**63 - 1, -(2**63) - 1, "", "x", "0.5",
        [], [1, "a"], [[1, 2], [3]], [2**40], {}, {"a": 1}, [""], ["ok", "z"],
    ]  # fmt: skip
    fields = [
        "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop",
        "stop_token_ids", "ignore_eos", "min_tokens", "logprobs", "echo", "stream",
        "stream_options", "model", "best_of", "suffix", "messages", "top_logprobs",
    ]  # fmt: skip
    with httpx.Client(base_url=server.url + "/v1", timeout=60) as h:
        for i in range(60):
            chat = i % 2 == 1
            body: dict[str, Any] = {"max_tokens": 2}
            body["messages" if chat else "prompt"] = (
                [{"role": "user", "content": "hi"}] if chat else "hi"
            )
            for f in rng.sample(fields, rng.randint(1, 4)):
                body[f] = rng.choice(values)
            if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
                body["max_tokens"] = 4  # valid but long runs only cost time
            if isinstance(body.get("n"), int) and body["n"] > 4:
                body["n"] = 4
            r = h.post("/chat/completions" if chat else "/completions", json=body)
            assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
            if r.status_code != 200:
                _assert_error(r, r.status_code)
    assert httpx.get(server.url + "/health").status_code == 200
    server.wait_idle()


# ---- disconnects and concurrency -----------------------------------------------------------


def test_client_disconnect_aborts_and_frees_blocks(server: LiveServer) -> None:
    gen_before = server.engine.engine.stats.generation_tokens
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one token arrived: leave mid-stream
    server.wait_idle(timeout=10)
    assert server.engine.engine.stats.generation_tokens - gen_before < 200
    assert server.metrics()["vllm:kv_cache_usage_perc"] == 0.0

    # Non-streaming: the client times out and goes away while the request runs. NOTE: the
    # timeout must be well under the time 200 tokens take (0.5 s was not, on an idle machine).
    gen_before = server.engine.engine.stats.generation_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.1)
    server.wait_idle(timeout=10)
    assert server.engine.engine.stats.generation_tokens - gen_before < 200


def test_concurrent_streams_with_random_disconnects(server: LiveServer) -> None:
    num_clients, max_tokens = 64, 6
    rng = random.Random(1)
    leave = {i for i in range(num_clients) if rng.random() < 0.3}

    async def one(h: httpx.AsyncClient, i: int) -> int | None:
        body = {
            "prompt": f"client {i} says",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if i in leave and line.startswith("data: "):
                    return None
                if line.startswith("data: {") and '"usage"' in line:
                    return json.loads(line[6:])["usage"]["completion_tokens"]
        return -1

    async def run() -> list[int | None]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as h:
            return await asyncio.gather(*(one(h, i) for i in range(num_clients)))

    got = asyncio.run(run())
    for i, n in enumerate(got):
        assert n == (None if i in leave else max_tokens), (i, n)
    server.wait_idle()
    assert httpx.get(server.url + "/health").status_code == 200


# ---- other servers: api key + draft model, async scheduling, a dead engine -------------------


def test_async_scheduling_server(dirs: dict[str, str]) -> None:
    """`--async-scheduling` with a draft model: 32 concurrent streams, a third of them leaving
    early; the rest get their exact greedy completions (= LLM.generate) and every block is
    freed."""
    spec = {"method": "draft_model", "model": dirs["draft"], "num_speculative_tokens": 2}
    s = LiveServer(_config(dirs, spec, async_scheduling=True))
    ref_llm = LLM(
        dirs["model"],
        tokenizer=dirs["tokenizer"],
        speculative_config=spec,
        max_model_len=MAX_MODEL_LEN,
    )
    n, max_tokens = 32, 10
    leave = {i for i in range(n) if i % 3 == 0}
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    refs = ref_llm.generate([f"client {i} says" for i in range(n)], greedy, use_tqdm=False)

    async def one(h: httpx.AsyncClient, i: int) -> str | None:
        body = {
            "prompt": f"client {i} says",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text = ""
        async with h.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if i in leave:
                    return None
                text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def run() -> list[str | None]:
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as h:
            return await asyncio.gather(*(one(h, i) for i in range(n)))

    try:
        got = asyncio.run(run())
        for i, text in enumerate(got):
            assert text == (None if i in leave else refs[i].outputs[0].text), i
        s.wait_idle()
        assert s.metrics()["vllm:spec_decode_num_drafts_total"] > 0
    finally:
        s.close()


def test_api_key_and_draft_model(dirs: dict[str, str]) -> None:
    spec = {"method": "draft_model", "model": dirs["draft"], "num_speculative_tokens": 2}
    s = LiveServer(_config(dirs, spec, served_model_name="tiny"), api_key="sekret")
    try:
        assert s.model == "tiny"
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
        err = _assert_error(httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}), 401)
        assert err["code"] == "invalid_api_key"
        _assert_error(httpx.get(s.url + "/v1/models"), 401)
        assert httpx.get(s.url + "/health").status_code == 200  # probes need no key
        before = s.metrics()["vllm:spec_decode_num_drafts_total"]
        r = s.client("sekret").completions.create(
            model="tiny", prompt="hi", max_tokens=6, extra_body={"ignore_eos": True}
        )
        assert r.usage is not None and r.usage.completion_tokens == 6
        assert s.metrics()["vllm:spec_decode_num_drafts_total"] > before
        per_pos = [k for k in s.metrics() if "per_pos" in k]
        assert len(per_pos) == 2
    finally:
        s.close()


def test_dead_engine_makes_health_503(dirs: dict[str, str]) -> None:
    s = LiveServer(_config(dirs, None))
    try:
        assert httpx.get(s.url + "/health").status_code == 200

        def boom() -> list[Any]:
            raise RuntimeError("injected device failure")

        s.engine.engine.step = boom  # the next step kills the engine loop
        body = {"prompt": "hi", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200  # headers went out before the failure
            events = [e for e in r.read().decode().split("\n\n") if e]
        assert "injected device failure" in json.loads(events[0][6:])["error"]["message"]
        assert events[-1] == "data: [DONE]"
        assert httpx.get(s.url + "/health").status_code == 503
        _assert_error(httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}), 503)
    finally:
        s.close()


def test_max_logprobs_sets_the_servers_limit(dirs: dict[str, str]) -> None:
    """--max-logprobs -1 (vLLM's: the whole vocabulary) lets a request ask for more than 20
    logprobs; past the limit, a 400 with vLLM's message."""
    s = LiveServer(_config(dirs, None, max_logprobs=-1))
    try:
        vocab = s.engine.engine.hf_config["vocab_size"]
        body = {"model": s.model, "prompt": "hi", "max_tokens": 2, "logprobs": 300}
        r = httpx.post(s.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
        # Entries are keyed by token text, which byte tokens share (~200 distinct of the 300
        # here); the default limit would give at most 21 (its 20 and the sampled token).
        assert len(tops) == 2 and all(len(t) >= 100 for t in tops)
        body["logprobs"] = vocab + 1
        err = _assert_error(httpx.post(s.url + "/v1/completions", json=body), 400, "logprobs")
        assert f"greater than max allowed: {vocab}" in err["message"]
    finally:
        s.close()


def test_serve_cli_arguments(dirs: dict[str, str]) -> None:
    from specserve.entrypoints.cli import build_parser
    from specserve.entrypoints.openai.cli import serve_engine_kwargs

    spec = json.dumps(NGRAM)
    args = build_parser().parse_args(
        [
            "serve",
            dirs["model"],
            "--speculative-config",
            spec,
            "--port",
            "0",
            "--api-key",
            "k",
            "--max-model-len",
            "128",
        ]
    )
    kw = serve_engine_kwargs(args)
    assert kw["model"] == dirs["model"] and kw["max_model_len"] == 128
    assert kw["speculative_config"] == spec and args.api_key == "k" and args.port == 0
    EngineConfig(**kw)  # every serve flag is an engine field
    args = build_parser().parse_args(["serve", dirs["model"], "--model", dirs["draft"]])
    with pytest.raises(ValueError, match="disagree"):
        serve_engine_kwargs(args)
