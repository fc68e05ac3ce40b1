"""`llama3_json`: Llama 3.1 / 3.2 JSON calls (the JSON tool template), the output opening with
the calls:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

`<|python_tag|>` is optional (it only survives detokenization with special tokens kept);
"arguments" is accepted for "parameters"; parallel calls are separated by `;` (or only by
whitespace). The output is a call list only where it starts, after whitespace, with the tag or
`{` (vLLM's streaming rule; the whole-output parse follows it too, so both agree):
  - a JSON object that is not a call (no string "name", or no object arguments) is content, and
    so is everything after it: a plain JSON answer stays the answer;
  - text after the last call is content;
  - an object cut short (max_tokens) is content, the calls before it stay calls."""

from __future__ import annotations

from specserve.entrypoints.openai.tool_parsers.base import (
    Segment,
    ToolCall,
    ToolParser,
    arguments_json,
    loads_or_none,
)
from specserve.entrypoints.openai.tool_parsers.text import JsonObjectScan

PYTHON_TAG = "<|python_tag|>"


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, tokenizer: object | None = None) -> None:
        super().__init__(tokenizer)
        # Where the scan stands: "start" (nothing decided), "calls" (after a call), "text"
        # (everything from here on is content).
        self._mode = "start"
        self._scan: JsonObjectScan | None = None

    def _parse(self, buf: str, final: bool) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        pos = 0
        while True:
            if self._mode == "text":
                segments.append(buf[pos:])
                return segments, len(buf)
            obj_start = self._next_object(buf, pos, final)
            if obj_start is None:  # undecided: wait for more text
                return segments, pos
            if obj_start < 0:  # no further call
                pos = self._to_text(buf, pos)
                continue
            # NOTE: a held object starts at the same index of the next buf (the scan returns
            # the offset before it), so its brace scan resumes instead of restarting.
            if self._scan is None or self._scan.start != obj_start:
                self._scan = JsonObjectScan(obj_start)
            end = self._scan.end(buf)
            if end is not None or final:
                self._scan = None
            if end is None:
                if not final:
                    return segments, pos
                pos = self._to_text(buf, pos)
                continue
            call = self._call(buf[obj_start:end])
            if call is None:
                pos = self._to_text(buf, pos)
                continue
            segments.append(call)
            self._mode = "calls"
            pos = end

    def _to_text(self, buf: str, pos: int) -> int:
        """Switch to content for the rest of the output; returns where it starts (after the
        separator that follows a call)."""
        if self._mode == "calls":
            pos = _skip_space(buf, pos)
            pos += buf.startswith(";", pos)
        self._mode = "text"
        return pos

    def _next_object(self, buf: str, pos: int, final: bool) -> int | None:
        """Index of the `{` that opens the next call candidate, -1 when the text goes on with
        something else, None while undecided (only whitespace, a separator or part of the tag
        so far)."""
        k = _skip_space(buf, pos)
        if self._mode == "start":
            if buf.startswith(PYTHON_TAG, k):
                k = _skip_space(buf, k + len(PYTHON_TAG))
            elif PYTHON_TAG.startswith(buf[k:]) and buf[k:]:
                return -1 if final else None
        elif k < len(buf) and buf[k] == ";":
            k = _skip_space(buf, k + 1)
        if k == len(buf):
            return -1 if final else None
        return k if buf[k] == "{" else -1

    def _call(self, text: str) -> ToolCall | None:
        obj = loads_or_none(text)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = arguments_json(obj.get("parameters", obj.get("arguments", {})))
        return None if args is None else ToolCall(obj["name"], args)
