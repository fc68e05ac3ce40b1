"""Detokenization and stop strings off the engine thread (output_processor.py).

The engine thread must never call the tokenizer, and a stop string completed in the middle of a
speculative step (several tokens accepted at once) must cut the output exactly there: text,
token ids, logprobs and usage end at the stop point, and the engine stops generating for it.
Self-drafting (the target is its own draft) accepts every draft, so each decode step emits
exactly K + 1 tokens and the stop point's place inside a step is known.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from specserve import LLM, SamplingParams

from .test_server import MAX_MODEL_LEN, LiveServer, _config, dirs  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 3
PROMPT = "Hello world"
MAX_TOKENS = 150
ENGINE_THREAD = "specserve-engine"


class _ThreadRecorder:
    """Stands in for a tokenizer's Rust backend: records which thread encodes or decodes."""

    RECORDED = frozenset({"decode", "decode_batch", "encode", "encode_batch"})

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "calls", [])  # (method, thread name)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self.RECORDED:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, threading.current_thread().name))
            return attr(*args, **kwargs)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


def _spec(paths: dict[str, str]) -> dict[str, Any]:
    # Fixed K: the stop point's place inside a step assumes K + 1 tokens every step.
    spec = {"method": "draft_model", "model": paths["model"], "num_speculative_tokens": K}
    return {**spec, "adaptive": False}


@pytest.fixture(scope="module")
def server(dirs: dict[str, str]) -> Iterator[tuple[LiveServer, _ThreadRecorder]]:  # noqa: F811
    s = LiveServer(_config(dirs, _spec(dirs)))
    tok = s.engine.engine.tokenizer
    inner = tok._tokenizer
    rec = _ThreadRecorder(inner)
    tok._tokenizer = rec  # before any request: every tokenizer call of this module is seen
    yield s, rec
    tok._tokenizer = inner
    s.close()


@pytest.fixture(scope="module")
def llm(dirs: dict[str, str]) -> LLM:  # noqa: F811
    return LLM(
        dirs["model"],
        tokenizer=dirs["tokenizer"],
        speculative_config=_spec(dirs),
        max_model_len=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module")
def stop_case(llm: LLM) -> dict[str, Any]:
    """A stop string first completed by a token j in the middle of a decode step."""
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("ref", PROMPT, sp)
    step_ends, n = [], 0  # index after each step's last token
    while eng.has_unfinished_requests():
        for out in eng.step():
            n += len(out.delta_token_ids)
            step_ends.append(n)
            ref = out
    ids, text = ref.outputs[0].token_ids, ref.outputs[0].text
    assert eng.metrics_snapshot()["spec_decode_num_drafts_total"] > 0
    tok = llm.get_tokenizer()
    assert text == tok.decode(ids, skip_special_tokens=True)
    for j in range(4, len(ids) - 1):
        if j + 1 in step_ends:
            continue  # the last token of its step: not the case under test
        before = tok.decode(ids[:j], skip_special_tokens=True)
        upto = tok.decode(ids[: j + 1], skip_special_tokens=True)
        if not upto.startswith(before) or upto.endswith("\ufffd"):
            continue  # token j ends or changes an incomplete character
        for n_chars in (2, 1):  # random weights give odd text: any unseen short tail will do
            s = upto[-n_chars:]
            if len(upto) - len(before) >= n_chars and "\ufffd" not in s and s not in before:
                end = next(e for e in step_ends if e > j + 1)
                return {"stop": s, "j": j, "ids": ids, "text": text, "step_end": end}
    pytest.fail(f"no stop string candidate in {text!r}")


def test_stop_string_inside_a_speculative_step_offline(llm: LLM, stop_case: dict) -> None:
    s, j, ids, text = stop_case["stop"], stop_case["j"], stop_case["ids"], stop_case["text"]
    before = llm.engine.stats.generation_tokens
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[s], logprobs=1)
    out = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.find(s)]
    assert out.token_ids == ids[: j + 1]  # the token that completed the stop string is the last
    assert out.logprobs is not None and len(out.logprobs) == j + 1
    assert (out.finish_reason, out.stop_reason) == ("stop", s)
    # Inline (offline), the request ends in the step that completed the stop string.
    assert llm.engine.stats.generation_tokens - before == stop_case["step_end"]

    sp = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=[s], include_stop_str_in_output=True
    )
    out = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.find(s) + len(s)] and out.token_ids == ids[: j + 1]


def test_stop_string_inside_a_speculative_step_server(server: Any, stop_case: dict) -> None:
    srv, _ = server
    s, j, text = stop_case["stop"], stop_case["j"], stop_case["text"]
    core = srv.engine.engine
    c = srv.client()
    kw: dict[str, Any] = dict(
        model=srv.model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stop=s,
        extra_body={"ignore_eos": True},
    )
    before = core.stats.generation_tokens
    r = c.completions.create(logprobs=1, **kw)
    ch = r.choices[0]
    assert ch.text == text[: text.find(s)]
    assert (ch.finish_reason, ch.model_extra["stop_reason"]) == ("stop", s)
    assert r.usage is not None and r.usage.completion_tokens == j + 1
    assert ch.logprobs is not None and len(ch.logprobs.tokens) == j + 1
    # The engine was told: the request left it long before max_tokens (the abort races a few
    # steps at most), and its blocks are free.
    srv.wait_idle()
    assert core.stats.generation_tokens - before < MAX_TOKENS // 2

    # Streaming: the same text in deltas (the stop string never leaks), the same usage.
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(x.choices[0].text for x in chunks if x.choices) == ch.text
    assert [x.choices[0].finish_reason for x in chunks if x.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == j + 1

    kw["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    r = c.completions.create(n=2, **kw)  # n > 1: each choice stops on its own
    for ch in r.choices:
        assert ch.text == text[: text.find(s) + len(s)] and ch.finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == 2 * (j + 1)
    srv.wait_idle()


def test_engine_thread_never_uses_the_tokenizer(server: Any, stop_case: dict) -> None:
    srv, rec = server
    c = srv.client()
    m = srv.model
    c.completions.create(model=m, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, n=2)
    list(
        c.completions.create(
            model=m, prompt=PROMPT, max_tokens=12, stream=True, stop=stop_case["stop"]
        )
    )
    # echo of a token-id prompt, and prompt logprobs (decoded tokens)
    r = c.completions.create(
        model=m, prompt=[1, 5, 6, 7], max_tokens=4, echo=True, logprobs=1, temperature=0
    )
    assert r.choices[0].text.startswith(srv.engine.engine.tokenizer.decode([1, 5, 6, 7]))
    c.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "héllo 🙂"}], max_tokens=8
    )
    srv.wait_idle()
    threads = {t for name, t in rec.calls if name.startswith("decode")}
    assert threads, "the recorder saw no decode: it is not in the path"
    assert ENGINE_THREAD not in {t for _, t in rec.calls}, rec.calls
