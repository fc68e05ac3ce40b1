"""/openapi.json for the OpenAI routes: request and response bodies, documented.

The routes read their bodies themselves (`protocol.parse`: strict JSON, OpenAI-shaped 400s), so
FastAPI sees no body parameter to document. Here the request models are attached to the routes
as `requestBody` references and the response shapes are declared as pydantic models, so clients
and fuzzers (schemathesis) see the API; nothing here changes how a body is parsed or validated.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from specserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class PromptTokensDetails(BaseModel):
    # Prompt tokens whose KV came from the prefix cache.
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[float]
    tokens: list[str]
    top_logprobs: list[dict[str, float]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: str
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: str
    content: str | None = None
    # With --reasoning-parser: the thinking (vLLM's current field and its earlier name).
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


# One server-sent event (Open API before 3.2: `schema` describes each event of a stream).
_SSE_EVENT = {
    "type": "object",
    "description": "`data` holds one JSON chunk (`choices` with a `delta` for chat, `text` for "
    "completions), or an `error` object if the request fails mid-stream; the last is [DONE].",
    "properties": {"data": {"type": "string"}},
    "required": ["data"],
}
_SSE = {"text/event-stream": {"schema": _SSE_EVENT}}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ErrorResponse, "description": "an OpenAI-shaped error"} for c in codes}


def body_route(request_model: type[BaseModel], response_model: type[BaseModel]) -> dict[str, Any]:
    """Keyword arguments for a POST route whose JSON body is `request_model` and whose answer is
    `response_model` (or, with `"stream": true`, server-sent events)."""
    return {
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": REF.format(model=request_model.__name__)}
                    }
                },
            }
        },
        "responses": {
            200: {"model": response_model, "content": _SSE, "description": "the completion"},
            **_errors(400, 401, 404, 413, 503),
        },
    }


def models_route() -> dict[str, Any]:
    return {
        "responses": {200: {"model": ModelList, "description": "the served model"}, **_errors(401)}
    }


def health_route() -> dict[str, Any]:
    return {
        200: {"description": "the engine loop is running", "content": None},
        503: {"description": "the engine loop has stopped", "content": None},
    }


_NON_EMPTY = {"string": {"minLength": 1}, "array": {"minItems": 1}}
_BIAS = {
    "object": {
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    }
}
_STOP = {"string": {"minLength": 1}, "array": {"items": {"type": "string", "minLength": 1}}}
_ONLY_WITH_STREAM = {"description": "only with `stream: true` (else a 400)"}

# What the handlers enforce beyond the pydantic field types (protocol.py's checks, the
# engine's), written into the schema so that clients and fuzzers see the same rules: per
# request model and field, keywords added to each member of the field's type union whose
# JSON type is the key ("*": to the property itself).
ENFORCED: dict[str, dict[str, dict[str, dict[str, Any]]]] = {
    "CompletionRequest": {
        "prompt": {
            "string": {"minLength": 1},
            "array": {"minItems": 1},
            "*": {"description": "a string, strings, token ids or lists of token ids; none "
                  "empty; at most 128 prompts x n"},
        },
        "max_tokens": {"*": {"description": "0 only with `echo` (the prompt is the answer); "
                             "at most the context length minus the prompt's tokens"}},
        "best_of": {"integer": {"minimum": 1, "maximum": 128},
                    "*": {"description": "must equal `n` (no server-side best-of)"}},
        "suffix": {"string": {"maxLength": 0}, "*": {"description": "not supported: empty"}},
        "echo": {"*": {"description": "not with `truncate_prompt_tokens`"}},
        "stop": _STOP,
        "logit_bias": _BIAS,
        "stream_options": {"*": _ONLY_WITH_STREAM},
        "stop_token_ids": {"array": {"items": {"type": "integer", "minimum": 0}}},
        "bad_words": {"array": {"items": {"type": "string", "pattern": "\\S"}}},
    },
    "ChatCompletionRequest": {
        "max_completion_tokens": {"*": {"description": "at most the context length minus "
                                        "the prompt's tokens (as `max_tokens`)"}},
        "top_logprobs": {"*": {"description": "needs `logprobs: true`"}},
        "stop": _STOP,
        "logit_bias": _BIAS,
        "stream_options": {"*": _ONLY_WITH_STREAM},
        "stop_token_ids": {"array": {"items": {"type": "integer", "minimum": 0}}},
        "bad_words": {"array": {"items": {"type": "string", "pattern": "\\S"}}},
        "prompt_logprobs": {"*": {"description": "not with `stream: true`"}},
        "tool_choice": {"*": {"description": "default \"auto\" with `tools`, else \"none\"; "
                              "needs `tools` (but \"none\"); \"auto\" needs the server's "
                              "--enable-auto-tool-choice; \"required\" and a named function "
                              "exclude response_format and structured_outputs"}},
    },
}  # fmt: skip


def _tighten(prop: dict[str, Any], rule: dict[str, dict[str, Any]]) -> None:
    members = prop.get("anyOf", [prop])
    for m in members:
        extra = rule.get(m.get("type", ""))
        if extra:
            m.update(extra)
        items = m.get("items", {})
        if m.get("type") == "array" and "minItems" in (extra or {}):
            # a list of prompts: none of them empty either
            items.update(_NON_EMPTY.get(items.get("type", ""), {}))
    prop.update(rule.get("*", {}))


def install_openapi(app: FastAPI) -> None:
    """Add the request models (and the models they use) to the app's schema components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                s = model.model_json_schema(ref_template=REF)
                comps.update(s.pop("$defs", {}))
                comps[model.__name__] = s
            for name, rules in ENFORCED.items():
                for field_name, rule in rules.items():
                    _tighten(comps[name]["properties"][field_name], rule)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
