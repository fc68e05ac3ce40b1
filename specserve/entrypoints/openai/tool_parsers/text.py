"""Small text helpers shared by the tool-call and reasoning parsers: the whitespace rule both
paths apply to a field, and the hold-back of a possible partial tag at the end of a piece."""

from __future__ import annotations

from collections.abc import Iterable


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


def json_object_end(text: str, start: int) -> int | None:
    """Index just past the `}` that closes the JSON object opening at `text[start] == "{"`, or
    None when the text ends first. Strings and their escapes are skipped, so braces inside them
    do not count; the slice is not validated (json.loads does that)."""
    depth = 0
    in_string = False
    escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
