"""Every command in README.md runs: shell blocks through bash, Python blocks through exec.

`make` lines are run by CI (.ci/run runs `make test` and `make demo`). $TARGET / $EAGLE3 point at
tiny checkpoints with a real tokenizer; the server block starts a real server on 127.0.0.1 that
the benchmark and the OpenAI-client blocks talk to.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from .conftest import make_checkpoint
from .spec_utils import write_eagle3
from .tok_utils import make_tokenizer

README = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")


def blocks(lang: str) -> list[str]:
    text = open(README).read()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[str]:
    joined = block.replace("\\\n", " ")
    return [c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("readme")
    target = make_checkpoint(str(root / "target"), "llama")
    tok = make_tokenizer(root)
    for name in os.listdir(tok):  # the tokenizer lives next to the weights, as in HF dirs
        shutil.copy(os.path.join(tok, name), target)
    data = root / "data.txt"
    data.write_text("def add(a, b):\n    return a + b\n" * 200)
    bin_dir = os.path.dirname(sys.executable)
    return {
        **os.environ,
        "TARGET": target,
        "EAGLE3": write_eagle3(str(root / "eagle3")),
        "PORT": str(free_port()),
        "RESULTS": str(root / "results"),
        "DATA": str(data),
        "OUT_DIR": str(root / "drafter"),
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
    }


def run(cmd: str, env: dict[str, str]) -> str:
    # README commands say `.venv/bin/specserve`: run the specserve of this interpreter instead.
    cmd = cmd.replace(".venv/bin/", "")
    p = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{cmd}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return p.stdout


def test_readme_commands(env: dict[str, str]) -> None:
    cmds = [c for b in blocks("bash") for c in commands(b) if not c.startswith("make ")]
    assert any(c.startswith(".venv/bin/specserve serve") for c in cmds)
    server = None
    try:
        for c in cmds:
            if c.endswith("&"):  # the server: background it and wait until it answers
                args = ["bash", "-c", "exec " + c[:-1].replace(".venv/bin/", "")]
                log = open(os.path.join(env["RESULTS"] + "-server.log"), "w")
                server = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
                _wait_healthy(env["PORT"], log.name)
                # The start-up log names the drafter and how to turn speculation off.
                started = open(log.name).read()
                assert "speculative decoding on: ngram" in started, started[-2000:]
                assert "turn it off with --speculative-config null" in started
                _run_python_client(env)
                continue
            out = run(c, env)
            if " generate " in f" {c} ":
                assert "--- completion ---" in out or "--- assistant ---" in out
            if "bench serve" in c:
                assert "Serving Benchmark Result" in out
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


def test_readme_python_offline(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline block runs as written, with the shell examples' variables set."""
    code = next(b for b in blocks("python") if "LLM(" in b)
    for name in ("TARGET", "EAGLE3"):
        monkeypatch.setenv(name, env[name])
    exec(code, {})


def test_llm_without_a_model_is_the_default_model() -> None:
    from specserve import LLM
    from specserve.data import default_model

    gguf, spec = default_model()
    llm = LLM(max_model_len=256)
    assert llm.config.served_model_name == os.path.basename(gguf)
    assert llm.config.spec is not None and llm.config.spec.model == spec["model"]
    assert "turn it off with --speculative-config null" in llm.config.describe()
    assert LLM(speculative_config=None, max_model_len=256).config.spec is None


def _wait_healthy(port: str, log: str) -> None:
    for _ in range(240):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the README's server did not come up:\n" + open(log).read()[-3000:])


def _run_python_client(env: dict[str, str]) -> None:
    code = next(b for b in blocks("python") if "OpenAI(" in b)
    saved = os.environ.get("PORT")
    os.environ["PORT"] = env["PORT"]
    try:
        exec(code, {})
    finally:
        if saved is None:
            del os.environ["PORT"]
        else:
            os.environ["PORT"] = saved
