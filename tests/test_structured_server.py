"""Structured outputs through the real server and the `openai` client, with EAGLE-3 on the
embedded model: response_format json_schema / json_object and structured_outputs choice on both
endpoints equal the offline engine's output; bad constraints are 400s naming the field."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from specserve import LLM, SamplingParams, StructuredOutputsParams
from specserve.config import EngineConfig
from specserve.data import load_prompts

from .test_server import LiveServer
from .test_structured import CHOICES, FAMILY, SCHEMA

MAX_MODEL_LEN = 512
ENGINE_THREAD = "specserve-engine"


class _CompileRecorder:
    """Wraps the server's grammar compiler: records each call's thread and time span, and
    sleeps `delay` seconds inside it (a schema that is slow to compile)."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.delay = 0.0
        self.calls: list[tuple[str, float, float]] = []  # (thread name, start, end)

    def __call__(self, *args: Any) -> Any:
        t0 = time.monotonic()
        time.sleep(self.delay)
        try:
            return self.inner(*args)
        finally:
            self.calls.append((threading.current_thread().name, t0, time.monotonic()))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def family() -> tuple[str, dict[str, Any]]:
    return FAMILY()


@pytest.fixture(scope="module")
def server(family: tuple[str, dict[str, Any]]) -> Iterator[LiveServer]:
    target, eagle3 = family
    cfg = EngineConfig(
        model=target, speculative_config=eagle3, max_model_len=MAX_MODEL_LEN, max_num_seqs=8
    )
    s = LiveServer(cfg)
    structured = s.engine.engine.structured
    # Before any request: every compile of this module is recorded.
    structured.compile = _CompileRecorder(structured.compile)  # type: ignore[method-assign]
    yield s
    s.close()


@pytest.fixture(scope="module")
def llm(family: tuple[str, dict[str, Any]]) -> LLM:
    target, eagle3 = family
    return LLM(target, speculative_config=eagle3, max_model_len=MAX_MODEL_LEN)


def test_json_schema_response_format(server: LiveServer, llm: LLM) -> None:
    c = server.client()
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    sp = SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    stopped = 0
    for p in load_prompts("chat", 3):
        msgs = [{"role": "user", "content": p["prompt"]}]
        ref = llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0]
        r = c.chat.completions.create(
            model=server.model, messages=msgs, max_tokens=64, temperature=0, response_format=rf
        )  # type: ignore[arg-type]
        text = r.choices[0].message.content
        assert text == ref.text and r.choices[0].finish_reason == ref.finish_reason
        if ref.finish_reason == "stop":  # free JSON whitespace may run to max_tokens
            jsonschema.validate(json.loads(text), SCHEMA)
            stopped += 1
        else:
            assert text.startswith("{")
    assert stopped >= 1

    # /v1/completions takes response_format too (vLLM's extension); compact JSON stops.
    prompt = load_prompts("code", 1)[0]["prompt"]
    body = {
        "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True},
        "seed": 5,
    }
    r2 = c.completions.create(
        model=server.model, prompt=prompt, max_tokens=64, temperature=0.8, extra_body=body
    )
    assert r2.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r2.choices[0].text), SCHEMA)
    r3 = c.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    t3 = r3.choices[0].text
    assert t3.lstrip().startswith("{")
    if r3.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(t3), dict)


def test_choice(server: LiveServer, llm: LLM) -> None:
    c = server.client()
    so = {"structured_outputs": {"choice": CHOICES}}
    prompts = [r["prompt"] for r in load_prompts("code", 4)]
    sp = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=CHOICES)
    )
    refs = llm.generate(prompts, sp, use_tqdm=False)
    for p, ref in zip(prompts, refs):
        r = c.completions.create(
            model=server.model, prompt=p, max_tokens=8, temperature=0, extra_body=so
        )
        assert r.choices[0].text == ref.outputs[0].text and r.choices[0].text in CHOICES
        assert r.choices[0].finish_reason == "stop"
    # Sampled, n = 6, chat, streamed: every choice is one of the list.
    msgs = [{"role": "user", "content": "Is the sky blue?"}]
    chunks = c.chat.completions.create(
        model=server.model, messages=msgs, max_tokens=8, temperature=0.8, n=6, seed=1,
        stream=True, extra_body=so,
    )  # type: ignore[arg-type]  # fmt: skip
    texts = [""] * 6
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(t in CHOICES for t in texts), texts


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"structured_outputs": {"regex": "([a-"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs", "json"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", "grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "one"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "either",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "type"),
    ],
)
def test_bad_constraints_are_400(
    server: LiveServer, body: dict[str, Any], param: str, words: str
) -> None:
    for path, base in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        r = httpx.post(server.url + path, json={**base, "max_tokens": 4, **body}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(
            model=server.model, prompt="x", max_tokens=4, extra_body=body
        )


def test_grammar_compiles_off_the_engine_thread(server: LiveServer) -> None:
    """A slow compile (1.5 s) runs beside the engine: a running stream keeps its pace, and the
    engine thread never calls the compiler (nor builds xgrammar's tokenizer info)."""
    rec: _CompileRecorder = server.engine.engine.structured.compile  # type: ignore[assignment]
    c = server.client()
    stream = c.completions.create(
        model=server.model, prompt="Once upon a time", max_tokens=MAX_MODEL_LEN - 32,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    # A new constraint (not in xgrammar's cache), compiled while the stream runs.
    so = {"structured_outputs": {"regex": "(yes|no|maybe) [0-9]{2}"}}
    result: list[str] = []

    def structured() -> None:
        r = c.completions.create(
            model=server.model, prompt="Answer:", max_tokens=8, temperature=0, extra_body=so
        )
        result.append(r.choices[0].text)

    rec.delay = 1.5
    times: list[float] = []
    worker = threading.Thread(target=structured)
    try:
        for _ in stream:
            times.append(time.monotonic())
            if len(times) == 1:
                worker.start()
        worker.join(30)
    finally:
        rec.delay = 0.0
    assert result and result[0].split(" ")[0] in ("yes", "no", "maybe"), result
    (thread, start, end), *_ = [c for c in rec.calls if c[1] >= times[0]]
    assert times[0] < start and end < times[-1], "the stream ended before the compile did"
    gap = max(b - a for a, b in zip(times, times[1:]))
    assert gap < 0.5, f"a {gap:.2f} s gap in the running stream"
    assert thread != ENGINE_THREAD and rec.calls
    assert ENGINE_THREAD not in {t for t, _, _ in rec.calls}, rec.calls
