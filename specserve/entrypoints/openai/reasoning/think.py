"""Reasoning between `<think>` and `</think>` (Qwen3, DeepSeek-R1, GLM-4.5).

Where the output starts decides whether it is reasoning:
  - the output opens (after whitespace) with `<think>`: reasoning up to `</think>`;
  - otherwise, with `thinking_in_prompt` (the template ended the prompt with `<think>`, as
    DeepSeek-R1-0528's and Qwen3-*-Thinking-2507's do): reasoning up to `</think>`;
  - otherwise no reasoning: all content (Qwen3 with enable_thinking=False, whose template
    writes the empty `<think>\\n\\n</think>` into the prompt).
Content is everything after the first `</think>`. No `</think>` inside reasoning: all
reasoning (cut at max_tokens), as vLLM's deepseek_r1 parser decides."""

from __future__ import annotations

from typing import ClassVar

from specserve.entrypoints.openai.reasoning.base import ReasoningDelta, ReasoningParser
from specserve.entrypoints.openai.tool_parsers.text import partial_tag_len

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkReasoningParser(ReasoningParser):
    end_marker = THINK_END
    # The family's default for thinking_in_prompt=None.
    default_thinking_in_prompt: ClassVar[bool] = False

    def __init__(
        self, tokenizer: object | None = None, *, thinking_in_prompt: bool | None = None
    ) -> None:
        super().__init__(tokenizer, thinking_in_prompt=thinking_in_prompt)
        self._in_prompt = (
            self.default_thinking_in_prompt if thinking_in_prompt is None else thinking_in_prompt
        )
        self._buf = ""
        self._consumed = 0  # characters of the output before self._buf
        self._state = "start"  # start | think | content
        self._content_at: int | None = None

    @staticmethod
    def prompt_opens_thinking(prompt: str) -> bool:
        """Whether a rendered prompt leaves the output inside the thinking: its last `<think>`
        comes after its last `</think>`. The value to pass as thinking_in_prompt."""
        return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)

    def content_start(self, text: str) -> int | None:
        fresh = type(self)(self.tokenizer, thinking_in_prompt=self.thinking_in_prompt)
        fresh._parse(text, final=False)
        return fresh._content_at

    def _parse(self, text: str, final: bool) -> ReasoningDelta:
        buf = self._buf + text
        out = ReasoningDelta()
        pos = 0
        if self._state == "start":
            k = len(buf) - len(buf.lstrip())
            if buf.startswith(THINK_START, k):
                pos = k + len(THINK_START)
                self._state = "think"
            elif not final and THINK_START.startswith(buf[k:]):
                self._buf = buf  # only whitespace or part of the open tag so far
                return out
            else:
                self._state = "think" if self._in_prompt else "content"
                if self._state == "content":
                    self._content_at = self._consumed
        if self._state == "think":
            end = buf.find(THINK_END, pos)
            if end >= 0:
                out.reasoning = buf[pos:end]
                pos = end + len(THINK_END)
                self._state = "content"
                self._content_at = self._consumed + pos
            else:
                stop = len(buf) - (0 if final else partial_tag_len(buf[pos:], (THINK_END,)))
                out.reasoning = buf[pos:stop]
                pos = stop
        if self._state == "content":
            out.content = buf[pos:]
            pos = len(buf)
        self._buf = buf[pos:]
        self._consumed += pos
        return out


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    default_thinking_in_prompt = True


class Glm45ReasoningParser(ThinkReasoningParser):
    name = "glm45"
