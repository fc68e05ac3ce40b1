"""Compiling a request's constraint with xgrammar, once per distinct constraint.

`StructuredOutputs` is the engine's one compiler. Its xgrammar objects (the tokenizer's
`TokenizerInfo`, the `GrammarCompiler`) are built at the first structured request, so engines
that never see one pay nothing. Compiled grammars are cached by xgrammar's compiler, keyed by
the constraint's text and options: 50 requests under one schema compile it once.

Where it runs: the server compiles on a worker thread of its own before a request reaches the
engine (AsyncLLMEngine), so a slow schema never stalls the running streams, and the engine only
builds the request's matcher. Offline `LLM` compiles inline, in `add_request`.
"""

from __future__ import annotations

import re
from typing import Any

from specserve.sampling_params import StructuredOutputsParams
from specserve.structured.matcher import DelayedStart, RequestGrammar


class StructuredOutputError(ValueError):
    """A constraint xgrammar cannot compile; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _clean(e: Exception) -> str:
    # xgrammar's C++ errors start with "[time] /path/file.cc:line: "; keep the message.
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e).strip())


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        # The model's vocabulary (lm_head rows), which may pad the tokenizer's: masks cover it.
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None

    @property
    def compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            if self.tokenizer is None:
                raise StructuredOutputError(
                    "structured outputs need the model's tokenizer; this model has none",
                    "structured_outputs",
                )
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids or None,
            )
            # NOTE: one thread: the server compiles on one worker thread beside the engine's.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The xgrammar `CompiledGrammar` of `params`' constraint (cached by xgrammar)."""
        c = self.compiler
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                return c.compile_json_schema(
                    params.json_schema_text(),
                    any_whitespace=not params.disable_any_whitespace,
                    strict_mode=True,
                )
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar(choice_as_ebnf(params.choice))
            return c.compile_grammar(params.grammar)
        except RuntimeError as e:
            what = {"json": "JSON schema", "json_object": "JSON schema", "grammar": "EBNF grammar"}
            raise StructuredOutputError(
                f"structured_outputs.{kind}: invalid {what.get(kind, kind)}: {_clean(e)}",
                "structured_outputs",
            ) from None

    def new_request(
        self, params: StructuredOutputsParams, compiled: Any | None = None
    ) -> RequestGrammar:
        """A fresh matcher for one request (its own parse state over the shared grammar);
        `compiled` is `compile(params)` made elsewhere (the server's grammar thread)."""
        import xgrammar as xgr

        grammar = compiled if compiled is not None else self.compile(params)
        start = None
        if params.start_after is not None:
            tok = self.tokenizer
            if tok is None:
                raise StructuredOutputError(
                    "a grammar that starts after a marker needs the model's tokenizer",
                    "structured_outputs",
                )
            # NOTE: special tokens kept: a marker may be made of them (harmony's channels).
            start = DelayedStart(
                params.start_after, lambda ids: tok.decode(ids, skip_special_tokens=False)
            )
        return RequestGrammar(xgr.GrammarMatcher(grammar), self.vocab_size, start)


def choice_as_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: an EBNF grammar matching exactly one of `choices` (as vLLM builds
    it for xgrammar), with quotes and backslashes escaped."""

    def lit(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    return "root ::= " + " | ".join(lit(c) for c in choices)
