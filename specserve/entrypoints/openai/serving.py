"""/v1/completions and /v1/chat/completions on top of AsyncLLMEngine.

One HTTP request becomes `len(prompts) * n` engine requests in one RequestGroup; choice index
`prompt_idx * n + i` (vLLM's order), and choice i of a seeded request uses seed + i, as
`LLM.generate` does, so server and offline outputs agree.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from specserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    PromptSource,
    RequestGroup,
)
from specserve.entrypoints.openai.chat_output import ChatOutputParser
from specserve.entrypoints.openai.chat_template import (
    template_kwargs,
    template_reads,
    template_variables,
    tool_conversation,
)
from specserve.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from specserve.entrypoints.openai.reasoning import get_reasoning_parser
from specserve.entrypoints.openai.tool_parsers import get_tool_parser
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

# JSON has no -inf: vLLM's stand-in for a logprob of an impossible token.
MIN_LOGPROB = -9999.0


@dataclass
class Stream:
    """A streaming answer: SSE lines, and how to abort its engine requests (the server calls
    it when the response ends, even if the client left before the first chunk)."""

    chunks: AsyncIterator[str]
    abort: Callable[[], None]


@dataclass
class _Choice:
    prompt_idx: int
    echo: str = ""  # the prompt text, for completions with `echo`
    prompt_token_ids: list[int] = field(default_factory=list)
    # SamplingParams.prompt_logprobs' result: per prompt token, None for the first
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    text: str = ""  # generated text
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False
    # Prompt tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        on_abort: Callable[[int], None] | None = None,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        """`tool_parser`: parses "auto" tool choices (`--tool-call-parser` with
        `--enable-auto-tool-choice`; None: "auto" with tools is a 400). `reasoning_parser`:
        splits the thinking off chat outputs (`--reasoning-parser`)."""
        self.engine = engine
        self.model_name = model_name
        self.tool_parser = get_tool_parser(tool_parser) if tool_parser else None
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        # Told how many engine requests ended unfinished (client gone, error): /metrics counts
        # them as finished_reason="abort".
        self.on_abort = on_abort
        self.tokenizer = engine.engine.tokenizer
        # Prompts are tokenized (and chat templates rendered) here, never on the engine thread:
        # a 4 MB prompt must not stall every running stream. One worker: the tokenizer's Rust
        # backend is not meant to be driven from several threads at once.
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-tokenizer")
        # What the model's chat template reads (request fields it does not read are 400s).
        self.template_variables = template_variables(self.tokenizer)
        self.template_reads = template_reads(self.tokenizer)

    async def _off_thread(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{model}` does not exist.",
                status=404,
                param="model",
                code="model_not_found",
            )

    def token_str(self, tid: int) -> str:
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else f"token_id:{tid}"

    # ---- entry points --------------------------------------------------------------------
    async def completions(self, req: CompletionRequest) -> dict[str, Any] | Stream:
        self.check_model(req.model)
        sp = req.to_sampling_params()
        texts = req.prompts()
        core = self.engine.engine
        vocab = core.hf_config["vocab_size"]

        def make() -> list[PromptSource]:
            out: list[PromptSource] = []
            for p in texts:
                text, ids = core.tokenize(p, sp.truncate_prompt_tokens is not None)
                if text is None and req.echo and core.tokenizer is not None:
                    # The echo of a token-id prompt is decoded here too, not on the event
                    # loop; ids outside the vocabulary are refused by add_request instead.
                    if all(0 <= t < vocab for t in ids):
                        text = core.tokenizer.decode(ids)
                out.append({"prompt": text, "prompt_token_ids": ids})
            return out

        try:
            prompts = await self._off_thread(make)
        except ValueError as e:  # no tokenizer for a text prompt
            raise APIError(str(e), param="prompt") from e
        if not req.echo_only:
            for p in prompts:
                self._check_max_tokens(req.max_tokens, len(p["prompt_token_ids"]), sp)
        return await self._run("cmpl", req, sp, prompts, _CompletionFormat(self, req))

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | Stream:
        self.check_model(req.model)
        choice = req.tool_choice_name()
        if choice == "auto" and req.tools and self.tool_parser is None:
            raise APIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        sp = req.to_sampling_params()
        conv, add_gen = req.conversation(), req.add_generation_prompt
        tok = self.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer, so chat is not available.")
        conv, tools = tool_conversation(conv, req.functions(), choice, self.template_reads)

        extra = template_kwargs(
            self.template_variables, req.reasoning_effort, req.chat_template_kwargs
        )
        core = self.engine.engine
        chars = sum(len(m["content"]) for m in conv)
        # Cheaper than rendering and tokenizing it; a request that truncates its prompt is
        # rendered whole (bounded by --max-request-bytes) and cut by add_request.
        if chars > core.max_prompt_chars and sp.truncate_prompt_tokens is None:
            raise APIError(
                f"This model's maximum context length is {core.max_model_len} tokens. However, "
                f"your messages have {chars} characters, more than that many tokens can hold.",
                param="messages",
            )

        def make() -> tuple[str, list[int]]:
            # As transformers' tokenize=True: the rendered text without added special tokens.
            text = tok.apply_chat_template(
                conv, tools=tools, add_generation_prompt=add_gen, tokenize=False, **extra
            )
            return text, tok.encode(text, add_special_tokens=False)

        try:
            text, ids = await self._off_thread(make)
        except Exception as e:  # a template that rejects the conversation: the input's fault
            raise APIError(f"chat template: {e}", param="messages") from e
        asked = req.max_completion_tokens or req.max_tokens
        self._check_max_tokens(asked, len(ids), sp)
        so = sp.structured_outputs
        if self.reasoning_parser is not None and so is not None:
            marker = self.reasoning_parser.end_marker
            if not text.rstrip().endswith(marker):
                # NOTE: no grammar on the thinking: it starts after the end marker (unless the
                # prompt closed the thinking already, as Qwen3's enable_thinking=False does).
                sp = replace(sp, structured_outputs=replace(so, start_after=marker))
        fmt = _ChatFormat(self, req, choice, text)
        return await self._run("chatcmpl", req, sp, [{"prompt_token_ids": ids}], fmt)

    def _check_max_tokens(self, asked: int | None, num_prompt: int, sp: SamplingParams) -> None:
        """vLLM's 400 for a `max_tokens` the context cannot hold after the prompt. A prompt
        that alone is too long is add_request's error (it names the prompt)."""
        m = self.engine.engine.max_model_len
        keep = sp.truncate_prompt_tokens
        if keep is not None:
            num_prompt = min(num_prompt, m - 1 if keep == -1 else keep)
        if asked is None or num_prompt >= m or asked <= m - num_prompt:
            return
        raise APIError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's "
            f"maximum context length is {m} tokens and your request has {num_prompt} input "
            f"tokens ({asked} > {m} - {num_prompt}).",
            param="max_tokens",
        )

    # ---- shared driver -------------------------------------------------------------------
    async def _run(
        self,
        prefix: str,
        req: SamplingRequest,
        sp: SamplingParams,
        prompts: list[PromptSource],
        fmt: _Format,
    ) -> dict[str, Any] | Stream:
        fmt.rid, fmt.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        children = []
        for p, prompt in enumerate(prompts):
            for i in range(req.n):
                child = sp if sp.seed is None or i == 0 else replace(sp, seed=sp.seed + i)
                children.append((f"{fmt.rid}-{p}-{i}", prompt, child))
        choices = [_Choice(p) for p in range(len(prompts)) for _ in range(req.n)]
        group = self.engine.new_group()
        aborted = False

        def abort() -> None:
            # Called when the response ends however it ends (twice for streams: the body's
            # `finally` and the response's close); counts what did not finish, once.
            nonlocal aborted
            if not aborted and self.on_abort is not None:
                self.on_abort(sum(c.finish_reason is None for c in choices))
            aborted = True
            group.abort()

        try:
            await group.add(children)
        except EngineDeadError as e:
            raise _dead(e) from e
        except Exception as e:  # PromptTooLongError, bad token ids
            # NOTE: adding a request only validates, so any failure is the input's.
            # (A constraint xgrammar cannot compile names its own field.)
            msg = str(e)
            # A field the engine refused names itself (RequestFieldError.param); the rest is
            # the prompt's.
            param = getattr(e, "param", None) or ("messages" if prefix == "chatcmpl" else "prompt")
            if param == "logprobs" and prefix == "chatcmpl":
                param = "top_logprobs"  # chat's logprobs is a flag; its count is top_logprobs
            raise APIError(msg, param=param) from e
        if req.stream:
            chunks = self._stream(
                group, choices, fmt, abort, req.include_usage, req.continuous_usage
            )
            return Stream(chunks, abort)
        prompt_lens: dict[int, int] = {}
        try:
            async for idx, out in group:
                self._apply(choices[idx], out, fmt, prompt_lens)
        except EngineDeadError as e:
            raise _dead(e) from e
        finally:
            abort()  # no-op unless the client went away (cancellation) mid-way
        return fmt.response(choices, _usage(prompt_lens, choices))

    async def _stream(
        self,
        group: RequestGroup,
        choices: list[_Choice],
        fmt: _Format,
        abort: Callable[[], None],
        include_usage: bool,
        continuous_usage: bool = False,
    ) -> AsyncIterator[str]:
        prompt_lens: dict[int, int] = {}
        try:
            async for idx, out in group:
                c = choices[idx]
                first = not c.started
                n_before = len(c.token_ids)
                delta = self._apply(c, out, fmt, prompt_lens)
                chunk = fmt.chunk(idx, c, delta, n_before, first)
                if continuous_usage:  # vLLM: this choice's usage so far
                    p = prompt_lens[c.prompt_idx]
                    n = len(c.token_ids)
                    chunk["usage"] = {"prompt_tokens": p, "completion_tokens": n,
                                      "total_tokens": p + n}  # fmt: skip
                yield _sse(chunk)
            if include_usage:
                yield _sse(fmt.usage_chunk(_usage(prompt_lens, choices)))
        except EngineDeadError as e:
            # Headers are sent already: the error travels as an event, then the stream ends.
            yield _sse(_dead(e).body())
        finally:
            abort()
        yield "data: [DONE]\n\n"

    def _apply(self, c: _Choice, out: RequestOutput, fmt: _Format, lens: dict[int, int]) -> str:
        """Add an engine output to its choice; returns the text it added."""
        lens[c.prompt_idx] = len(out.prompt_token_ids)
        if not c.started:
            c.started = True
            if fmt.echo:  # decoded with the prompt on the tokenizer thread
                c.echo = out.prompt or ""
            c.prompt_token_ids = list(out.prompt_token_ids)
            c.prompt_logprobs = out.prompt_logprobs
            c.prompt_logprob_ranks = out.prompt_logprob_ranks
            c.num_cached_tokens = out.num_cached_tokens
        if fmt.echo_only:
            # The one token sampled for the prefill's sake is not part of the answer.
            if out.finished:
                c.finish_reason, c.stop_reason = "length", None
            return ""
        c.text += out.delta_text
        c.token_ids += out.delta_token_ids
        if out.delta_logprobs:
            c.logprobs += out.delta_logprobs
        if out.finished:
            c.finish_reason = out.outputs[0].finish_reason
            c.stop_reason = out.outputs[0].stop_reason
        return out.delta_text


