"""The tool-call parser interface (vLLM's `--tool-call-parser`): a model's generated text in,
OpenAI `tool_calls` and the remaining `content` out, whole or streamed piece by piece.

Both paths run the same scanner (`ToolParser._parse`), so they agree by construction:
  - `content` is the text outside the calls, joined as generated, with leading and trailing
    whitespace stripped (None when nothing is left); streamed content drops leading whitespace
    and holds trailing whitespace until more content follows it (`StrippedStream`).
  - a call is reported only once it is complete (its closing tag seen and its arguments valid
    JSON); streaming then sends it as one `ToolCallDelta` carrying id, name and all of its
    arguments. A call cut short (max_tokens) or malformed is not a call: its text is content,
    as in vLLM. Holding a call's argument pieces back until it closes is what lets the two
    paths agree for every split of the text.
  - text that may be the start of a tag is held back until the next piece decides it.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar

from specserve.entrypoints.openai.tool_parsers.text import StrippedStream, strip_or_none

_ID_ALPHABET = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ToolCall:
    """One parsed call."""

    name: str
    # A JSON string: the arguments object serialized (the model's own text where it already is).
    arguments: str
    id: str = field(default_factory=make_tool_call_id)


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    # Text outside the calls; None when empty or whitespace.
    content: str | None


@dataclass
class ToolCallDelta:
    """One streamed piece of a call, as OpenAI streams `delta.tool_calls`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


# What a scanner yields, in text order: plain text, or a complete call.
Segment = str | ToolCall


class ToolParser:
    """Base of the tool-call parsers. A format implements `_parse`; an instance holds the state of
    one streamed output (make one per request)."""

    name: ClassVar[str]
    # True where the format interleaves reasoning with calls (harmony), so the parser reads the
    # whole output, reasoning included, rather than the reasoning parser's content.
    reads_reasoning: ClassVar[bool] = False

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self._buf = ""
        self._num_calls = 0
        self._content = StrippedStream()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """Parse a whole output (stateless: uses a fresh scanner)."""
        segments = type(self)(self.tokenizer)._feed(text, final=True)
        calls = [s for s in segments if isinstance(s, ToolCall)]
        content = "".join(s for s in segments if isinstance(s, str))
        return ExtractedToolCalls(bool(calls), calls, strip_or_none(content))

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        """Feed the next piece of the output; returns what is decided so far."""
        return self._to_delta(self._feed(delta_text, final=False))

    def finish_streaming(self) -> StreamDelta:
        """End of output: what was held back, decided as the whole-output parse decides it."""
        delta = self._to_delta(self._feed("", final=True))
        delta.content += self._content.finish()
        return delta

    def _feed(self, text: str, final: bool) -> list[Segment]:
        self._buf += text
        segments, consumed = self._parse(self._buf, final)
        self._buf = self._buf[consumed:]
        return segments

    def _to_delta(self, segments: list[Segment]) -> StreamDelta:
        delta = StreamDelta()
        for seg in segments:
            if isinstance(seg, str):
                delta.content += self._content.push(seg)
            else:
                delta.tool_calls.append(
                    ToolCallDelta(self._num_calls, seg.id, seg.name, seg.arguments)
                )
                self._num_calls += 1
        return delta

    def _parse(self, buf: str, final: bool) -> tuple[list[Segment], int]:
        """Scan the unconsumed text `buf`: return the segments it decides and how many of its
        characters they used up. Unless `final`, stop before anything the next piece could
        change (a partial tag, an unclosed call); the rest comes back as `buf`'s start on the
        next call. With `final`, use up all of `buf`. Parser state carried between calls (e.g.
        "inside a block") must describe the text before the returned offset."""
        raise NotImplementedError


def arguments_json(args: Any) -> str | None:
    """The `arguments` string for a decoded arguments value: an object serialized; a string kept
    when it is itself a JSON object's text; None (not a call) for anything else."""
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    if isinstance(args, str):
        return args.strip() if isinstance(loads_or_none(args), dict) else None
    return None


def loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
