"""Incremental detokenization with stop-string handling, for streaming.

Decoding the whole output again every step costs O(n) per token; instead, as vLLM does, we keep
two offsets into the token ids and decode only a short window each time:

    ids:  ... | prefix_offset ... read_offset | ... newest ids
                 (already emitted; context)     (not yet emitted)

`decode(ids[prefix:])[len(decode(ids[prefix:read])):]` is the text the new ids add. The context
window is decoded too because many decoders (SentencePiece's leading "▁", byte-level BPE's
multi-byte characters) give a token's text only relative to its neighbours. When the window's
text ends in U+FFFD the last ids are an incomplete UTF-8 sequence: the offsets stay put and the
window grows until the character completes.

On top of that text, stop strings are searched for, and streamed deltas hold back any tail that
could still become the start of a stop string, so a stop string never leaks into a stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How many prompt ids serve as left context for the first generated token (as in vLLM).
INITIAL_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"


def check_stop_strings(
    text: str, new_char_count: int, stop: Sequence[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that ends in the last `new_char_count` chars of `text`.

    Returns (stop string, length to truncate `text` to), or None. Among several matches the one
    that ends first wins (it is what char-by-char streaming would have seen first), then the one
    that starts first; so the result does not depend on how the text was split into chunks.
    """
    old_len = len(text) - new_char_count
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        # A match found now must end inside the new text, else an earlier call had found it.
        idx = text.find(s, max(0, old_len - len(s) + 1))
        if idx < 0:
            continue
        cand = (idx + len(s), idx, s)
        if best is None or cand[:2] < best[:2]:
            best = cand
    if best is None:
        return None
    end, start, s = best
    return s, (end if include_stop_str_in_output else start)


def partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _make_decode(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> Callable[[list[int]], str]:
    """A `decode(ids) -> str` equal to `tokenizer.decode` but without space cleanup.

    Cleanup (" ." -> ".") looks at neighbouring text, so it cannot be applied window by window.
    For a stock fast tokenizer we call the Rust backend directly: it is what `decode` does
    anyway, minus several microseconds of Python overhead per call.
    """
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend_tokenizer", None)
    stock = getattr(type(tokenizer), "_decode", None) is getattr(
        PreTrainedTokenizerFast, "_decode", None
    )
    if backend is not None and stock:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Turns generated token ids into text, a few ids at a time, and detects stop strings.

    Usage per engine step: `stop = update(new_ids)`; when the request ends, `flush()`; then
    `get_delta()` for the text to stream. `output_text` is the text so far (after a stop string
    matched: truncated before it, or through it with `include_stop_str_in_output`).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        if isinstance(stop, str):  # a lone string is one stop string, not a list of chars
            stop = [stop]
        # An empty stop string would match everywhere; it means nothing.
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # A stop string counts only once it ends at or after the min_tokens-th output token.
        self.min_tokens = min_tokens
        self.num_ids = 0  # generated ids fed so far (up to the stop point once one matched)
        # Of the ids given to the last `update`, how many it used: all of them, or those up to
        # and including the one that completed a stop string (the rest are dropped).
        self.num_ids_used = 0
        self.output_text = ""
        self.stop_reason: str | None = None  # the stop string that ended the text, if any
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        self._finished = False
        self._sent = 0  # chars of output_text already handed out by get_delta
        self._ids: list[int] = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    @property
    def finished(self) -> bool:
        """True once a stop string matched or `flush` ran: the text can no longer change."""
        return self._finished

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The last few prompt ids, used as left context for decoding the first outputs."""
        ctx = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        # A prompt ending inside a UTF-8 character would let the first outputs complete it,
        # and the context text would not be a prefix of the window text: decode without it.
        if ctx and self._decode(ctx).endswith(REPLACEMENT_CHAR):
            return []
        return ctx

    # ---- feeding tokens -----------------------------------------------------------------
    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated ids; return the stop string if one now appears in the text.

        Ids are decoded one by one (each a small window decode) so that stop strings are
        found at the same token whatever the grouping (speculative decoding emits several
        per step). Ids after a matched stop string, or after `flush`, are ignored.
        """
        self.num_ids_used = 0
        if self._finished:
            return None
        for tid in new_token_ids:
            self._ids.append(tid)
            self.num_ids += 1
            self.num_ids_used += 1
            text = self._advance()
            if text and self._append(text, self.num_ids >= self.min_tokens):
                return self.stop_reason
        return None

    def _advance(self) -> str:
        """Text that the newest id completes, or "" while it ends an incomplete character."""
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        # Nothing new (e.g. a skipped special token), or a partial UTF-8 sequence: wait.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self._trim()
        return new_text[len(prefix_text) :]

    def _trim(self) -> None:
        """Forget ids left of the window: only the window is ever decoded again."""
        if self._prefix_offset >= 256:  # amortised: one O(n) delete per 256 ids
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _append(self, text: str, check_stop: bool = True) -> bool:
        """Add decoded text; on a stop string, truncate, finish and return True. Before
        min_tokens (`check_stop` False) the text is only added: a stop string ending in it is
        never matched later (vLLM's rule)."""
        self.output_text += text
        if not self.stop or not check_stop:
            return False
        match = check_stop_strings(
            self.output_text, len(text), self.stop, self.include_stop_str_in_output
        )
        if match is None:
            return False
        self.stop_reason, cut = match
        self.output_text = self.output_text[:cut]
        self._finished = True
        return True

    def flush(self) -> str | None:
        """The request ended: decode held-back ids (an incomplete character decodes as U+FFFD).

        Afterwards `get_delta` also releases text held back as a possible stop-string start.
        Returns a stop string if the flushed text completed one (rare), else None.
        """
        if self._finished:
            return None
        found = None
        if self._read_offset < len(self._ids):
            ids = self._ids
            prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
            text = self._decode(ids[self._prefix_offset :])[len(prefix_text) :]
            self._prefix_offset = self._read_offset = len(ids)
            if text and self._append(text, self.num_ids >= self.min_tokens):
                found = self.stop_reason
        self._finished = True
        return found

    # ---- streaming ----------------------------------------------------------------------
    def get_delta(self) -> str:
        """Text added since the last call that can no longer change.

        Until the request finishes, a tail that may be the start of a stop string is held back
        (when the stop string would be cut from the output; when it is kept, showing it early
        is harmless).
        """
        end = len(self.output_text)
        if not self._finished and not self.include_stop_str_in_output:
            end -= partial_stop_len(self.output_text, self.stop)
        if end <= self._sent:
            return ""
        delta = self.output_text[self._sent : end]
        self._sent = end
        return delta


__all__ = [
    "IncrementalDetokenizer",
    "check_stop_strings",
    "partial_stop_len",
]
