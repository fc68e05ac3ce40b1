"""Tool-call parsers by vLLM's `--tool-call-parser` name."""

from __future__ import annotations

from types import MappingProxyType

from specserve.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from specserve.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from specserve.entrypoints.openai.tool_parsers.glm45 import Glm45ToolParser
from specserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from specserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from specserve.entrypoints.openai.tool_parsers.openai import OpenAIToolParser

_PARSERS: MappingProxyType[str, type[ToolParser]] = MappingProxyType(
    {
        "hermes": HermesToolParser,
        "llama3_json": Llama3JsonToolParser,
        "openai": OpenAIToolParser,
        "deepseek_v3": DeepSeekV3ToolParser,
        # vLLM's name for DeepSeek-V3.1's layout, which deepseek_v3 reads too.
        "deepseek_v31": DeepSeekV3ToolParser,
        "glm45": Glm45ToolParser,
    }
)
TOOL_PARSERS: tuple[str, ...] = tuple(_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r} (--tool-call-parser): one of {', '.join(TOOL_PARSERS)}"
        ) from None


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
]
