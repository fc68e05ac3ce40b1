"""Reasoning parsers by vLLM's `--reasoning-parser` name."""

from __future__ import annotations

from types import MappingProxyType

from specserve.entrypoints.openai.reasoning.base import ReasoningDelta, ReasoningParser
from specserve.entrypoints.openai.reasoning.openai_gptoss import GptOssReasoningParser
from specserve.entrypoints.openai.reasoning.think import (
    DeepSeekR1ReasoningParser,
    Glm45ReasoningParser,
    Qwen3ReasoningParser,
    ThinkReasoningParser,
)

_PARSERS: MappingProxyType[str, type[ReasoningParser]] = MappingProxyType(
    {
        p.name: p
        for p in (
            Qwen3ReasoningParser,
            DeepSeekR1ReasoningParser,
            Glm45ReasoningParser,
            GptOssReasoningParser,
        )
    }
)
REASONING_PARSERS: tuple[str, ...] = tuple(_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r} (--reasoning-parser): one of {', '.join(REASONING_PARSERS)}"
        ) from None


__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ThinkReasoningParser",
    "get_reasoning_parser",
]
