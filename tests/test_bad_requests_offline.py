"""The offline API (`LLM`) refuses bad requests when they are added, with one clear message, and
the engine goes on serving: a request that passed validation and then failed inside a step
took every running request, and the engine, down with it (logprobs wider than the vocabulary,
a seed past int64). Malformed prompts and stop strings, once truncated (float ids), ignored
(non-string stops) or failed with a bare TypeError / KeyError, are refused by name too."""

from __future__ import annotations

from typing import Any

import pytest

from specserve import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = {"prompt_token_ids": [5, 17, 42, 9]}
VOCAB = 384  # tests/conftest.py TINY_DECODER


@pytest.fixture(scope="module")
def llm(ckpt_dir: Any) -> LLM:
    return LLM(ckpt_dir("llama"), max_model_len=64, max_num_seqs=4)


def greedy(llm: LLM, **kw: Any) -> list[int]:
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=6, **kw), use_tqdm=False
    )
    return list(out[0].outputs[0].token_ids)


@pytest.mark.parametrize(
    "params, message",
    [
        (
            {"logprobs": 21},
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
        ),
        ({"logprobs": 10**6}, "greater than max allowed: 20"),
        ({"prompt_logprobs": 21}, "Requested prompt logprobs of 21"),
    ],
)
def test_logprobs_past_max_logprobs_refused_and_engine_serves(
    llm: LLM, params: dict[str, Any], message: str
) -> None:
    before = greedy(llm)
    with pytest.raises(ValueError, match=message):
        greedy(llm, **params)
    assert greedy(llm) == before
    assert (
        len(llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)) == 1
    )


@pytest.mark.parametrize(
    "params, field",
    [
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**63 - 1, "n": 2}, "seed"),  # choice 1 would sample with seed + 1
        ({"temperature": float("nan")}, "temperature"),
        ({"stop": [""]}, "stop"),  # would end every request at once (vLLM refuses it too)
        ({"stop": ["ok", 5]}, "stop"),
    ],
)
def test_out_of_range_sampling_params_refused(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**params)


def test_extreme_seeds_in_range_sample(llm: LLM) -> None:
    for seed in (2**63 - 1, -(2**63)):
        sp = SamplingParams(temperature=1.0, max_tokens=4, seed=seed)
        a = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
        b = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
        assert len(a) == 4 and list(a) == list(b)


def test_max_logprobs_setting(ckpt_dir: Any) -> None:
    with pytest.raises(ValueError, match="max_logprobs must be -1 or an integer >= 0"):
        LLM(ckpt_dir("llama"), max_logprobs=-2)
    small = LLM(ckpt_dir("llama"), max_model_len=64, max_num_seqs=2, max_logprobs=2)
    with pytest.raises(ValueError, match="greater than max allowed: 2"):
        greedy(small, logprobs=3)
    whole = LLM(ckpt_dir("llama"), max_model_len=64, max_num_seqs=2, max_logprobs=-1)
    out = whole.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=VOCAB), use_tqdm=False)
    assert all(len(d) >= VOCAB for d in out[0].outputs[0].logprobs)
    with pytest.raises(ValueError, match=f"greater than max allowed: {VOCAB}"):
        greedy(whole, logprobs=VOCAB + 1)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt_token_ids": [5, 1.5]}, r"prompt token id 1.5 \(position 1\) is not an integer"),
        ({"prompt_token_ids": ["a"]}, r"prompt token id 'a' \(position 0\) is not an integer"),
        ([[5, 6], [7]], r"prompt token id \[5, 6\] \(position 0\) is not an integer"),
        ({"text": "hi"}, r"a prompt dict needs 'prompt' \(text\) or 'prompt_token_ids'"),
        (None, "a prompt is a string, a list of token ids or a dict"),
    ],
)
def test_malformed_prompts_refused_and_engine_serves(llm: LLM, prompt: Any, message: str) -> None:
    before = greedy(llm)
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert greedy(llm) == before


def test_numpy_token_ids_are_token_ids(llm: LLM) -> None:
    import numpy as np

    ids = np.array(PROMPT["prompt_token_ids"], dtype=np.int64)
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == greedy(llm)


def test_truncate_prompt_tokens(llm: LLM) -> None:
    """vLLM's left truncation: the output follows the prompt's last k tokens."""
    long = list(range(3, 40))
    sp = SamplingParams(temperature=0.0, max_tokens=6, truncate_prompt_tokens=5)
    out = llm.generate([{"prompt_token_ids": long}], sp, use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-5:]
    ref = SamplingParams(temperature=0.0, max_tokens=6)
    want = llm.generate([{"prompt_token_ids": long[-5:]}], ref, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    # -1: what max_model_len (64) holds with room for one token; a longer prompt would be refused.
    too_long = list(range(3, 103))
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.generate([{"prompt_token_ids": too_long}], ref, use_tqdm=False)
    sp = SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=-1)
    out = llm.generate([{"prompt_token_ids": too_long}], sp, use_tqdm=False)[0]
    assert out.prompt_token_ids == too_long[-63:] and len(out.outputs[0].token_ids) == 1
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="SamplingParams.truncate_prompt_tokens "):
            SamplingParams(truncate_prompt_tokens=bad)
