"""Mistakes a new user makes on the command line end in one `error: ...` line, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from .conftest import make_checkpoint


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "specserve.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("cli") / "m"), num_hidden_layers=1)


def test_config_json_not_json(tmp_path) -> None:
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    (d / "tokenizer_config.json").write_text("{}")
    _one_line_error(_run("generate", "--model", str(d)), "config.json", "not valid JSON")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable GPU")
def test_device_cuda_without_cuda(model: str) -> None:
    _one_line_error(_run("generate", "--model", model, "--device", "cuda"), "--device cpu")


@pytest.mark.parametrize("spec", ['["ngram"]', '"ngram"', "3"])
def test_speculative_config_not_an_object(model: str, spec: str) -> None:
    r = _run("generate", "--model", model, "--speculative-config", spec)
    _one_line_error(r, "speculative_config must be a JSON object")


def test_busy_port_fails_before_loading(tmp_path) -> None:
    # A model directory that cannot load: the error names the port, so it was checked first.
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run("serve", str(d), "--port", str(port), "--device", "cpu")
    _one_line_error(r, f"127.0.0.1:{port}", "--port")
