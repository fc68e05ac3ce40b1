"""`openai`: gpt-oss's harmony function calls. A message addressed `to=functions.NAME` is a call,
its body the JSON arguments (kept as the model wrote them, stripped); it is complete at
`<|call|>` (or `<|end|>`). Content is the final channel's text only, as in vLLM: analysis is the
reasoning parser's, commentary preambles and built-in tool messages are dropped. A call cut
short or whose body is not a JSON object is not a call; its body is content.

The parser reads the whole output, analysis included (`reads_reasoning`): calls come after the
analysis in one stream, so the reasoning parser's content (the final text) would lack them."""

from __future__ import annotations

from specserve.entrypoints.openai.tool_parsers.base import (
    Segment,
    ToolCall,
    ToolParser,
    loads_or_none,
)
from specserve.entrypoints.openai.tool_parsers.harmony import (
    BARE,
    HarmonyHeader,
    HarmonyStream,
    MessageEnd,
    MessageStart,
    MessageText,
)


class OpenAIToolParser(ToolParser):
    name = "openai"
    reads_reasoning = True

    def __init__(self, tokenizer: object | None = None) -> None:
        super().__init__(tokenizer)
        self._stream = HarmonyStream()
        self._header: HarmonyHeader = BARE
        self._args = ""

    def _parse(self, buf: str, final: bool) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        for event in self._stream.feed(buf, final):
            name = self._header.function_name
            if isinstance(event, MessageStart):
                self._header, self._args = event.header, ""
            elif isinstance(event, MessageText):
                if name is not None:
                    self._args += event.text
                elif self._header.is_final:
                    segments.append(event.text)
            elif isinstance(event, MessageEnd) and name is not None:
                args = self._args.strip()
                valid = event.complete and isinstance(loads_or_none(args), dict)
                segments.append(ToolCall(name, args) if valid else self._args)
        return segments, len(buf)
