"""The OpenAI-compatible HTTP server: `create_app(engine, ...)` -> FastAPI app.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, GET /openapi.json. Every failure is answered in OpenAI's error shape; nothing a
client sends can take the process or the engine loop down. Bodies over `max_request_bytes` are
refused (413) before they are parsed. `SpecServer` adds a drain deadline to uvicorn's shutdown.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from specserve.config import EngineConfig
from specserve.distributed import TensorParallelError
from specserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from specserve.entrypoints.openai.openapi import (
    ChatCompletionResponse,
    CompletionResponse,
    body_route,
    health_route,
    install_openapi,
    models_route,
)
from specserve.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIModel,
    parse,
)
from specserve.entrypoints.openai.reasoning import get_reasoning_parser
from specserve.entrypoints.openai.serving import OpenAIServing, Stream
from specserve.entrypoints.openai.tool_parsers import get_tool_parser
from specserve.metrics.prometheus import PrometheusMetrics

logger = logging.getLogger("specserve")

# The largest request body accepted: far above any prompt that fits a context window (128k
# tokens as JSON ids is ~1 MB), small enough that a body is never a memory problem.
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
DEFAULT_SHUTDOWN_TIMEOUT = 30.0


class SSEResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends, even if the client left
    before the first byte (when the body iterator never starts, its `finally` never runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def create_app(
    engine: AsyncLLMEngine,
    model_name: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """Build the app around `engine`; the engine thread starts and stops with the app.
    `tool_parser`: parses "auto" tool choices (`--enable-auto-tool-choice --tool-call-parser`);
    `reasoning_parser`: splits chat outputs' thinking off (`--reasoning-parser`)."""
    core = engine.engine
    name = model_name or core.config.served_model_name or core.config.model
    metrics = PrometheusMetrics(name, lambda: engine.snapshot, core.num_spec_tokens > 0)
    engine.observers.append(metrics)
    serving = OpenAIServing(
        engine,
        name,
        on_abort=metrics.count_aborted,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
    )
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    _add_error_handlers(app)
    install_openapi(app)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        if not hmac.compare_digest(_bearer_token(request).encode(), api_key.encode()):
            raise APIError("Incorrect API key provided.", status=401, code="invalid_api_key")

    async def serve(
        request: Request,
        model: type[OpenAIModel],
        handler: Callable[[Any], Awaitable[dict[str, Any] | Stream]],
    ) -> Response:
        check_auth(request)
        body = await _read_body(request, max_request_bytes)
        req = parse(model, body)
        result = await _until_disconnect(request, handler(req))
        if result is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if isinstance(result, Stream):
            return SSEResponse(result.chunks, result.abort)
        return JSONResponse(result)

    @app.post("/v1/completions", **body_route(CompletionRequest, CompletionResponse))
    async def completions(request: Request) -> Response:
        return await serve(request, CompletionRequest, serving.completions)

    @app.post("/v1/chat/completions", **body_route(ChatCompletionRequest, ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ChatCompletionRequest, serving.chat)

    @app.get("/v1/models", **models_route())
    async def models(request: Request) -> Response:
        check_auth(request)
        card = {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "specserve",
            "root": core.config.model,
            "parent": None,
            "max_model_len": core.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health", response_class=Response, responses=health_route())
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def build_app(
    config: EngineConfig,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    # Unknown parser names fail here, before the model loads.
    if tool_parser is not None:
        get_tool_parser(tool_parser)
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)
    engine = AsyncLLMEngine.from_config(config)
    return create_app(
        engine, config.served_model_name, api_key, max_request_bytes, tool_parser, reasoning_parser
    )


def _bearer_token(request: Request) -> str:
    """The token of the request's one `Authorization: Bearer TOKEN` header; "" if there is
    none, several, or another scheme. The scheme is case-insensitive (RFC 7235 2.1)."""
    values = request.headers.getlist("authorization")
    if len(values) != 1:
        return ""  # NOTE: two headers could mean two proxies disagreeing: refuse both
    scheme, _, token = values[0].strip().partition(" ")
    return token.lstrip(" ") if scheme.lower() == "bearer" else ""


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed `limit` bytes: from
    Content-Length before reading anything, else while it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        f"Request body is {size} bytes or more; this server accepts at most {limit} bytes "
        "(--max-request-bytes).",
        status=413,
        code="request_too_large",
    )


class SpecServer(uvicorn.Server):
    """uvicorn with a drain deadline. The first SIGTERM / SIGINT stops accepting connections
    and lets in-flight requests finish for up to `shutdown_timeout` seconds; then the engine
    ends the remaining ones (streams get an error event, others a 503) and the process exits.
    A second signal exits at once.

    Exit status: a drain (finished or cut at the deadline) is the orderly end the signal asked
    for, so the process exits 0; uvicorn would re-raise the signal once it returns (status
    143 for SIGTERM). A second signal abandons the drain: the process exits with 128 + its
    number (130 for SIGINT), as a shell reports a process the signal ended. Not by re-raising
    it as uvicorn does: what a re-raised signal does depends on the handler found in place
    (asyncio's own SIGINT handler, or SIG_IGN inherited from a parent), and one such run
    exited 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, shutdown_timeout: float):
        # Backstop: connections still open a second after the deadline are cancelled.
        config.timeout_graceful_shutdown = int(shutdown_timeout) + 1
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        # Set when the server exits because the engine can never run again.
        self.engine_failed = False
        # The signal that abandoned the drain (the second one), or None.
        self.abandoned_by: int | None = None

    async def on_tick(self, counter: int) -> bool:
        # A failed tensor-parallel rank ends the engine for good: its requests got their 503s
        # (the engine loop failed them); the server exits (status 1) instead of answering 503
        # until someone restarts it.
        if isinstance(self.engine.error, TensorParallelError) and not self.should_exit:
            logger.error("exiting: %s", self.engine.error)
            self.engine_failed = self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            super().handle_exit(sig, frame)
            self.force_exit = True
            self._captured_signals.clear()
            self.abandoned_by = sig
            return
        super().handle_exit(sig, frame)
        # Not re-raised after `serve` returns: the graceful shutdown exits 0.
        self._captured_signals.clear()
        logger.info(
            "%s: draining in-flight requests for up to %.1f s (send it again to exit now)",
            signal.Signals(sig).name,
            self.shutdown_timeout,
        )
        timer = threading.Timer(self.shutdown_timeout, self._end_in_flight)
        timer.daemon = True
        timer.start()

    def _end_in_flight(self) -> None:
        msg = (
            "the server is shutting down: the request did not finish within the "
            f"{self.shutdown_timeout:g} s shutdown timeout"
        )
        logger.warning("shutdown timeout reached: ending the requests still in flight")
        self.engine.end_all(EngineDeadError(msg))


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work` unless the client disconnects first; then cancel it (its `finally` aborts
    the engine requests, freeing their KV blocks) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        result = await task
    except (asyncio.CancelledError, Exception):
        return None
    if isinstance(result, Stream):  # it finished in the same instant: nobody will read it
        result.abort()
    return None


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(e.detail), status=e.status_code, code=e.status_code)
        # e.g. `Allow` on a 405
        return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(str(e)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request")
        err = APIError(f"internal error: {e!r}", status=500, type="server_error")
        return JSONResponse(err.body(), status_code=500)
