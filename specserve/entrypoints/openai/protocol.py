"""OpenAI request schemas (strict pydantic) and their mapping onto SamplingParams.

Validation is strict (JSON types as sent: `"temperature": "1"` or `"max_tokens": true` are 400s)
and rejects NaN/Infinity, so nothing the engine thread cannot handle gets past this file: a bad
value there would kill the engine loop for every client, not fail one request.

No field is accepted and then ignored: a field this file does not declare is a 400 that names
it (`functions`, `function_call` (the deprecated forms of `tools`), `audio`,
`modalities`, `prediction`, `web_search_options`, `logit_bias` keys that are
not token ids, vLLM's `guided_*`, `priority`, `lora_request`, ...). The declared fields that
do not change what is generated, and so are accepted without an effect:
  - `user`: an end-user id for the provider's abuse monitoring (OpenAI);
  - `service_tier`: the provider's processing tier; specserve has one;
  - `store`, `metadata`: whether / with which tags the provider keeps the completion for its
    dashboards and distillation; specserve keeps nothing.
`response_format` (json_object, json_schema) and vLLM's `structured_outputs` map onto
`StructuredOutputsParams`, enforced by the grammar step of verification and sampling.
`tools`, `tool_choice` and `parallel_tool_calls` (chat) are tools.py's: "required" and a named
function become the grammar of a JSON schema, "auto" needs the server's tool parser.
`reasoning_effort` (chat) goes to the model's chat template (gpt-oss's harmony template writes it
into its system turn), and so do vLLM's `chat_template_kwargs`; one the template does not read
is a 400 (chat_template.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specserve.entrypoints.openai.tools import parameters_schema, required_calls_schema
from specserve.sampling_params import SamplingParams, StructuredOutputsParams

# Bounds that keep values inside the engine's int64 per-row tensors. How many logprobs a
# request may ask for is the engine's `max_logprobs` (--max-logprobs, 20 by default, as vLLM):
# checked when the request is added, a 400 naming the field.
INT64_MAX = 2**63 - 1
MAX_N = 128

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# Bound of OpenAI's logit_bias values.
MAX_LOGIT_BIAS = 100.0


class OpenAIModel(BaseModel):
    # NOTE: unknown fields are 400s naming the field (see the module docstring for the
    # harmless ones declared instead), never silently ignored.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far (a chunk may hold several tokens
    # under speculation; `bench serve` counts tokens with it).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str
    description: str | None = None
    # `schema` in the wire format (a pydantic BaseModel attribute name, hence the alias).
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # xgrammar always enforces the schema strictly, which satisfies both values.
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs` request field (StructuredOutputsParams' fields)."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    # The engine keeps temperatures in float32: bound them well inside its range.
    temperature: float | None = Field(None, ge=0, le=1e4)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31)
    min_p: float | None = Field(None, ge=0, le=1)
    # Choice i samples with seed + i: keep every one of them an int64.
    seed: int | None = Field(None, ge=-(2**63), le=INT64_MAX - MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=1e4)
    # OpenAI: token id (as a JSON object key, so a string) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions: sample only among these ids; words never to complete.
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    # vLLM's extension: keep only the prompt's last k tokens (-1: all that leave room for one
    # output token).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's extension: logprobs of the prompt tokens (the first is null) with the top-N.
    prompt_logprobs: int | None = Field(None, ge=0)
    # Structured outputs, enforced by the grammar step (see structured_outputs_params).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # Harmless: no effect on what is generated (see the module docstring).
    user: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """`response_format` (json_object, json_schema) or `structured_outputs`, as vLLM maps
        them; None for plain text."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise APIError(
                "set either response_format or structured_outputs, not both.",
                param="structured_outputs",
            )
        try:
            if so is not None:
                return StructuredOutputsParams(
                    json=so.json_,
                    regex=so.regex,
                    choice=so.choice,
                    grammar=so.grammar,
                    json_object=so.json_object,
                    disable_any_whitespace=so.disable_any_whitespace,
                    disable_additional_properties=so.disable_additional_properties,
                )
            if rf is None or rf.type == "text":
                return None
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(
                    "response_format of type json_schema needs json_schema.schema.",
                    param="response_format",
                )
            return StructuredOutputsParams(json=rf.json_schema.schema_)
        except ValueError as e:
            param = "structured_outputs" if so is not None else "response_format"
            raise APIError(str(e), param=param) from e

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, v in self.logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                tid = -1
            if tid < 0 or tid > INT64_MAX:
                raise APIError(
                    f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias"
                )
            if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                raise APIError(
                    f"logit_bias values must be in [-100, 100], got {v} for {key}.",
                    param="logit_bias",
                )
            out[tid] = float(v)
        return out

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise APIError("stop strings must not be empty.", param="stop")
        try:
            return SamplingParams(
                n=1,  # the server fans `n` out into n engine requests
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=stops,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if self.repetition_penalty is None else self.repetition_penalty
                ),
                logit_bias=self._logit_bias(),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                structured_outputs=self.structured_outputs_params(),
            )
        except ValueError as e:
            raise APIError(str(e), param=_param_from_message(str(e))) from e

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            # As vLLM and OpenAI: options for a stream that does not exist are a mistake.
            raise APIError(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # 0 only with `echo`: the prompt (and its logprobs) without a completion, as OpenAI's legacy
    # API answers it (lm-eval-harness scores prompts this way).
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if not out or any(len(x) == 0 for x in out):
            raise APIError("prompt must not be empty.", param="prompt")
        if len(out) * self.n > MAX_N:
            raise APIError(f"at most {MAX_N} prompts x n per request.", param="prompt")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of other than n is not supported.", param="best_of")
        if self.suffix:
            raise APIError("suffix is not supported.", param="suffix")
        if self.echo and self.truncate_prompt_tokens is not None:
            # The echo would be the whole prompt's text beside the truncated prompt's logprobs.
            raise APIError(
                "echo with truncate_prompt_tokens is not supported.", param="truncate_prompt_tokens"
            )
        return out

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the answer is the prompt alone."""
        return self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        self.check_stream_options()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                "max_tokens 0 needs echo (the prompt is the answer).", param="max_tokens"
            )
        # As vLLM: `echo` with `logprobs` returns the prompt tokens' logprobs too.
        prompt_lp = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_lp = max(prompt_lp or 0, self.logprobs)
        # NOTE: an echo-only request still runs the prefill (the prompt logprobs come from it);
        # its one sampled token is dropped by the server.
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, prompt_lp)


class TextPart(OpenAIModel):
    type: str
    text: str | None = None


class FunctionDefinition(OpenAIModel):
    # OpenAI's rule for function names.
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    # A JSON Schema object; none: the function takes no arguments.
    parameters: dict[str, Any] | None = None
    # xgrammar always enforces a forced call's schema strictly, which satisfies both values.
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ToolCallIn(OpenAIModel):
    """A call of an earlier assistant turn, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIModel):
    # Any role: the model's chat template decides which it renders (and refuses the rest).
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    # assistant turns: the calls it made; tool turns: the call they answer
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # An assistant turn as this server returned it (clients send the message back as is):
    # its reasoning reaches templates that read `reasoning_content` (Qwen3's).
    reasoning: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None

    def text(self) -> str:
        c = self.content
        if isinstance(c, list):
            if any(p.type != "text" or p.text is None for p in c):
                raise APIError("only text content parts are supported.", param="messages")
            c = "".join(p.text or "" for p in c)
        return c or ""

    def to_template(self) -> dict[str, Any]:
        """The message as transformers passes it to a chat template; an assistant's call
        arguments decoded into objects, as vLLM hands them to templates (`| tojson`)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":
                raise APIError("only assistant messages carry tool_calls.", param="messages")
            out["tool_calls"] = [
                {"id": t.id, "type": "function",
                 "function": {"name": t.function.name, "arguments": _json_or_text(t.function)}}
                for t in self.tool_calls
            ]  # fmt: skip
        if self.role == "tool":
            if self.tool_call_id is None:
                raise APIError("a tool message needs tool_call_id.", param="messages")
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content or self.reasoning
        if reasoning and self.role == "assistant":
            out["reasoning_content"] = reasoning
        return out


def _json_or_text(f: ToolCallFunction) -> Any:
    try:
        return json.loads(f.arguments)
    except ValueError:
        raise APIError(
            f"tool_calls: the arguments of {f.name!r} are not JSON.", param="messages"
        ) from None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    # Passed to the chat template (gpt-oss's harmony template writes it into its system turn);
    # a 400 where the model's template does not read it. The harmony format's three levels.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's extension: more variables for the chat template (`enable_thinking`,
    # `model_identity`, ...); a 400 naming any the model's template does not read.
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (tools.py). Defaults as OpenAI's: "auto" with tools, else "none".
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_choice_name(self) -> str:
        """ "none", "auto", "required" or the forced function's name; checked against
        `tools`."""
        tc = self.tool_choice
        if tc is None:
            return "auto" if self.tools else "none"
        if not self.tools and tc != "none":
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if isinstance(tc, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if tc.function.name not in names:
                raise APIError(
                    f"Tool '{tc.function.name}' has not been passed in `tools` ({names}).",
                    param="tool_choice",
                )
            return tc.function.name
        return tc

    def functions(self) -> list[dict[str, Any]]:
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """A forced tool choice's grammar (tools.py), else the request's own constraint."""
        choice = self.tool_choice_name()
        if choice in ("none", "auto"):
            return super().structured_outputs_params()
        rf = self.response_format
        if self.structured_outputs is not None or (rf is not None and rf.type != "text"):
            raise APIError(
                f"tool_choice {choice!r} forces the output's form: set no response_format or "
                "structured_outputs with it.",
                param="tool_choice",
            )
        fns = self.functions()
        if choice == "required":
            schema = required_calls_schema(fns, self.parallel_tool_calls is not False)
        else:
            schema = parameters_schema(next(f for f in fns if f["name"] == choice))
        try:
            # NOTE: compact JSON: free whitespace between tokens lets a small model wander
            # into whitespace until max_tokens, and a call cut short is no call.
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        except ValueError as e:
            raise APIError(str(e), param="tools") from e

    def to_sampling_params(self) -> SamplingParams:
        self.check_stream_options()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs set to true.", param="top_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            # vLLM's chat returns them in the full response only; never accept-and-drop.
            raise APIError(
                "prompt_logprobs is not available with stream=true on chat completions.",
                param="prompt_logprobs",
            )
        n_top = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        return self.sampling_params(max_tokens, n_top, self.prompt_logprobs)

    def conversation(self) -> list[dict[str, Any]]:
        return [m.to_template() for m in self.messages]


def parse(model: type[OpenAIModel], body: bytes) -> Any:
    """Validate a raw JSON body; every failure (bad JSON, types, ranges) is a 400 APIError."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors()
        if errors[0]["type"] == "json_invalid":
            raise APIError(f"Request body is not valid JSON: {errors[0]['msg']}") from None
        # A value that matched a union member's type but broke its bounds (a negative token id
        # in a list of ids) says more than "Input should be a valid string" from the str member.
        err = next((x for x in errors if not x["type"].endswith("_type")), errors[0])
        loc = [str(x) for x in err["loc"] if not _is_union_tag(x)]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        if err["type"] == "extra_forbidden":
            raise APIError(
                f"Unsupported field {where!r}: specserve does not implement it.", param=param
            ) from None
        got = f" (got {err['input']!r})" if isinstance(err.get("input"), (int, float)) else ""
        raise APIError(f"{where}: {err['msg']}{got}", param=param) from None


def _is_union_tag(loc: Any) -> bool:
    # pydantic names the union member an error came from in its location: "list[str]", "str".
    return isinstance(loc, str) and ("[" in loc or loc in ("str", "int", "float", "bool"))


def _param_from_message(msg: str) -> str | None:
    # SamplingParams errors read "SamplingParams.<name> must ...".
    if msg.startswith("SamplingParams."):
        return msg.split(".", 1)[1].split(" ", 1)[0]
    return None
