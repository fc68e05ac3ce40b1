"""OpenAI API completeness through the real server and the `openai` client: prompt logprobs
(echo + logprobs, vLLM's prompt_logprobs) against transformers, logit_bias, and 400s that name
every field specserve does not implement."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from specserve.config import EngineConfig

from .test_server import LiveServer, dirs  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "def add(a, b):\n    return a + b\n# the sum of"


@pytest.fixture(scope="module")
def hf(dirs: dict[str, str]) -> Any:  # noqa: F811
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(dirs["model"], dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(dirs["tokenizer"])
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return ids, logprobs, tok


# (speculative config, max_num_batched_tokens): plain, chunked prefill with a draft model,
# chunked with n-gram.
CONFIGS = {
    "plain": (None, 2048),
    "draft_chunked": ("draft", 8),
    "ngram_chunked": ({"method": "ngram", "num_speculative_tokens": 3}, 8),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def server(request: pytest.FixtureRequest, dirs: dict[str, str]) -> Iterator[LiveServer]:  # noqa: F811
    spec, mbt = CONFIGS[request.param]
    if spec == "draft":
        spec = {"method": "draft_model", "model": dirs["draft"], "num_speculative_tokens": 3}
    cfg = EngineConfig(
        model=dirs["model"],
        tokenizer=dirs["tokenizer"],
        speculative_config=spec,
        max_model_len=128,
        max_num_batched_tokens=mbt,
        dtype="float32",
    )
    s = LiveServer(cfg)
    yield s
    s.close()


def test_echo_prompt_logprobs_equal_transformers(server: LiveServer, hf: Any) -> None:
    ids, ref, tok = hf
    c = server.client()
    r = c.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=3
    )
    lp = r.choices[0].logprobs
    n = len(ids)
    assert r.choices[0].text.startswith(PROMPT)
    assert lp.tokens[:n] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        want = ref[i - 1, ids[i]].item()
        assert abs(lp.token_logprobs[i] - want) < 1e-4, (i, lp.token_logprobs[i], want)
        # (Keyed by token text, so tokens that decode alike share an entry: checked by id below.)
        assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
    # Then the generated tokens, with their own logprobs.
    assert len(lp.token_logprobs) == n + 2 and lp.token_logprobs[n] is not None
    # vLLM's prompt_logprobs field: {token id: {logprob, rank, decoded_token}} per prompt
    # token; rank: 1 + the tokens more likely (the prompt token), 1..N (the top-N).
    r = c.completions.create(
        model=server.model, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 3}
    )
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == n
    ranks = []
    for i in range(1, n):
        got = pl[i][str(ids[i])]
        assert abs(got["logprob"] - ref[i - 1, ids[i]].item()) < 1e-4
        want_rank = int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert got["rank"] == want_rank and got["decoded_token"] == tok.decode([ids[i]])
        ranks.append(want_rank)
        top_vals, top_ids = ref[i - 1].topk(3)
        assert {str(t) for t in top_ids.tolist()} <= set(pl[i]) and len(pl[i]) <= 4
        for j, (t, v) in enumerate(zip(top_ids.tolist(), top_vals.tolist()), start=1):
            assert abs(pl[i][str(t)]["logprob"] - v) < 1e-4 and pl[i][str(t)]["rank"] == j
    assert max(ranks) > 3, ranks  # some prompt token lies outside the top-N (a random model)


def test_logit_bias_moves_the_greedy_token(server: LiveServer, hf: Any) -> None:
    ids, ref, tok = hf
    c = server.client()
    first, second = ref[-1].topk(2).indices.tolist()
    kw = dict(model=server.model, prompt=ids, max_tokens=1, temperature=0, logprobs=0)
    assert c.completions.create(**kw).choices[0].logprobs.tokens == [tok.decode([first])]
    r = c.completions.create(**kw, logit_bias={str(first): -100})
    assert r.choices[0].logprobs.tokens == [tok.decode([second])]
    # Penalties are implemented now: accepted, and they change the output.
    kw = dict(model=server.model, prompt=ids, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    plain = c.completions.create(**kw).choices[0].text
    pen = c.completions.create(**kw, frequency_penalty=2.0, presence_penalty=2.0).choices[0].text
    assert pen != plain


# (tools, tool_choice and parallel_tool_calls are implemented: tests/test_tools_server.py)
UNIMPLEMENTED_CHAT = {
    "functions": [{"name": "f"}],
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text"],
    "reasoning_effort": "low",
    "prediction": {"type": "content", "content": "x"},
}


def test_unimplemented_fields_are_400s_naming_them(server: LiveServer) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": "hi"}]
    for name, value in UNIMPLEMENTED_CHAT.items():
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=server.model, messages=msgs, **{name: value})
        assert name in str(e.value), (name, e.value)
        assert e.value.body["param"] == name
    url = server.url + "/v1/completions"
    for body, name in (
        ({"prompt": "hi", "suffix": "x"}, "suffix"),
        ({"prompt": "hi", "guided_json": {}}, "guided_json"),
        ({"prompt": "hi", "stream_options": {"bogus": 1}}, "stream_options"),
    ):
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    # Harmless fields (no effect on the output) stay accepted.
    r = c.chat.completions.create(
        model=server.model, messages=msgs, max_tokens=2, user="u1", store=False,
        metadata={"k": "v"}, service_tier="auto",
    )  # fmt: skip
    assert r.choices[0].message.content is not None


def test_peak_throughput_counts_tokens_not_chunks() -> None:
    """Under speculation one chunk carries several tokens: the peak counts the tokens the
    continuous usage stats report; without them, one per chunk."""
    from specserve.bench.endpoint import RequestFuncOutput
    from specserve.bench.report import calculate_metrics

    def out(chunk_tokens: list[int]) -> RequestFuncOutput:
        return RequestFuncOutput(
            success=True, latency=0.5, output_tokens=10, ttft=0.1, itl=[0.1, 0.1, 0.1],
            chunk_tokens=chunk_tokens, prompt_len=4, start_time=0.0,
        )  # fmt: skip

    m = calculate_metrics([out([1, 4, 2, 3]), out([1, 1, 4, 4])], 1.0, [99])
    assert m["max_output_tokens_per_s"] == 20.0
    m = calculate_metrics([out([]), out([])], 1.0, [99])
    assert m["max_output_tokens_per_s"] == 8.0
