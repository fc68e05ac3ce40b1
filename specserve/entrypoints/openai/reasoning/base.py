"""The reasoning parser interface (vLLM's `--reasoning-parser`): a model's output split into its
reasoning (`reasoning_content`) and the content that follows, whole or streamed.

As for the tool parsers, both paths run one scanner (`ReasoningParser._parse`) and apply one
whitespace rule to each field: stripped at both ends, None when empty (`StrippedStream` for
the streamed form). An output that ends while still reasoning (max_tokens) is all reasoning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from specserve.entrypoints.openai.tool_parsers.text import StrippedStream, strip_or_none


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Base of the reasoning parsers; an instance holds one streamed output's state."""

    name: ClassVar[str]
    # The text that ends reasoning ("</think>"; harmony: the final channel's header).
    end_marker: ClassVar[str]

    def __init__(
        self, tokenizer: Any | None = None, *, thinking_in_prompt: bool | None = None
    ) -> None:
        """`thinking_in_prompt`: whether the prompt leaves the output inside the thinking (the
        chat template wrote the open tag); None takes the family's default."""
        self.tokenizer = tokenizer
        self.thinking_in_prompt = thinking_in_prompt
        self._reasoning = StrippedStream()
        self._content = StrippedStream()

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output (stateless: uses a fresh scanner)."""
        fresh = self._fresh()
        delta = fresh._parse(text, final=True)
        return strip_or_none(delta.reasoning), strip_or_none(delta.content)

    def extract_reasoning_streaming(self, delta_text: str) -> ReasoningDelta:
        return self._stripped(self._parse(delta_text, final=False))

    def finish_streaming(self) -> ReasoningDelta:
        delta = self._stripped(self._parse("", final=True))
        self._reasoning.finish()
        self._content.finish()
        return delta

    def is_reasoning_end(self, text: str) -> bool:
        """Whether `text` (the output so far) has left the reasoning."""
        return self.content_start(text) is not None

    def content_start(self, text: str) -> int | None:
        """Index in `text` (the output so far) where the content after the reasoning starts, None
        while still reasoning or undecided: where a response_format grammar takes over."""
        raise NotImplementedError

    def _parse(self, text: str, final: bool) -> ReasoningDelta:
        """Feed the next piece: the raw (unstripped) reasoning and content it decides. Unless
        `final`, hold back what the next piece could change (a partial tag)."""
        raise NotImplementedError

    def _fresh(self) -> ReasoningParser:
        return type(self)(self.tokenizer, thinking_in_prompt=self.thinking_in_prompt)

    def _stripped(self, delta: ReasoningDelta) -> ReasoningDelta:
        return ReasoningDelta(
            self._reasoning.push(delta.reasoning), self._content.push(delta.content)
        )
