"""`specserve serve [MODEL_DIR] [engine flags] --host --port --api-key`."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
from typing import Any

from specserve.entrypoints.cli import add_engine_args, engine_kwargs
from specserve.entrypoints.openai.reasoning import REASONING_PARSERS
from specserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("specserve")


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible server",
        description="Serve a model over the OpenAI API (completions, chat, /metrics).",
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL_DIR",
        help="model directory (same as --model; default: the embedded model)",
    )
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("SPECSERVE_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1 routes (env SPECSERVE_API_KEY)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=16 << 20,
        help="refuse request bodies larger than this with a 413, before parsing (default 16 MiB)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds to let in-flight requests finish before ending them "
        "with an error; a second signal exits at once (default 30)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse tool calls out of chat outputs for tool_choice "auto" (needs '
        "--tool-call-parser); without it such requests are 400s",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_PARSERS,
        help="the model's tool-call format, as vLLM names it",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split chat outputs' thinking into message.reasoning (and reasoning_content); "
        "response_format and tool grammars start after the thinking",
    )
    p.add_argument("--uvicorn-log-level", default="info")
    p.set_defaults(func=cmd_serve)


def serve_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Engine arguments of `serve`: MODEL_DIR or --model, else the default model
    (SmolLM2-135M-Instruct) and its EAGLE-3 head (unless --speculative-config overrides it)."""
    kw = engine_kwargs(args)
    if args.model_tag is not None and kw.get("model") not in (None, args.model_tag):
        raise ValueError(f"MODEL_DIR {args.model_tag!r} and --model {kw['model']!r} disagree.")
    kw["model"] = args.model_tag or kw.get("model")
    if kw["model"] is None:
        try:
            from specserve.data import default_model
        except ImportError as e:
            raise ValueError(
                "no MODEL_DIR given and the default model is not available "
                f"(specserve.data: {e}); pass a model directory or .gguf file."
            ) from e
        kw["model"], spec = default_model()
        kw["speculative_config"] = kw.get("speculative_config") or spec
    return kw


def check_port_free(host: str, port: int) -> None:
    """Fail in a line, before minutes of model loading, when the port is taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve: {e}") from e
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As uvicorn binds: SO_REUSEADDR, so a port in TIME_WAIT does not count as busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ValueError(
                f"cannot listen on {host}:{port}: {e.strerror or e} (is another server running? "
                "pick another --port)."
            ) from e


def freeze_startup_heap() -> None:
    """Move every object alive now (model, tokenizer, engine, warm-up leftovers: the heap the
    server keeps to its end) out of the garbage collector's reach. A full collection walks
    every tracked object and stops the world while it does, on the thread that serves steps;
    frozen, the startup heap is no longer walked. vLLM and SGLang freeze theirs after start-up
    for these pauses. Frozen objects are still freed by reference counting; only cycles among
    them stay."""
    gc.collect()
    gc.freeze()
    logger.info("%d startup objects frozen out of the collector's walks", gc.get_freeze_count())


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from specserve.config import EngineConfig
    from specserve.entrypoints.openai.server import SpecServer, build_app

    if args.max_request_bytes < 1 or args.shutdown_timeout < 0:
        raise ValueError("--max-request-bytes must be >= 1 and --shutdown-timeout >= 0.")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME.")
    # As vLLM: the parser only parses "auto" choices when auto tool choice is on.
    tool_parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    config = EngineConfig(**serve_engine_kwargs(args))
    config.check_device_available()
    logger.info(config.describe())
    check_port_free(args.host, args.port)
    app = build_app(
        config,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        tool_parser=tool_parser,
        reasoning_parser=args.reasoning_parser,
    )
    freeze_startup_heap()
    uv = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    server = SpecServer(uv, app.state.engine, args.shutdown_timeout)
    server.run()
    if server.abandoned_by is not None:
        # The lifespan's engine shutdown was skipped: stop the engine thread here (it ends
        # after at most the step it is in), so that the interpreter does not exit under it.
        server.engine.shutdown(timeout=1.0)
        return 128 + server.abandoned_by
    return 1 if server.engine_failed else 0
