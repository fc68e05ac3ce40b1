"""Chat Completions tool calling: what `tool_choice` makes of a request, and how forced calls
come back out of the generated text.

  - "none" (the default without `tools`): plain text; the tools still reach the template.
  - "auto" (the default with `tools`): the model decides; its calls are parsed out of the text
    by the server's `--tool-call-parser` (tool_parsers/), which `--enable-auto-tool-choice`
    turns on, as in vLLM. Without it "auto" is a 400.
  - "required" and a named function: decoding is forced by the grammar step (xgrammar, at every
    draft position: the same path as `response_format`), as vLLM builds it: "required" is a JSON
    array of `{"name": <one tool's name>, "parameters": <its schema>}` objects (at least one; at
    most one when `parallel_tool_calls` is false), a named function is its parameters' schema
    alone. Every returned call's `arguments` therefore parses and satisfies its schema.

`ForcedCallScanner` turns the forced JSON into calls piece by piece: a call's id and name once
its name is complete, then its arguments as they are generated (the JSON text of the
`parameters` value, exactly as generated), so the streamed pieces join to the non-streamed
arguments by construction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from specserve.entrypoints.openai.tool_parsers.base import ToolCallDelta, make_tool_call_id

# A function without `parameters` takes none (OpenAI): an empty object.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or EMPTY_PARAMETERS


def required_calls_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": an array of calls of any of `functions`."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [f["name"]]},
                        "parameters": parameters_schema(f),
                    },
                    # NOTE: xgrammar writes properties in the declared order, so "name" comes
                    # first: the scanner knows the function before its arguments start.
                    "required": ["name", "parameters"],
                }
                for f in functions
            ],
        },
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def describe_tools(functions: list[dict[str, Any]], choice: str | None) -> str:
    """A system message for a chat template that reads no `tools`: the functions and, for a
    forced choice, the form of the answer (the grammar enforces it either way)."""
    lines = [
        "You can call these functions (their parameters are JSON Schema):",
        json.dumps(functions, ensure_ascii=False),
    ]
    if choice == "required":
        lines.append(
            'Answer with a JSON array of calls: [{"name": <function name>, "parameters": '
            "<arguments object>}]."
        )
    elif choice is not None and choice not in ("auto", "none"):
        lines.append(f"Answer with the arguments of `{choice}` as a JSON object.")
    return "\n".join(lines)


def hermes_call_text(name: str, arguments: str) -> str:
    """An assistant's earlier call written into its message text, for chat templates that read
    no `tool_calls` (the hermes form: what `--tool-call-parser hermes` reads back)."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


@dataclass
class _Call:
    id: str = field(default_factory=make_tool_call_id)
    name: str | None = None
    arguments: str = ""


class ForcedCallScanner:
    """Calls out of forced output, fed in pieces. `named`: the output is one call's arguments
    object; else the output is the "required" array of {"name", "parameters"} objects.

    The grammar guarantees the shape, so the scanner only tracks JSON nesting and strings: at
    depth 2 (inside an array element) it reads the keys, the "name" string and the span of the
    "parameters" value."""

    def __init__(self, named: str | None = None) -> None:
        self.named = named
        self.calls: list[_Call] = [_Call(name=named)] if named is not None else []
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._str = ""  # the string being read at depth 2 (a key or the name)
        self._key: str | None = None
        self._expect_key = False
        self._in_params = False
        self._sent_head = False

    def feed(self, text: str) -> list[ToolCallDelta]:
        """The deltas `text` adds: a call's id + name once, then arguments pieces."""
        if self.named is not None:
            deltas = []
            if not self._sent_head:
                self._sent_head = True
                deltas.append(ToolCallDelta(0, self.calls[0].id, self.named, ""))
            if text:
                self.calls[0].arguments += text
                if deltas:
                    deltas[0].arguments = text
                else:
                    deltas.append(ToolCallDelta(0, None, None, text))
            return deltas
        out: list[ToolCallDelta] = []
        for ch in text:
            self._step(ch, out)
        return _merge(out)

    def _step(self, ch: str, out: list[ToolCallDelta]) -> None:
        if self._in_params:
            self._args(ch, out)
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                if self._depth == 2:
                    self._close_string(out)
                return
            if self._depth == 2:
                self._str += ch
            return
        if ch == '"':
            self._in_str, self._str = True, ""
            return
        if ch in "[{":
            self._depth += 1
            if self._depth == 2:
                self.calls.append(_Call())
                self._expect_key = True
            elif self._depth == 3 and self._key == "parameters" and not self._in_params:
                self._start_params(ch, out)
        elif ch in "]}":
            self._depth -= 1
            if self._depth == 2 and self._in_params:
                self._in_params = False
        elif self._depth == 2:
            if ch == ",":
                self._expect_key, self._key = True, None
                self._in_params = False
            elif ch == ":":
                self._expect_key = False

    def _start_params(self, ch: str, out: list[ToolCallDelta]) -> None:
        # NOTE: a function's parameters are an object schema (OpenAI), so the value is an
        # object: its span runs from this brace to the one that closes it.
        self._in_params = True
        self._args(ch, out)

    def _args(self, ch: str, out: list[ToolCallDelta]) -> None:
        call = self.calls[-1]
        call.arguments += ch
        out.append(ToolCallDelta(len(self.calls) - 1, None, None, ch))

    def _close_string(self, out: list[ToolCallDelta]) -> None:
        if self._expect_key:
            self._key = json.loads(f'"{self._str}"')
            return
        if self._key == "name":
            call = self.calls[-1]
            call.name = json.loads(f'"{self._str}"')
            out.append(ToolCallDelta(len(self.calls) - 1, call.id, call.name, ""))


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive argument pieces of one call as one delta (one per call and chunk)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and last.index == d.index and d.id is None:
            last.arguments += d.arguments
        else:
            out.append(ToolCallDelta(d.index, d.id, d.name, d.arguments))
    return out
