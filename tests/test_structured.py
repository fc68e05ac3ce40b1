"""Structured outputs (xgrammar) under speculation, on the embedded model (CPU).

Sampled generations under a JSON schema all parse and validate with EAGLE-3 and with n-gram;
greedy output with speculation equals output without under the same JSON schema, regex and
choice list; the masks per draft position and the bitmask step against xgrammar's own; the
OpenAI server with the `openai` client (response_format json_schema / json_object,
structured_outputs choice) and its 400s.

`FAMILY` names the model family; the fixtures read everything else from it, so another target
(and its EAGLE-3 head) is a one-line change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import pytest
import torch

from specserve import LLM, SamplingParams, StructuredOutputsParams
from specserve.data import embedded_model_dir, load_prompts

FAMILY: Callable[[], tuple[str, dict[str, Any]]] = embedded_model_dir
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}

# Closes in under 50 tokens: a small object with an enum, a bounded integer and a short list
# of enums (whose repeats give n-gram something to propose).
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "minItems": 2,
            "maxItems": 3,
        },
    },
    "required": ["color", "n", "tags"],
}
REGEX = r"[a-z_]+\([a-z_, ]*\)\n"
CHOICES = ["True", "False", "None"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def family() -> tuple[str, dict[str, Any]]:
    return FAMILY()


@pytest.fixture(scope="module")
def engines(family: tuple[str, dict[str, Any]]) -> dict[str, LLM]:
    target, eagle3 = family
    return {
        "plain": LLM(target),
        "eagle3": LLM(target, speculative_config=eagle3),
        "ngram": LLM(target, speculative_config=NGRAM),
    }


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [r["prompt"] for r in load_prompts("code", 10)]


def _accept_len(llm: LLM) -> float:
    return llm.get_metrics()["spec_decode_mean_acceptance_length"]


@pytest.mark.parametrize("drafter", ["eagle3", "ngram"])
def test_sampled_json_schema_outputs_validate(
    engines: dict[str, LLM], prompts: list[str], drafter: str
) -> None:
    """50 generations at temperature 0.8, different seeds: every one stops on its own and
    parses and validates against the schema."""
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    sps = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=64, structured_outputs=so)
        for i in range(50)
    ]
    outs = engines[drafter].generate(
        [prompts[i % len(prompts)] for i in range(50)], sps, use_tqdm=False
    )
    texts = set()
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
        texts.add(c.text)
    assert len(texts) > 5  # really sampled
    m = engines[drafter].get_metrics()
    assert m["spec_decode_num_draft_tokens_total"] > 0


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_greedy_speculation_equals_plain(
    engines: dict[str, LLM], prompts: list[str], kind: str
) -> None:
    so = {
        "json": StructuredOutputsParams(json=SCHEMA),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
    }[kind]
    sp = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so)
    ps = prompts[:6]
    ref = [o.outputs[0] for o in engines["plain"].generate(ps, sp, use_tqdm=False)]
    for c in ref:
        if kind == "regex":
            assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c.text
        elif kind == "choice":
            assert c.finish_reason == "stop" and c.text in CHOICES, c.text
        elif c.finish_reason == "stop":  # free JSON whitespace may run to max_tokens
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert any(c.finish_reason == "stop" for c in ref)
    for drafter in ("eagle3", "ngram"):
        before = engines[drafter].get_metrics()["spec_decode_num_draft_tokens_total"]
        got = engines[drafter].generate(ps, sp, use_tqdm=False)
        for a, b in zip(ref, got):
            assert b.outputs[0].token_ids == a.token_ids, (drafter, a.text, b.outputs[0].text)
            assert b.outputs[0].finish_reason == a.finish_reason
        if kind != "choice":  # a choice is one or two tokens: little to draft
            assert engines[drafter].get_metrics()["spec_decode_num_draft_tokens_total"] > before
    # Drafts were accepted under the grammar, not only proposed.
    assert _accept_len(engines["eagle3"]) > 1.2


def test_async_scheduling_and_json_object(family: tuple[str, dict[str, Any]]) -> None:
    """Async scheduling does not overlap steps of structured requests (their masks need the
    tokens on the host); outputs equal the synchronous engine's. json_object: any object."""
    target, eagle3 = family
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=64,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    )
    free = SamplingParams(temperature=0.0, max_tokens=12)
    obj = SamplingParams(
        temperature=0.8,
        seed=1,
        max_tokens=48,
        structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    )
    ps = [r["prompt"] for r in load_prompts("code", 3)]
    params = [sp, free, obj]
    a = LLM(target, speculative_config=eagle3).generate(ps, params, use_tqdm=False)
    b = LLM(target, speculative_config=eagle3, async_scheduling=True).generate(
        ps, params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    jsonschema.validate(json.loads(a[0].outputs[0].text), SCHEMA)
    if a[2].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(a[2].outputs[0].text), dict)
    else:
        assert a[2].outputs[0].text.startswith("{")


def test_bad_constraints_name_the_field(engines: dict[str, LLM]) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a+")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        engines["plain"].generate(
            ["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="([a-")),
            use_tqdm=False,
        )  # fmt: skip