def _dead(e: Exception) -> APIError:
    return APIError(str(e), status=503, type="server_error")


def _usage(prompt_lens: dict[int, int], choices: list[_Choice]) -> dict[str, Any]:
    # Each prompt counts once, however many choices (n) it has.
    p = sum(prompt_lens.values())
    n = sum(len(c.token_ids) for c in choices)
    cached = sum({c.prompt_idx: c.num_cached_tokens for c in choices}.values())
    return {
        "prompt_tokens": p,
        "completion_tokens": n,
        "total_tokens": p + n,
        "prompt_tokens_details": {"cached_tokens": cached},  # OpenAI's field
    }


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _top(d: dict[int, float], n: int) -> list[tuple[int, float]]:
    # The engine returns the batch's largest top-N for every row: cut to this request's N.
    # (The sampled token sits in `d` too; it is in the top N only if it ranks there.)
    return sorted(d.items(), key=lambda x: -x[1])[:n]


def _lp(x: float) -> float:
    return max(x, MIN_LOGPROB)


def prompt_logprobs_json(
    c: _Choice, n_top: int, token_str: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id: {logprob,
    rank, decoded_token}} holding the prompt token and the top-N. As vLLM: the prompt token's
    rank is 1 + the tokens more likely, the top-N rank 1..N in order."""
    if c.prompt_logprobs is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    ranks = c.prompt_logprob_ranks or [None] * len(c.prompt_logprobs)
    for tid, d, rank in zip(c.prompt_token_ids, c.prompt_logprobs, ranks):
        if d is None:
            out.append(None)
            continue
        top = {t: (v, r) for r, (t, v) in enumerate(_top(d, n_top), start=1)}
        top[tid] = (d.get(tid, MIN_LOGPROB), rank)
        out.append(
            {
                str(t): {"logprob": _lp(v), "rank": r, "decoded_token": token_str(t)}
                for t, (v, r) in top.items()
            }
        )
    return out


class _Format:
    """Response and chunk shapes of one endpoint."""

    obj = ""
    chunk_obj = ""
    echo = False
    echo_only = False  # completions' echo with max_tokens 0

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.rid = ""
        self.created = 0

    def head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.serving.model_name,
        }

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self.head(self.chunk_obj), "choices": [], "usage": usage}

    def chunk(self, idx: int, c: _Choice, delta: str, n_before: int, first: bool) -> dict[str, Any]:
        """The chunk for one engine output: `delta` is its new text, `n_before` the choice's
        token count before it, `first` whether it is the choice's first chunk."""
        raise NotImplementedError

    def response(self, choices: list[_Choice], usage: dict[str, int]) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionFormat(_Format):
    obj = chunk_obj = "text_completion"

    def __init__(self, serving: OpenAIServing, req: CompletionRequest) -> None:
        super().__init__(serving)
        self.n_top = req.logprobs
        self.echo = req.echo
        self.echo_only = req.echo_only
        self.prompt_n_top = req.prompt_logprobs

    def logprobs(
        self, c: _Choice, start: int, offset: int, with_prompt: bool = False
    ) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs for tokens `start:` of `c`; `offset` is where the first
        one's text begins in the returned text. `with_prompt` (echo): the prompt tokens come
        first, as in vLLM: the first with null logprob and null top_logprobs."""
        if self.n_top is None:
            return None
        s = self.serving.token_str
        out: dict[str, list[Any]] = {
            "text_offset": [],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }
        if with_prompt:
            offset -= len(c.echo)
            for tid, d in zip(c.prompt_token_ids, c.prompt_logprobs or []):
                tok = s(tid)
                out["tokens"].append(tok)
                out["text_offset"].append(offset)
                offset += len(tok)
                if d is None:
                    out["token_logprobs"].append(None)
                    out["top_logprobs"].append(None)
                    continue
                top = {s(t): _lp(v) for t, v in _top(d, self.n_top)}
                top[tok] = _lp(d.get(tid, MIN_LOGPROB))
                out["token_logprobs"].append(top[tok])
                out["top_logprobs"].append(top)
            offset = len(c.echo)
        for tid, d in zip(c.token_ids[start:], c.logprobs[start:]):
            tok = s(tid)
            lp = d.get(tid, MIN_LOGPROB)
            # As in vLLM, a completion's top_logprobs hold the top N plus the sampled token.
            top = {s(t): _lp(v) for t, v in _top(d, self.n_top)}
            top[tok] = _lp(lp)
            out["tokens"].append(tok)
            out["token_logprobs"].append(_lp(lp))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(tok)
        return out

    def chunk(self, idx: int, c: _Choice, delta: str, n_before: int, first: bool) -> dict[str, Any]:
        choice = {
            "index": idx,
            "text": (c.echo if first else "") + delta,
            # The new tokens' text starts after the echo and the text streamed before.
            "logprobs": self.logprobs(
                c, n_before, len(c.echo) + len(c.text) - len(delta), with_prompt=first and self.echo
            ),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if first and self.prompt_n_top is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(
                c, self.prompt_n_top, self.serving.token_str
            )
        return {**self.head(self.chunk_obj), "choices": [choice]}

    def response(self, choices: list[_Choice], usage: dict[str, int]) -> dict[str, Any]:
        out = [
            {
                "index": i,
                "text": c.echo + c.text,
                "logprobs": self.logprobs(c, 0, len(c.echo), with_prompt=self.echo),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **self._prompt_part(c),
            }
            for i, c in enumerate(choices)
        ]
        return {**self.head(self.obj), "choices": out, "usage": usage}

    def _prompt_part(self, c: _Choice) -> dict[str, Any]:
        if self.prompt_n_top is None:
            return {}
        return {
            "prompt_logprobs": prompt_logprobs_json(c, self.prompt_n_top, self.serving.token_str)
        }


class _ChatFormat(_Format):
    obj, chunk_obj = "chat.completion", "chat.completion.chunk"

    def __init__(
        self, serving: OpenAIServing, req: ChatCompletionRequest, choice: str, prompt: str
    ) -> None:
        super().__init__(serving)
        self.n_top = (req.top_logprobs or 0) if req.logprobs else None
        self.prompt_n_top = req.prompt_logprobs
        self.req, self.choice, self.prompt = req, choice, prompt
        # Plain text (no parser has anything to do): content as generated.
        self.plain = (
            serving.reasoning_parser is None
            and choice in ("none", "auto")
            and (choice == "none" or not req.tools)
        )
        self._parsers: dict[int, ChatOutputParser] = {}

    def parser(self, idx: int) -> ChatOutputParser:
        """Choice `idx`'s parser (its own streaming state)."""
        p = self._parsers.get(idx)
        if p is None:
            s, choice = self.serving, self.choice
            reasoning = None
            if s.reasoning_parser is not None:
                opens = getattr(s.reasoning_parser, "prompt_opens_thinking", None)
                in_prompt = opens(self.prompt) if opens is not None else None
                reasoning = s.reasoning_parser(s.tokenizer, thinking_in_prompt=in_prompt or None)
            if choice == "none" or not self.req.tools:
                p = ChatOutputParser(reasoning, "text")
            elif choice == "auto":
                tool_parser = s.tool_parser(s.tokenizer) if s.tool_parser is not None else None
                p = ChatOutputParser(
                    reasoning,
                    "auto",
                    tool_parser,
                    parallel=self.req.parallel_tool_calls is not False,
                )
            else:
                named = None if choice == "required" else choice
                p = ChatOutputParser(
                    reasoning,
                    "forced",
                    named=named,
                    parallel=self.req.parallel_tool_calls is not False,
                )
            self._parsers[idx] = p
        return p

    def logprobs(self, c: _Choice, start: int) -> dict[str, Any] | None:
        if self.n_top is None:
            return None
        s = self.serving.token_str

        def entry(tid: int, lp: float) -> dict[str, Any]:
            tok = s(tid)
            return {"token": tok, "logprob": _lp(lp), "bytes": list(tok.encode("utf-8"))}

        content = []
        for tid, d in zip(c.token_ids[start:], c.logprobs[start:]):
            e = entry(tid, d.get(tid, MIN_LOGPROB))
            e["top_logprobs"] = [entry(t, v) for t, v in _top(d, self.n_top)]
            content.append(e)
        return {"content": content}

    def chunk(self, idx: int, c: _Choice, delta: str, n_before: int, first: bool) -> dict[str, Any]:
        # NOTE: the role rides on the first token's chunk, so a client's TTFT is the first
        # token's arrival, not an empty chunk sent before any work was done.
        msg: dict[str, Any] = {"role": "assistant"} if first else {}
        finish = c.finish_reason
        if self.plain:
            msg["content"] = delta
        else:
            p = self.parser(idx)
            msg.update(p.delta_json(p.feed(delta, final=finish is not None)))
            if p.called and finish == "stop":
                finish = "tool_calls"
        choice = {
            "index": idx,
            "delta": msg,
            "logprobs": self.logprobs(c, n_before),
            "finish_reason": finish,
            "stop_reason": c.stop_reason,
        }
        return {**self.head(self.chunk_obj), "choices": [choice]}

    def response(self, choices: list[_Choice], usage: dict[str, int]) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            msg: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = c.finish_reason
            if not self.plain:
                msg, finish = self.parser(i).message(c.text, finish)
            out.append(
                {
                    "index": i,
                    "message": msg,
                    "logprobs": self.logprobs(c, 0),
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                }
            )
        resp = {**self.head(self.obj), "choices": out, "usage": usage}
        if self.prompt_n_top is not None and choices:
            # vLLM: one list at the top level (every choice shares the prompt).
            n = self.prompt_n_top
            resp["prompt_logprobs"] = prompt_logprobs_json(choices[0], n, self.serving.token_str)
        return resp
