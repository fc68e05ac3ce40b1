"""`StructuredOutputsParams`: what a request's output must match (vLLM's dataclass and names).

Exactly one constraint: `json` (a JSON schema, dict or string), `regex`, `choice` (a list of
strings), `grammar` (EBNF, as xgrammar and llama.cpp read it) or `json_object` (any JSON
object). Options: `disable_any_whitespace` (JSON without free whitespace between tokens) and
`disable_additional_properties` (no properties a schema does not name; xgrammar's strict mode
already forbids them, so it holds either way).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
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

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"StructuredOutputsParams.{name} {why}, got {getattr(self, name)!r}.")

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


def choice_as_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: an EBNF grammar matching exactly one of `choices` (as vLLM builds
    it for xgrammar), with quotes and backslashes escaped."""

    def lit(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    return "root ::= " + " | ".join(lit(c) for c in choices)
