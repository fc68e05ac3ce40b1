"""Small text helpers shared by the tool-call and reasoning parsers: the whitespace rule both
paths apply to a field, and the hold-back of a possible partial tag at the end of a piece."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def strip_or_none(text: str) -> str | None:
    """The non-streamed form of a text field: stripped of leading and trailing whitespace, None
    when nothing is left."""
    return text.strip() or None


class StrippedStream:
    """The streamed form of the same rule: pieces in, pieces out, whose concatenation is
    `"".join(pieces).strip()`. Leading whitespace is dropped; trailing whitespace is held until
    more text follows it, and dropped by `finish`."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, piece: str) -> str:
        if not self._started:
            piece = piece.lstrip()
            if not piece:
                return ""
            self._started = True
        text = self._held + piece
        out = text.rstrip()
        self._held = text[len(out) :]
        return out

    def finish(self) -> str:
        self._held = ""
        return ""


def partial_tag_len(text: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`: the text a
    streaming parser holds back because the next piece may complete it into a tag."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


@dataclass
class JsonObjectScan:
    """Finds the `}` that closes the JSON object opening at `text[start] == "{"`, resumably: a
    streaming parser calls `end` again as the text grows and the scan goes on from where it
    stopped (a long argument streamed token by token stays linear). Strings and their escapes
    are skipped, so braces inside them do not count; the slice is not validated (json.loads
    does that)."""

    start: int
    pos: int = -1  # next index to read
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def end(self, text: str) -> int | None:
        """Index just past the closing `}`, None when the text ends first."""
        for i in range(max(self.pos, self.start), len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


def json_object_end(text: str, start: int) -> int | None:
    """`JsonObjectScan` in one go."""
    return JsonObjectScan(start).end(text)
