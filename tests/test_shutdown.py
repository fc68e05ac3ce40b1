"""`specserve serve --shutdown-timeout`: SIGTERM drains in-flight requests for at
most the timeout, then ends them with an error event and exits; a second signal exits at once.
A real `specserve serve` process on 127.0.0.1 and a stream far longer than any timeout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import make_checkpoint

# Long enough that the stream is still running when the process must be gone.
LONG = {"prompt": [5, 6, 7], "max_tokens": 8000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def long_ctx_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("shutdown") / "model")
    return make_checkpoint(
        path,
        "llama",
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=8192,
    )


class ServeProcess:
    def __init__(self, model: str, shutdown_timeout: float) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{port}"
        args = [sys.executable, "-m", "specserve.entrypoints.cli", "serve", model]
        args += ["--port", str(port), "--max-num-seqs", "2", "--uvicorn-log-level", "warning"]
        args += ["--shutdown-timeout", str(shutdown_timeout)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        self.events: list[str] = []
        self.first_token = threading.Event()
        self.reader = threading.Thread(target=self._stream, daemon=True)
        self.reader.start()
        assert self.first_token.wait(60), "the stream never started"

    def _stream(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=LONG, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first_token.set()
        except httpx.TransportError:
            self.events.append("<connection lost>")

    def signal(self, sig: int) -> float:
        self.proc.send_signal(sig)
        return time.monotonic()

    def wait_exit(self, timeout: float) -> float:
        self.proc.wait(timeout)
        return time.monotonic()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def serve(long_ctx_model: str) -> Iterator[Any]:
    started: list[ServeProcess] = []

    def start(shutdown_timeout: float) -> ServeProcess:
        started.append(ServeProcess(long_ctx_model, shutdown_timeout))
        return started[-1]

    yield start
    for p in started:
        p.kill()


def test_sigterm_drains_then_ends_stuck_stream(serve: Any) -> None:
    p = serve(2.0)
    t0 = p.signal(signal.SIGTERM)
    tokens_before = len(p.events)
    took = p.wait_exit(15) - t0
    p.reader.join(5)
    print(f"SIGTERM -> exit {took:.2f} s (--shutdown-timeout 2)")
    assert took < 2.0 + 2.5, f"exit took {took:.1f} s with --shutdown-timeout 2"
    assert took > 1.5, "the in-flight stream was not given its drain time"
    assert len(p.events) > tokens_before + 1, "the stream made no progress while draining"
    # The stream ends with an error event, then [DONE]: the client knows it was cut short.
    assert p.events[-1] == "[DONE]", p.events[-3:]
    err = json.loads(p.events[-2])["error"]
    assert "shutting down" in err["message"] and "2 s shutdown timeout" in err["message"]
    # The drain is the orderly end SIGTERM asks for (uvicorn alone re-raises it: 143).
    assert p.proc.returncode == 0, p.proc.returncode
    # The startup heap was frozen before serving (no gen-2 walks of it mid-stream).
    assert "startup objects frozen" in (p.proc.stderr.read() if p.proc.stderr else "")


def test_second_signal_exits_at_once(serve: Any) -> None:
    p = serve(60.0)
    p.signal(signal.SIGTERM)
    time.sleep(1.0)
    assert p.proc.poll() is None, "exited before the drain timeout"
    n = len(p.events)
    time.sleep(0.3)
    assert len(p.events) > n, "the stream stopped while draining"
    t0 = p.signal(signal.SIGINT)
    took = p.wait_exit(15) - t0
    print(f"second signal -> exit {took:.2f} s")
    assert took < 2.0, f"the second signal took {took:.1f} s to exit"
    # Abandoning the drain is not a clean exit: 128 + the signal's number, as a shell reports
    # a process the signal ended.
    assert p.proc.returncode == 128 + signal.SIGINT, p.proc.returncode
    assert "terminate called" not in (p.proc.stderr.read() if p.proc.stderr else "")
