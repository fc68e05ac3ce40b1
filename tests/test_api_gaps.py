"""The server's smaller API rules, one test each, against one live server (tiny random
checkpoint, n-gram speculation, an API key): max_tokens past the context is vLLM's 400;
stream_options without stream is a 400; echo with max_tokens 0 answers the prompt alone; the
Bearer scheme in any case, two Authorization headers refused; aborted streams counted under
finished_reason="abort"; /openapi.json states the rules the handlers enforce."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .test_server import MAX_MODEL_LEN, NGRAM, LiveServer, _assert_error, _config, dirs  # noqa: F401

KEY = "k-123"
AUTH = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(dirs: dict[str, str]) -> Iterator[LiveServer]:  # noqa: F811
    s = LiveServer(_config(dirs, NGRAM), api_key=KEY)
    yield s
    s.close()


def _post(s: LiveServer, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(s.url + "/v1" + path, json=body, headers=kw.pop("headers", AUTH), **kw)


def test_max_tokens_past_the_context_is_vllms_400(server: LiveServer) -> None:
    prompt = list(range(5, 5 + 100))
    room = MAX_MODEL_LEN - len(prompt)
    r = _post(server, "/completions", {"prompt": prompt, "max_tokens": room + 1})
    err = _assert_error(r, 400, "max_tokens")
    assert err["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: {room + 1}. This model's maximum "
        f"context length is {MAX_MODEL_LEN} tokens and your request has {len(prompt)} input "
        f"tokens ({room + 1} > {MAX_MODEL_LEN} - {len(prompt)})."
    )
    ok = _post(server, "/completions", {"prompt": prompt, "max_tokens": room, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == room
    msgs = [{"role": "user", "content": "hi"}]
    r = _post(server, "/chat/completions", {"messages": msgs, "max_completion_tokens": 10**6})
    assert "is too large: 1000000." in _assert_error(r, 400, "max_tokens")["message"]


def test_stream_options_without_stream_is_400(server: LiveServer) -> None:
    so = {"stream_options": {"include_usage": True}}
    r = _post(server, "/completions", {"prompt": "hi", "max_tokens": 2, **so})
    _assert_error(r, 400, "stream_options")
    msgs = [{"role": "user", "content": "hi"}]
    r = _post(server, "/chat/completions", {"messages": msgs, "stream": False, **so})
    _assert_error(r, 400, "stream_options")


def test_echo_with_max_tokens_0_returns_the_prompt(server: LiveServer) -> None:
    prompt = "The quick brown fox"
    base = {"prompt": prompt, "echo": True, "logprobs": 2}
    r = _post(server, "/completions", {**base, "max_tokens": 0}).json()
    one = _post(server, "/completions", {**base, "max_tokens": 1}).json()
    (c,) = r["choices"]
    assert c["text"] == prompt and c["finish_reason"] == "length"
    n_prompt = r["usage"]["prompt_tokens"]
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["total_tokens"] == n_prompt
    lp = c["logprobs"]
    assert len(lp["tokens"]) == n_prompt and lp["token_logprobs"][0] is None
    # The same prompt logprobs as the echo of a one-token completion, without its token.
    ref = one["choices"][0]["logprobs"]
    assert {k: v[:n_prompt] for k, v in ref.items()} == lp
    # Streamed: one chunk with the prompt, then [DONE].
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**base, "max_tokens": 0, "stream": True},
        headers=AUTH,
    ) as s:  # fmt: skip
        events = [e[6:] for e in s.read().decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == prompt
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # Without echo, 0 tokens is no answer at all.
    _assert_error(_post(server, "/completions", {"prompt": prompt, "max_tokens": 0}), 400)


def test_bearer_scheme_any_case_and_one_header_only(server: LiveServer) -> None:
    body = {"prompt": "hi", "max_tokens": 1}
    for value in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY}"):
        assert _post(server, "/completions", body, headers={"Authorization": value}).is_success
    for value in (f"Basic {KEY}", "Bearer wrong", KEY, "Bearer"):
        r = _post(server, "/completions", body, headers={"Authorization": value})
        assert _assert_error(r, 401)["code"] == "invalid_api_key"
    # Two Authorization headers, both right: ambiguous credentials are refused.
    two = httpx.Headers([("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")])
    _assert_error(_post(server, "/completions", body, headers=two), 401)
    _assert_error(httpx.get(server.url + "/v1/models"), 401)


def test_aborted_requests_are_counted(server: LiveServer) -> None:
    label = "vllm:request_success_total{finished_reason=abort}"
    before = server.metrics().get(label, 0.0)
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True, "n": 2}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave mid-stream: both choices are aborted
    server.wait_idle(timeout=10)
    assert server.metrics()[label] == before + 2
    # A finished request is not an abort.
    _post(server, "/completions", {"prompt": "hi", "max_tokens": 2})
    assert server.metrics()[label] == before + 2


def test_openapi_states_the_enforced_rules(server: LiveServer) -> None:
    spec = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    cmpl, chat = (
        spec["CompletionRequest"]["properties"],
        spec["ChatCompletionRequest"]["properties"],
    )

    def member(prop: dict[str, Any], type_: str) -> dict[str, Any]:
        return next(m for m in prop.get("anyOf", [prop]) if m.get("type") == type_)

    assert member(cmpl["prompt"], "string")["minLength"] == 1
    assert member(cmpl["stop"], "string")["minLength"] == 1
    assert member(chat["stop"], "array")["items"]["minLength"] == 1
    bias = member(cmpl["logit_bias"], "object")["additionalProperties"]
    assert (bias["minimum"], bias["maximum"]) == (-100, 100)
    assert "equal `n`" in cmpl["best_of"]["description"]
    assert member(cmpl["best_of"], "integer")["maximum"] == 128
    assert cmpl["n"]["maximum"] == 128 and cmpl["n"]["minimum"] == 1
    assert member(chat["reasoning_effort"], "string")["enum"] == ["low", "medium", "high"]
    tc = chat["tool_choice"]
    assert {"none", "auto", "required"} <= {v for m in tc["anyOf"] for v in m.get("enum", [])}
    assert "needs `tools`" in tc["description"]
    # Each stated rule is what the server answers: a body that breaks it is a 400.
    for body, param in (
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ):
        _assert_error(_post(server, "/completions", body), 400, param)
    msgs = [{"role": "user", "content": "x"}]
    r = _post(server, "/chat/completions", {"messages": msgs, "tool_choice": "required"})
    _assert_error(r, 400, "tool_choice")
