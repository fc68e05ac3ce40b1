"""The OpenAI-compatible HTTP server: `create_app(engine, ...)` -> FastAPI app.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics. Every failure is answered in OpenAI's error shape; nothing a client sends can
take the process or the engine loop down.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncLLMEngine
from specserve.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIModel,
    parse,
)
from specserve.entrypoints.openai.serving import OpenAIServing, Stream
from specserve.metrics.prometheus import PrometheusMetrics

logger = logging.getLogger("specserve")


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
    engine: AsyncLLMEngine, model_name: str | None = None, api_key: str | None = None
) -> FastAPI:
    """Build the app around `engine`; the engine thread starts and stops with the app."""
    core = engine.engine
    name = model_name or core.config.served_model_name or core.config.model
    metrics = PrometheusMetrics(name, lambda: engine.snapshot, core.num_spec_tokens > 0)
    engine.observers.append(metrics)
    serving = OpenAIServing(engine, name)
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

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
            raise APIError("Incorrect API key provided.", status=401, code="invalid_api_key")

    async def serve(
        request: Request,
        model: type[OpenAIModel],
        handler: Callable[[Any], Awaitable[dict[str, Any] | Stream]],
    ) -> Response:
        check_auth(request)
        body = await request.body()
        req = parse(model, body)
        result = await _until_disconnect(request, handler(req))
        if result is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if isinstance(result, Stream):
            return SSEResponse(result.chunks, result.abort)
        return JSONResponse(result)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, CompletionRequest, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ChatCompletionRequest, serving.chat)

    @app.get("/v1/models")
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

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def build_app(config: EngineConfig, api_key: str | None = None) -> FastAPI:
    return create_app(AsyncLLMEngine.from_config(config), config.served_model_name, api_key)


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
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(str(e)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request")
        err = APIError(f"internal error: {e!r}", status=500, type="server_error")
        return JSONResponse(err.body(), status_code=500)
