"""One chat choice's generated text as the Chat Completions API returns it: reasoning split off
by the `--reasoning-parser`, then tool calls read by the `--tool-call-parser` ("auto") or out
of the forced JSON ("required", a named function: tools.py), whole or streamed.

The whole and the streamed paths run the same parsers (each agrees with itself for every split
of the text), so the streamed reasoning, content and call arguments join to the whole
response's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specserve.entrypoints.openai.reasoning import ReasoningParser
from specserve.entrypoints.openai.tool_parsers import ToolCallDelta, ToolParser
from specserve.entrypoints.openai.tools import ForcedCallScanner


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChatOutputParser:
    """`mode`: "text" (content only), "auto" (calls parsed by `tool_parser`) or "forced"
    (the output is the forced JSON: `named` function's arguments, or the "required" array).
    `parallel`: False keeps the first call only."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        mode: str,
        tool_parser: ToolParser | None = None,
        named: str | None = None,
        parallel: bool = True,
    ) -> None:
        self.reasoning = reasoning
        self.mode = mode
        self.tool_parser = tool_parser
        self.named = named
        self.parallel = parallel
        self._scanner = ForcedCallScanner(named) if mode == "forced" else None
        self.called = False  # streaming: a call was sent

    # ---- whole output ----------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The response's `message` and its finish_reason ("tool_calls" when it holds calls)."""
        reasoning, content = (None, text)
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text)
        calls: list[tuple[str, str, str]] = []  # (id, name, arguments)
        if self.mode == "auto" and self.tool_parser is not None:
            source = text if self.tool_parser.reads_reasoning else content or ""
            ex = self.tool_parser.extract_tool_calls(source)
            if ex.tools_called:
                calls = [(t.id, t.name, t.arguments) for t in ex.tool_calls]
                content = ex.content
        elif self.mode == "forced" and finish_reason == "stop":
            # NOTE: a forced output cut short (max_tokens) is no call: its text stays content.
            scanner = ForcedCallScanner(self.named)
            scanner.feed(content or "")
            calls = [(c.id, c.name or "", c.arguments) for c in scanner.calls]
            content = None
        if not self.parallel:
            calls = calls[:1]
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            # vLLM's current field and its earlier name, which clients still read.
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in calls
            ]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return msg, finish_reason

    # ---- streamed ----------------------------------------------------------------------------
    def feed(self, text: str, final: bool) -> ChatDelta:
        """The next piece of the output; `final`: it is the last (flush what was held)."""
        out = ChatDelta(content=text)
        if self.reasoning is not None:
            d = self.reasoning.extract_reasoning_streaming(text)
            out.reasoning, out.content = d.reasoning, d.content
            if final:
                end = self.reasoning.finish_streaming()
                out.reasoning += end.reasoning
                out.content += end.content
        if self.mode == "auto" and self.tool_parser is not None:
            p = self.tool_parser
            sd = p.extract_tool_calls_streaming(text if p.reads_reasoning else out.content)
            out.content, out.tool_calls = sd.content, sd.tool_calls
            if final:
                end_tools = p.finish_streaming()
                out.content += end_tools.content
                out.tool_calls += end_tools.tool_calls
        elif self._scanner is not None:
            out.tool_calls, out.content = self._scanner.feed(out.content), ""
        if not self.parallel:
            out.tool_calls = [t for t in out.tool_calls if t.index == 0]
        self.called = self.called or bool(out.tool_calls)
        return out

    def delta_json(self, d: ChatDelta) -> dict[str, Any]:
        """The chunk's `delta` fields (without the role)."""
        msg: dict[str, Any] = {}
        if d.content:
            msg["content"] = d.content
        if d.reasoning:
            msg["reasoning"] = msg["reasoning_content"] = d.reasoning
        if d.tool_calls:
            msg["tool_calls"] = [_call_json(t) for t in d.tool_calls]
        if not msg:
            msg["content"] = ""
        return msg


def _call_json(t: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's streamed call: id, type and name in its first piece, then arguments only."""
    fn: dict[str, Any] = {"arguments": t.arguments}
    out: dict[str, Any] = {"index": t.index}
    if t.id is not None:
        out["id"], out["type"] = t.id, "function"
    if t.name is not None:
        fn["name"] = t.name
    out["function"] = fn
    return out
