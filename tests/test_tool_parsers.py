"""Tool-call parsers against outputs written in each model family's format: the whole-output
parse gives the exact calls and content, and streaming the same text in pieces of 1, 2, 7 and
random sizes gives the same content and the same calls (id and name once, arguments pieces
concatenating to the whole-output arguments)."""

from __future__ import annotations

import json
import re

import pytest

from specserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    get_tool_parser,
)
from specserve.entrypoints.openai.tool_parsers.text import json_object_end, partial_tag_len

from .split_utils import splits

ID = re.compile(r"call_[A-Za-z0-9]{24}")


def stream(name: str, pieces: list[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """Streamed content and calls as (id, name, arguments), checking the delta protocol."""
    parser = get_tool_parser(name)()
    deltas = [parser.extract_tool_calls_streaming(p) for p in pieces] + [parser.finish_streaming()]
    content = "".join(d.content for d in deltas)
    calls: list[list[str]] = []
    for d in deltas:
        for tc in d.tool_calls:
            if tc.index == len(calls):
                assert tc.id is not None and tc.name is not None
                calls.append([tc.id, tc.name, tc.arguments])
            else:
                assert tc.index == len(calls) - 1 and tc.id is None and tc.name is None
                calls[-1][2] += tc.arguments
    return content, [(i, n, a) for i, n, a in calls]


def check(
    name: str, text: str, calls: list[tuple[str, dict]], content: str | None
) -> ExtractedToolCalls:
    """Whole-output parse equals the expectation; every split streams to the same result."""
    res = get_tool_parser(name)().extract_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in res.tool_calls] == calls
    assert res.content == content
    assert res.tools_called == bool(calls)
    assert all(ID.fullmatch(c.id) for c in res.tool_calls)
    for pieces in splits(text):
        s_content, s_calls = stream(name, pieces)
        assert s_content == (res.content or ""), pieces
        assert [(n, a) for _, n, a in s_calls] == [(c.name, c.arguments) for c in res.tool_calls]
        assert all(ID.fullmatch(i) for i, _, _ in s_calls)
    return res


NESTED = {
    "query": 'say "hi" \\ there',
    "filter": {"tags": ["a", "b"], "range": {"lo": 1, "hi": 2.5}},
}
NESTED_JSON = json.dumps(NESTED)
WEATHER = {"city": "Paris", "unit": "celsius"}


# --- hermes (Qwen2.5 / Qwen3) ---


def hermes_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_hermes_single():
    check("hermes", hermes_call("get_weather", WEATHER), [("get_weather", WEATHER)], None)


def test_hermes_parallel_with_text_around():
    text = (
        "Let me look both up.\n"
        + hermes_call("get_weather", WEATHER)
        + "\n"
        + hermes_call("search", NESTED)
        + "\nBoth requested."
    )
    res = check(
        "hermes",
        text,
        [("get_weather", WEATHER), ("search", NESTED)],
        "Let me look both up.\n\n\nBoth requested.",
    )
    assert res.tool_calls[1].arguments == NESTED_JSON
    assert res.tool_calls[0].id != res.tool_calls[1].id


def test_hermes_unicode_kept_unescaped():
    text = hermes_call("translate", {"text": "日本語 — ok"})
    res = check("hermes", text, [("translate", {"text": "日本語 — ok"})], None)
    assert res.tool_calls[0].arguments == '{"text": "日本語 — ok"}'


def test_hermes_cut_at_max_tokens():
    cut = '<tool_call>\n{"name": "search", "arguments": {"query": "par'
    text = "Sure.\n" + hermes_call("get_weather", WEATHER) + "\n" + cut
    check("hermes", text, [("get_weather", WEATHER)], "Sure.\n\n" + cut)


def test_hermes_malformed_call_is_content():
    bad = '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>'
    check("hermes", "x " + bad, [], "x " + bad)


def test_hermes_plain_text_with_angle_brackets():
    text = "if a < b and b <tool then <tool_call"
    check("hermes", text, [], text)
    check("hermes", "   \n ", [], None)


# --- llama3_json (Llama 3.1 / 3.2) ---


def test_llama_single_with_python_tag():
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    )
    check("llama3_json", text, [("get_weather", WEATHER)], None)


def test_llama_parallel_semicolons_and_arguments_key():
    text = (
        '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}; "
        '{"name": "search", "arguments": ' + NESTED_JSON + "};\n"
        '{"name": "noargs", "parameters": {}}'
    )
    res = check(
        "llama3_json", text, [("get_weather", WEATHER), ("search", NESTED), ("noargs", {})], None
    )
    assert res.tool_calls[1].arguments == NESTED_JSON


def test_llama_text_after_calls():
    text = '{"name": "f", "parameters": {"x": 1}}\n\nThat is the call.'
    check("llama3_json", text, [("f", {"x": 1})], "That is the call.")


def test_llama_plain_json_answer_is_content():
    text = '{"answer": 42, "items": ["{", "}"]}'
    check("llama3_json", text, [], text)
    text = 'The weather: {"name": "f", "parameters": {}}'
    check("llama3_json", text, [], text)


def test_llama_cut_at_max_tokens():
    text = (
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"q": "a}'
    )
    check("llama3_json", text, [("f", {"x": 1})], '{"name": "g", "parameters": {"q": "a}')
    cut = '<|python_tag|>{"name": "f", "parame'
    check("llama3_json", cut, [], cut)


# --- openai (gpt-oss harmony) ---

