"""Tool calling and reasoning through the real server and the official `openai` client, on the
default model (SmolLM2-135M-Instruct, whose chat template reads no `tools`):

  - tool_choice "required" (two tools) and a named function: calls whose arguments validate
    against their schemas, streamed equal to not streamed, both equal to the output without
    speculation (the offline engine on the same prompt and grammar);
  - an agent loop of three turns (call, tool answer, call, tool answer, final answer);
  - "auto" with the hermes parser: an output forced into the hermes form (structured_outputs
    regex) comes back as tool_calls, streamed and not; "auto" without a parser is a 400;
  - `--reasoning-parser qwen3` with n-gram speculation: few-shot prompts make the model think
    in `<think> ... </think>` and then answer; a response_format grammar starts right after the
    end of thinking, also where a speculative step drafts across it (checked), with the output
    equal to the engine's without speculation token for token; the streamed reasoning joins to
    the non-streamed one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.data import default_model
from specserve.entrypoints.openai.chat_template import template_reads, tool_conversation
from specserve.entrypoints.openai.protocol import ChatCompletionRequest
from specserve.entrypoints.openai.tools import ForcedCallScanner
from specserve.structured.matcher import RequestGrammar

from .test_server import LiveServer

MAX_MODEL_LEN = 1024
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what time is it?"}]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> tuple[str, dict[str, Any]]:
    return default_model()


def _server(target: str, spec: dict[str, Any] | None, **app_kw: Any) -> LiveServer:
    cfg = EngineConfig(
        model=target, speculative_config=spec, max_model_len=MAX_MODEL_LEN, max_num_seqs=8
    )
    return LiveServer(cfg, **app_kw)


@pytest.fixture(scope="module")
def server(model: tuple[str, dict[str, Any]]) -> Iterator[LiveServer]:
    """The default model with its EAGLE-3 head; "auto" parsed by hermes."""
    s = _server(model[0], model[1], tool_parser="hermes")
    yield s
    s.close()


@pytest.fixture(scope="module")
def plain(model: tuple[str, dict[str, Any]]) -> LLM:
    """The same model without speculation: the reference."""
    return LLM(model[0], max_model_len=MAX_MODEL_LEN)


def _reference(plain: LLM, body: dict[str, Any]) -> str:
    """The engine's greedy output without speculation for a chat body, rendered and
    constrained as the server does it (chat_template.py, protocol.py)."""
    req = ChatCompletionRequest.model_validate(body)
    tok = plain.get_tokenizer()
    conv, tools = tool_conversation(
        req.conversation(), req.functions(), req.tool_choice_name(), template_reads(tok)
    )
    text = tok.apply_chat_template(conv, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    sp = req.to_sampling_params()
    out = plain.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
    return out.text


def _stream(client: Any, **kw: Any) -> tuple[dict[int, dict[str, str]], str | None, str, str]:
    """({index: {id, name, arguments}}, finish_reason, content, reasoning) of a streamed chat."""
    calls: dict[int, dict[str, str]] = {}
    finish, content, reasoning = None, "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning") or ""
        for t in d.tool_calls or []:
            c = calls.setdefault(t.index, {"id": "", "name": "", "arguments": ""})
            if t.id:
                assert not c["id"], "a call's id is sent once"
                c["id"] = t.id
            if t.function and t.function.name:
                assert not c["name"], "a call's name is sent once"
                c["name"] = t.function.name
            if t.function and t.function.arguments:
                c["arguments"] += t.function.arguments
        finish = ch.finish_reason or finish
    return calls, finish, content, reasoning


def _check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls(server: LiveServer, plain: LLM, tool_choice: Any) -> None:
    c = server.client()
    body = {"messages": QUESTION, "tools": TOOLS, "tool_choice": tool_choice,
            "max_tokens": 96, "temperature": 0}  # fmt: skip
    r = c.chat.completions.create(model=server.model, **body)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
    _check_calls(calls)
    # Equal to the output without speculation (the calls read out of it as the server does).
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    scanner = ForcedCallScanner(named)
    scanner.feed(_reference(plain, body))
    assert [(x.name, x.arguments) for x in scanner.calls] == calls
    assert all(t.type == "function" and t.id.startswith("call_") for t in ch.message.tool_calls)
    streamed, finish, content, _ = _stream(c, model=server.model, **body)
    assert finish == "tool_calls" and content == ""
    assert [(x["name"], x["arguments"]) for _, x in sorted(streamed.items())] == calls
    # Without parallel calls, "required" makes exactly one.
    if tool_choice == "required":
        r1 = c.chat.completions.create(model=server.model, parallel_tool_calls=False, **body)
        assert len(r1.choices[0].message.tool_calls or []) == 1


def test_agent_loop(server: LiveServer) -> None:
    c = server.client()
    messages: list[Any] = [
        {"role": "system", "content": "You are a helpful assistant with tools."},
        *QUESTION,
    ]
    answers = {"get_weather": '{"temperature": 18, "sky": "cloudy"}', "get_time": '"14:05"'}
    for turn, choice in enumerate(
        ["required", {"type": "function", "function": {"name": "get_time"}}]
    ):
        r = c.chat.completions.create(
            model=server.model, messages=messages, tools=TOOLS, tool_choice=choice,
            max_tokens=96, temperature=0,
        )  # fmt: skip
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", turn
        messages.append(msg)  # the client's own message object, sent back as it is
        for t in msg.tool_calls or []:
            jsonschema.validate(json.loads(t.function.arguments), SCHEMAS[t.function.name])
            messages.append(
                {"role": "tool", "tool_call_id": t.id, "content": answers[t.function.name]}
            )
    final = c.chat.completions.create(
        model=server.model, messages=messages, tools=TOOLS, tool_choice="none",
        max_tokens=32, temperature=0,
    )  # fmt: skip
    ch = final.choices[0]
    assert ch.message.tool_calls is None and ch.message.content
    assert ch.finish_reason in ("stop", "length")


def test_auto_with_the_hermes_parser(server: LiveServer) -> None:
    c = server.client()
    # The tiny model rarely calls a tool by itself: its output is forced into the hermes form,
    # which the parser must read back as a call (the text around it stays content).
    regex = (
        r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
        r'"(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'
    )
    body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 64, "temperature": 0,
            "extra_body": {"structured_outputs": {"regex": regex}}}  # fmt: skip
    r = c.chat.completions.create(model=server.model, **body)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check."
    (call,) = ch.message.tool_calls or []
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS["get_weather"])
    streamed, finish, content, _ = _stream(c, model=server.model, **body)
    assert finish == "tool_calls" and content == "Let me check."
    assert [(x["name"], json.loads(x["arguments"])) for x in streamed.values()] == [
        ("get_weather", args)
    ]
    # tool_choice "none": the same text is content.
    r = c.chat.completions.create(model=server.model, tool_choice="none", **body)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


def test_tool_request_errors(server: LiveServer, model: tuple[str, dict[str, Any]]) -> None:
    import httpx

    url = server.url + "/v1/chat/completions"
    for body, param in (
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ):  # fmt: skip
        r = httpx.post(url, json={"messages": QUESTION, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


# ---- reasoning -------------------------------------------------------------------------------

SHOT = '<think>The user asks about the sky. The sky is blue.</think>{"color": "blue"}'
THINKING = [
    m
    for _ in range(3)
    for m in (
        {"role": "user", "content": "What color is the sky?"},
        {"role": "assistant", "content": SHOT},
    )
] + [{"role": "user", "content": "What color is the sky?"}]
# Not what the model would write after its thinking ("blue"): the grammar decides.
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["green", "red"]}},
    "required": ["color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinking_server(model: tuple[str, dict[str, Any]]) -> Iterator[LiveServer]:
    """n-gram drafts (they copy the few-shot prompt's thinking across `</think>`); no tool
    parser."""
    s = _server(model[0], NGRAM, reasoning_parser="qwen3")
    yield s
    s.close()


class _StartSpy:
    """Records, per fill_masks call of a delayed-start grammar, whether the grammar was off
    before the step and on after its drafts (the end of thinking drafted inside a step)."""

    def __init__(self) -> None:
        self.crossed: list[tuple[int, int]] = []  # (drafts, drafts after the marker's token)
        self._inner = RequestGrammar.fill_masks

    def __call__(self, g: RequestGrammar, drafts: list[int], bitmask: Any, start: int) -> None:
        before = g.started
        n_before = len(g.start.ids) if g.start is not None else 0
        self._inner(g, drafts, bitmask, start)
        if g.start is not None and not before and g.started:
            free = g.start.marker_end - n_before  # type: ignore[operator]
            self.crossed.append((len(drafts), g.num_tentative - free))


def test_response_format_after_reasoning_across_a_speculative_step(
    thinking_server: LiveServer, plain: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specserve import StructuredOutputsParams

    spy = _StartSpy()
    monkeypatch.setattr(RequestGrammar, "fill_masks", lambda g, *a: spy(g, *a))
    c = thinking_server.client()
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOR}}
    body = {"messages": THINKING, "max_tokens": 64, "temperature": 0, "response_format": rf}
    r = c.chat.completions.create(model=thinking_server.model, **body)
    msg = r.choices[0].message
    extra = msg.model_extra or {}
    assert extra["reasoning"] == extra["reasoning_content"]
    assert extra["reasoning"].startswith("The user asks about the sky")
    jsonschema.validate(json.loads(msg.content), COLOR)
    # A draft completed `</think>` with drafts after it in the same step: their masks were the
    # grammar's.
    assert any(after > 0 for _, after in spy.crossed), spy.crossed
    # Token for token the engine's output without speculation, under the same delayed grammar.
    so = StructuredOutputsParams(json=COLOR, start_after="</think>")
    ref = plain.chat(
        THINKING, SamplingParams(temperature=0, max_tokens=64, structured_outputs=so),
        use_tqdm=False,
    )[0].outputs[0]  # fmt: skip
    assert ref.text == f"<think>{extra['reasoning']}</think>{msg.content}"
    assert r.usage is not None and r.usage.completion_tokens == len(ref.token_ids)
    # Streamed: the reasoning pieces join to the non-streamed reasoning, the content too.
    _, finish, content, reasoning = _stream(c, model=thinking_server.model, **body)
    assert (reasoning, content) == (extra["reasoning"], msg.content)
    assert finish == r.choices[0].finish_reason


def test_auto_needs_a_parser(thinking_server: LiveServer) -> None:
    """Without --enable-auto-tool-choice, "auto" with tools is vLLM's 400."""
    import httpx

    url = thinking_server.url + "/v1/chat/completions"
    r = httpx.post(url, json={"messages": QUESTION, "tools": TOOLS, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in r.json()["error"]["message"]
