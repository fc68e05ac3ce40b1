"""A streaming scanner of gpt-oss's harmony messages, shared by the `openai` tool parser and the
`openai_gptoss` reasoning parser. An assistant output reads

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...<|return|>

The first message's `<|start|>assistant` is the prompt's generation prompt, so output usually
opens at `<|channel|>`. The recipient (`to=...`) may also sit in the role part
(`<|start|>assistant to=functions.x<|channel|>commentary json<|message|>`). Text at a message
boundary that opens no header (special tokens stripped, or a plain-text model) is a bare
message, read as final-channel text so that it is never lost. The text must keep the special
tokens (detokenize with skip_special_tokens=False)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from specserve.entrypoints.openai.tool_parsers.text import partial_tag_len

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
SPECIAL = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
FINAL_HEADER = CHANNEL + "final" + MESSAGE

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_WORD = re.compile(r"[^\s<]+")


@dataclass(frozen=True)
class HarmonyHeader:
    channel: str | None
    recipient: str | None
    content_type: str | None

    @property
    def function_name(self) -> str | None:
        """The function a `to=functions.NAME` message calls (built-in tools such as
        `browser.search` or `python` are not functions)."""
        if self.recipient and self.recipient.startswith("functions."):
            return self.recipient[len("functions.") :] or None
        return None

    @property
    def is_final(self) -> bool:
        """Text for the user: the final channel, or a bare message."""
        return self.channel in ("final", None) and self.recipient is None


BARE = HarmonyHeader(None, None, None)


def parse_header(text: str) -> HarmonyHeader:
    """A message header: the text between the message start and `<|message|>`."""
    _, _, chan_part = text.partition(CHANNEL)
    words = _WORD.findall(_RECIPIENT.sub(" ", chan_part.replace(CONSTRAIN, " ")))
    recipient = _RECIPIENT.search(text)
    return HarmonyHeader(
        channel=words[0] if words else "",
        recipient=recipient.group(1) if recipient else None,
        content_type=words[1] if len(words) > 1 else None,
    )


@dataclass
class MessageStart:
    header: HarmonyHeader
    # Index in the whole output where the message's body begins.
    body_start: int


@dataclass
class MessageText:
    text: str


@dataclass
class MessageEnd:
    # False when the output ended inside the message (max_tokens).
    complete: bool


HarmonyEvent = MessageStart | MessageText | MessageEnd


class HarmonyStream:
    """Feeds text in order, yields message events for what is decided. Body text that may be the
    start of a special token is held back; an unfinished header at the end is dropped."""

    def __init__(self) -> None:
        self._buf = ""
        self._offset = 0  # index in the output of self._buf[0]
        self._state = "boundary"  # boundary | header | body

    def feed(self, text: str, final: bool) -> list[HarmonyEvent]:
        buf = self._buf + text
        events: list[HarmonyEvent] = []
        pos = 0
        while True:
            if self._state == "boundary":
                rest = buf[pos:]
                if rest.startswith(START):
                    pos += len(START)
                    self._state = "header"
                elif rest.startswith(CHANNEL):
                    self._state = "header"
                elif not rest or (
                    not final and (START.startswith(rest) or CHANNEL.startswith(rest))
                ):
                    break
                else:
                    self._state = "body"
                    events.append(MessageStart(BARE, self._offset + pos))
            elif self._state == "header":
                i = buf.find(MESSAGE, pos)
                if i < 0:
                    pos = len(buf) if final else pos
                    break
                header = parse_header(buf[pos:i])
                pos = i + len(MESSAGE)
                self._state = "body"
                events.append(MessageStart(header, self._offset + pos))
            else:
                pos, done = self._body(buf, pos, final, events)
                if not done:
                    break
        self._buf = buf[pos:]
        self._offset += pos
        return events

    def _body(
        self, buf: str, pos: int, final: bool, events: list[HarmonyEvent]
    ) -> tuple[int, bool]:
        """Scan a body from `pos`; returns the new position and whether the message ended."""
        # A header token also ends a message whose end token is missing.
        hits = [(buf.find(t, pos), t) for t in (*ENDS, START, CHANNEL)]
        hits = [(i, t) for i, t in hits if i >= 0]
        if hits:
            i, token = min(hits)
            if i > pos:
                events.append(MessageText(buf[pos:i]))
            complete = token in ENDS
            events.append(MessageEnd(complete))
            self._state = "boundary"
            return (i + len(token) if complete else i), True
        stop = len(buf) if final else len(buf) - partial_tag_len(buf[pos:], SPECIAL)
        if stop > pos:
            events.append(MessageText(buf[pos:stop]))
        if final:
            events.append(MessageEnd(False))
            self._state = "boundary"
        return stop, False
