"""`openai_gptoss`: gpt-oss's harmony output. The `analysis` channel's text is the reasoning;
the content is the `final` channel's text (and bare text, see harmony.py), as vLLM returns it.
Messages to tools (`to=functions.x`) and commentary preambles are neither: the `openai` tool
parser reads the calls from the whole output itself. `thinking_in_prompt` has no meaning here:
channels, not the prompt, say what is reasoning."""

from __future__ import annotations

from specserve.entrypoints.openai.reasoning.base import ReasoningDelta, ReasoningParser
from specserve.entrypoints.openai.tool_parsers.harmony import (
    BARE,
    FINAL_HEADER,
    HarmonyHeader,
    HarmonyStream,
    MessageStart,
    MessageText,
)


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    end_marker = FINAL_HEADER

    def __init__(
        self, tokenizer: object | None = None, *, thinking_in_prompt: bool | None = None
    ) -> None:
        super().__init__(tokenizer, thinking_in_prompt=thinking_in_prompt)
        self._stream = HarmonyStream()
        self._header: HarmonyHeader = BARE

    def content_start(self, text: str) -> int | None:
        for event in HarmonyStream().feed(text, final=False):
            if isinstance(event, MessageStart) and event.header.is_final:
                return event.body_start
        return None

    def _parse(self, text: str, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        for event in self._stream.feed(text, final):
            if isinstance(event, MessageStart):
                self._header = event.header
            elif isinstance(event, MessageText):
                if self._header.is_final:
                    out.content += event.text
                elif self._header.channel == "analysis" and self._header.recipient is None:
                    out.reasoning += event.text
        return out
