"""`hermes`: Hermes-style calls, as Qwen2.5 and Qwen3 write them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, parallel calls one after another. Unlike vLLM, text after the calls is kept
as content (vLLM keeps only the text before the first call)."""

from __future__ import annotations

from specserve.entrypoints.openai.tool_parsers.base import ToolCall, arguments_json, loads_or_none
from specserve.entrypoints.openai.tool_parsers.tagged import TaggedToolParser


class HermesToolParser(TaggedToolParser):
    name = "hermes"
    call_start = "<tool_call>"
    call_end = "</tool_call>"

    def _parse_body(self, body: str) -> ToolCall | None:
        obj = loads_or_none(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        # NOTE: some fine-tunes write "parameters" (the Llama spelling) for "arguments".
        args = arguments_json(obj.get("arguments", obj.get("parameters", {})))
        return None if args is None else ToolCall(obj["name"], args)
