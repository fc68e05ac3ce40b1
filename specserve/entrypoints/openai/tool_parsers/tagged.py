"""Formats whose calls sit between an open and a close tag, each body parsed on its own (hermes,
glm45, deepseek_v3). Text between calls is content; a call without its close tag at the end of
the output, or whose body does not parse, is content too (its raw text, tags included)."""

from __future__ import annotations

from typing import ClassVar

from specserve.entrypoints.openai.tool_parsers.base import Segment, ToolCall, ToolParser
from specserve.entrypoints.openai.tool_parsers.text import partial_tag_len


class TaggedToolParser(ToolParser):
    call_start: ClassVar[str]
    call_end: ClassVar[str]
    # Wrapper tokens around a group of calls (DeepSeek's): dropped from content.
    drop_tokens: ClassVar[tuple[str, ...]] = ()

    def _parse_body(self, body: str) -> ToolCall | None:
        """The call a body (the text between the tags) spells, None when it is malformed."""
        raise NotImplementedError

    def _parse(self, buf: str, final: bool) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        pos = 0
        while True:
            start = buf.find(self.call_start, pos)
            if start < 0:
                end = len(buf)
                if not final:
                    end -= partial_tag_len(buf[pos:], (self.call_start, *self.drop_tokens))
                segments.append(self._clean(buf[pos:end]))
                return segments, end
            segments.append(self._clean(buf[pos:start]))
            body_start = start + len(self.call_start)
            stop = buf.find(self.call_end, body_start)
            if stop < 0:
                if final:
                    segments.append(self._clean(buf[start:]))
                    return segments, len(buf)
                return segments, start
            pos = stop + len(self.call_end)
            call = self._parse_body(buf[body_start:stop])
            segments.append(call if call is not None else self._clean(buf[start:pos]))

    def _clean(self, text: str) -> str:
        for token in self.drop_tokens:
            text = text.replace(token, "")
        return text