ANALYSIS = "<|channel|>analysis<|message|>User wants weather. Call get_weather.<|end|>"


def harmony_call(name: str, args_text: str) -> str:
    return (
        f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json"
        f"<|message|>{args_text}<|call|>"
    )


def test_openai_analysis_then_call():
    args = '{"city":"Paris","unit":"celsius"}'
    res = check(
        "openai", ANALYSIS + harmony_call("get_weather", args), [("get_weather", WEATHER)], None
    )
    assert res.tool_calls[0].arguments == args  # the model's own JSON text


def test_openai_parallel_calls_recipient_in_role():
    text = (
        ANALYSIS
        + harmony_call("get_weather", json.dumps(WEATHER))
        + "<|start|>assistant to=functions.search<|channel|>commentary json<|message|>"
        + NESTED_JSON
        + "<|call|>"
    )
    check("openai", text, [("get_weather", WEATHER), ("search", NESTED)], None)


def test_openai_final_answer_only_final_channel_is_content():
    text = (
        "<|start|>assistant"
        + ANALYSIS
        + "<|start|>assistant<|channel|>commentary<|message|>Checking now.<|end|>"
        + "<|start|>assistant to=browser.search<|channel|>analysis<|message|>"
        + '{"q": "x"}<|call|>'
        + "<|start|>assistant<|channel|>final<|message|>It is 20 °C in <b>Paris</b>.<|return|>"
    )
    check("openai", text, [], "It is 20 °C in <b>Paris</b>.")


def test_openai_cut_at_max_tokens():
    text = (
        ANALYSIS
        + harmony_call("get_weather", json.dumps(WEATHER))
        + (
            '<|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": "pa'
        )
    )
    check("openai", text, [("get_weather", WEATHER)], '{"query": "pa')
    text = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>The answer is"
    check("openai", text, [], "The answer is")
    check("openai", ANALYSIS + "<|start|>assistant<|channel|>fin", [], None)


def test_openai_bare_text_is_content():
    check("openai", "Just text, no harmony <b>tags</b>.", [], "Just text, no harmony <b>tags</b>.")


# --- deepseek_v3 (V3 / R1 layout and V3.1 layout) ---

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_v3_call(name: str, args_text: str) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{args_text}\n```{CE}"


def test_deepseek_v3_parallel_with_text_before():
    text = (
        "I'll check both.\n\n"
        + B
        + ds_v3_call("get_weather", json.dumps(WEATHER))
        + "\n"
        + ds_v3_call("search", NESTED_JSON)
        + E
    )
    res = check(
        "deepseek_v3", text, [("get_weather", WEATHER), ("search", NESTED)], "I'll check both."
    )
    assert res.tool_calls[1].arguments == NESTED_JSON


def test_deepseek_v31_layout():
    args = '{"city": "Paris", "unit": "celsius"}'
    text = f"{B}{CB}get_weather{SEP}{args}{CE}{CB}search{SEP}{NESTED_JSON}{CE}{E}"
    res = check("deepseek_v31", text, [("get_weather", WEATHER), ("search", NESTED)], None)
    assert res.tool_calls[0].arguments == args


def test_deepseek_cut_at_max_tokens():
    cut = f'{CB}function{SEP}search\n```json\n{{"query": "pa'
    text = "Hi. " + B + ds_v3_call("get_weather", json.dumps(WEATHER)) + cut
    check("deepseek_v3", text, [("get_weather", WEATHER)], "Hi. " + cut)
    check("deepseek_v3", "Hi. " + B + CB + "get_we", [], "Hi. " + CB + "get_we")


# --- glm45 (GLM-4.5 / 4.6 / 4.7) ---


def test_glm45_single_typed_values():
    text = (
        '<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>say "hi" today</arg_value>\n'
        "<arg_key>limit</arg_key>\n<arg_value>5</arg_value>\n"
        "<arg_key>exact</arg_key>\n<arg_value>true</arg_value>\n"
        '<arg_key>filter</arg_key>\n<arg_value>{"tags": ["a"], "range": {"lo": 1}}</arg_value>\n'
        "</tool_call>"
    )
    expected = {
        "query": 'say "hi" today',
        "limit": 5,
        "exact": True,
        "filter": {"tags": ["a"], "range": {"lo": 1}},
    }
    check("glm45", text, [("search", expected)], None)


def test_glm45_parallel_with_text_and_no_newline_after_name():
    text = (
        "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>"
        "<tool_call>now<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>\nDone."
    )
    check(
        "glm45",
        text,
        [("get_weather", WEATHER), ("now", {"tz": "UTC"})],
        "Checking.\n\nDone.",
    )


def test_glm45_cut_at_max_tokens():
    cut = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"
    check("glm45", "Checking.\n" + cut, [], "Checking.\n" + cut)


# --- registry and helpers ---


def test_registry():
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "openai", "deepseek_v3", "glm45"}
    for name in TOOL_PARSERS:
        assert get_tool_parser(name)().extract_tool_calls("hello").content == "hello"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        get_tool_parser("nope")


def test_helpers():
    assert partial_tag_len("abc <tool_ca", ["<tool_call>"]) == len("<tool_ca")
    assert partial_tag_len("abc <tool_call>", ["<tool_call>"]) == 0
    assert partial_tag_len("x<", ["<a>", "<|b|>"]) == 1
    text = 'x{"a": "}{\\"", "b": [{}]}y'
    assert json_object_end(text, 1) == len(text) - 1
    assert json_object_end('{"a": "}', 0) is None
