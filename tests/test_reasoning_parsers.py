"""Reasoning parsers against outputs in each family's format: the whole-output split into
(reasoning, content) is exact; streaming in pieces of 1, 2, 7 and random sizes, and in pieces
where the end of thinking falls inside a piece (a speculative step's several tokens), gives the
same fields; content_start is where the content begins and never moves once decided."""

from __future__ import annotations

import pytest

from specserve.entrypoints.openai.reasoning import (
    REASONING_PARSERS,
    ThinkReasoningParser,
    get_reasoning_parser,
)

from .split_utils import splits


def stream(name: str, pieces: list[str], thinking_in_prompt: bool | None) -> tuple[str, str]:
    parser = get_reasoning_parser(name)(thinking_in_prompt=thinking_in_prompt)
    deltas = [parser.extract_reasoning_streaming(p) for p in pieces]
    deltas.append(parser.finish_streaming())
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


def check(
    name: str,
    text: str,
    reasoning: str | None,
    content: str | None,
    content_at: int | None,
    thinking_in_prompt: bool | None = None,
    extra_splits: tuple[list[str], ...] = (),
) -> None:
    parser = get_reasoning_parser(name)(thinking_in_prompt=thinking_in_prompt)
    assert parser.extract_reasoning(text) == (reasoning, content)
    for pieces in (*splits(text), *extra_splits):
        assert "".join(pieces) == text
        assert stream(name, pieces, thinking_in_prompt) == (reasoning or "", content or ""), pieces
    assert parser.content_start(text) == content_at
    assert parser.is_reasoning_end(text) == (content_at is not None)
    # Once decided, the content start stays where it is as the output grows.
    for i in range(len(text) + 1):
        assert parser.content_start(text[:i]) in (None, content_at), text[:i]


THINK = 'Let me think.\nThe user asks for 2 + 2 <in math> = 4, not "</thin".\n'


# --- qwen3 ---


def test_qwen3_think_then_answer():
    text = f"<think>\n{THINK}</think>\n\nThe answer is 4."
    at = text.index("</think>") + len("</think>")
    pieces = ["<think>\n" + THINK[:-3], THINK[-3:] + "</think>\n\nThe ans", "wer is 4."]
    check("qwen3", text, THINK.strip(), "The answer is 4.", at, extra_splits=(pieces,))


def test_qwen3_end_inside_one_piece():
    text = "<think>foo</think>bar"
    check(
        "qwen3",
        text,
        "foo",
        "bar",
        len("<think>foo</think>"),
        extra_splits=([text], ["<think>", "foo</think>bar"]),
    )


def test_qwen3_thinking_disabled_is_all_content():
    text = "The answer is 4 <b>bold</b>."
    check("qwen3", text, None, text, 0)
    check("qwen3", "\n\n", None, None, None)


def test_qwen3_thinking_in_prompt():
    # Qwen3-*-Thinking-2507: the template opens <think>; the output only closes it.
    text = f"{THINK}</think>\n\n42"
    check("qwen3", text, THINK.strip(), "42", len(THINK) + len("</think>"), thinking_in_prompt=True)
    prompt = "<|im_start|>assistant\n<think>\n"
    assert ThinkReasoningParser.prompt_opens_thinking(prompt)
    assert not ThinkReasoningParser.prompt_opens_thinking(prompt + "\n</think>\n\n")


def test_qwen3_cut_while_thinking():
    text = f"<think>\n{THINK}</thi"
    check("qwen3", text, (THINK + "</thi").strip(), None, None)


# --- deepseek_r1 ---


def test_deepseek_r1_open_tag_in_prompt():
    text = f"{THINK}</think>\n\nThe answer is **4**."
    check("deepseek_r1", text, THINK.strip(), "The answer is **4**.", len(THINK) + len("</think>"))


def test_deepseek_r1_open_tag_in_output():
    text = f"<think>\n{THINK}</think>The answer is 4."
    check("deepseek_r1", text, THINK.strip(), "The answer is 4.", text.index("The answer"))


def test_deepseek_r1_cut_while_thinking_and_empty_thinking():
    check("deepseek_r1", THINK, THINK.strip(), None, None)
    check("deepseek_r1", "</think>\n\nHi", None, "Hi", len("</think>"))


# --- glm45 ---


def test_glm45_think_then_tool_call_text():
    call = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
    text = f"\n<think>{THINK}</think>\n{call}"
    check("glm45", text, THINK.strip(), call, text.index("</think>") + len("</think>"))


def test_glm45_no_thinking():
    check("glm45", "Hello there", None, "Hello there", 0)


# --- openai_gptoss (harmony) ---

ANALYSIS = "<|channel|>analysis<|message|>User asks 2+2. Easy: 4.<|end|>"


def test_gptoss_analysis_then_final():
    final = "<|start|>assistant<|channel|>final<|message|>"
    text = ANALYSIS + final + "The answer is 4.<|return|>"
    pieces = [ANALYSIS[:-3], ANALYSIS[-3:] + final + "The ans", "wer is 4.<|return|>"]
    check(
        "openai_gptoss",
        text,
        "User asks 2+2. Easy: 4.",
        "The answer is 4.",
        text.index(final) + len(final),
        extra_splits=(pieces,),
    )


def test_gptoss_analysis_then_tool_call():
    text = (
        ANALYSIS
        + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        + '<|message|>{"city": "Paris"}<|call|>'
    )
    check("openai_gptoss", text, "User asks 2+2. Easy: 4.", None, None)


def test_gptoss_cut_while_thinking():
    text = "<|channel|>analysis<|message|>Still thinking about <|"
    check("openai_gptoss", text, "Still thinking about <|", None, None)


def test_gptoss_two_analysis_messages():
    text = (
        "<|channel|>analysis<|message|>First.<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|> Second.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done<|return|>"
    )
    check("openai_gptoss", text, "First. Second.", "Done", text.index("Done"))


# --- registry ---


def test_registry():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1", "glm45", "openai_gptoss"}
    assert get_reasoning_parser("qwen3").end_marker == "</think>"
    assert get_reasoning_parser("openai_gptoss").end_marker == "<|channel|>final<|message|>"
    with pytest.raises(ValueError, match="--reasoning-parser"):
        get_reasoning_parser("nope")
