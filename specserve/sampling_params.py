"""Per-request sampling parameters, validated at construction (vLLM's field names), and
`StructuredOutputsParams`: what a request's output must match (vLLM's dataclass and names, in
the same module as vLLM keeps it).

Exactly one constraint: `json` (a JSON schema, dict or string), `regex`, `choice` (a list of
strings), `grammar` (EBNF, as xgrammar and llama.cpp read it) or `json_object` (any JSON
object). Options: `disable_any_whitespace` (JSON without free whitespace between tokens) and
`disable_additional_properties` (no properties a schema does not name; xgrammar's strict mode
already forbids them, so it holds either way).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # The grammar starts after the output's first occurrence of this text (the server sets a
    # reasoning parser's end of thinking here): before it, and for the tokens forming it, any
    # token is allowed. None: from the first output token.
    start_after: str | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"StructuredOutputsParams.{name} {why}, got {getattr(self, name)!r}.")

        if self.start_after is not None and (
            not isinstance(self.start_after, str) or not self.start_after
        ):
            raise bad("start_after", "must be a non-empty string")

        set_ = [c for c in CONSTRAINTS if getattr(self, c) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {set_ or 'none'}."
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    raise bad("json", f"must be a JSON schema (dict or JSON text): {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, dict):
                raise bad("json", "must be a JSON schema object")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise bad("regex", "must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise bad("grammar", "must be a non-empty EBNF string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise bad("choice", "must be a non-empty list of non-empty strings")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise bad("json_object", "must be a boolean")

    @property
    def kind(self) -> str:
        """The one constraint that is set: json | regex | choice | grammar | json_object."""
        return next(c for c in CONSTRAINTS if getattr(self, c) not in (None, False))

    def json_schema_text(self) -> str:
        """The schema as JSON text (xgrammar's compile cache key). NOTE: keys keep their order:
        properties are generated in the order the schema declares them."""
        if self.json_object:
            return '{"type": "object"}'
        return self.json if isinstance(self.json, str) else _json.dumps(self.json)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of the prompt's tokens (the first is None) with the top-N: vLLM's field.
    prompt_logprobs: int | None = None
    # vLLM's penalties: repetition over prompt + output tokens (divides positive logits,
    # multiplies negative ones), presence and frequency over output tokens only.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # {token id: bias} added to the logits before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # vLLM's: sample only among these ids (every other token -inf).
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never to complete. Each is tokenized as written and with a leading space;
    # a one-token word is never sampled, a longer one's last token is refused right after the
    # rest of it in the output (engine/request.py bad_words_token_ids).
    bad_words: list[str] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as leave room for one output
    # token within max_model_len).
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (JSON schema, regex, choice, EBNF grammar), as vLLM's field.
    structured_outputs: StructuredOutputsParams | None = None
    _stop_list: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop)
        if not all(isinstance(t, str) and t for t in self._stop_list):
            # vLLM refuses empty ones too: an empty stop string would end every request at once.
            raise ValueError(
                "SamplingParams.stop must be a string or a list of non-empty strings, "
                f"got {self.stop!r}."
            )
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        # NOTE: `not t >= 0` also refuses NaN, which sampling would turn into garbage.
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise bad("temperature", "must be a number >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (off) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an integer >= 1")
        # NOTE: min_tokens rides in an int64 tensor of the penalty step: a larger one would
        # kill the engine loop for every request, not fail this one.
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= 2**63 - 1:
            raise bad("min_tokens", "must be an integer in [0, 2**63 - 1]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "must be <= max_tokens")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0")
        # The seed rides in an int64 tensor, and choice i of n samples with seed + i: a seed
        # outside that range would fail inside the engine's step, not here.
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed <= 2**63 - self.n
        ):
            raise bad("seed", "must be an integer in [-2**63, 2**63 - n]")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", "must be an integer >= 0")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 1e4:
            raise bad("repetition_penalty", "must be in (0, 1e4]")
        if self.logit_bias is not None:
            for tid, b in self.logit_bias.items():
                if not isinstance(tid, int) or tid < 0:
                    raise bad("logit_bias", "keys must be token ids >= 0")
                if not isinstance(b, (int, float)) or not -100 <= b <= 100:
                    raise bad("logit_bias", "values must be in [-100, 100]")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0
                for t in self.allowed_token_ids
            )
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids (>= 0)")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list)
            or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise bad("bad_words", "must be a list of non-blank strings")
        if self.truncate_prompt_tokens is not None and (
            isinstance(self.truncate_prompt_tokens, bool)
            or not isinstance(self.truncate_prompt_tokens, int)
            or not (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)
        ):
            raise bad("truncate_prompt_tokens", "must be -1 or an integer >= 1")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise bad("stop_token_ids", "must be token ids in the vocabulary (>= 0)")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def uses_logits_processors(self) -> bool:
        """Whether the target logits need `apply_logits_processors` for this request."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
