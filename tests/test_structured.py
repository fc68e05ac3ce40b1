"""Structured outputs (xgrammar) under speculation, on the embedded model (CPU).

Sampled generations under a JSON schema all parse and validate with EAGLE-3 and with n-gram;
greedy output with speculation equals output without under the same JSON schema, regex and
choice list, also with penalties and logit_bias; seeded sampled output under a grammar is the
same with and without speculation (coupled verification); the masks per draft position and the bitmask step against xgrammar's own; the
OpenAI server with the `openai` client (response_format json_schema / json_object,
structured_outputs choice) and its 400s.

`FAMILY` names the model family; the fixtures read everything else from it, so another target
(and its EAGLE-3 head) is a one-line change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
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


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def family() -> tuple[str, dict[str, Any]]:
    return FAMILY()


@pytest.fixture(scope="module")
def engines(family: tuple[str, dict[str, Any]]) -> dict[str, LLM]:
    target, eagle3 = family
    # A fixed K: the tests assert that drafts were proposed and accepted under the grammar (the
    # adaptive budget may rightly stop drafting on this model and these cores).
    return {
        "plain": LLM(target),
        "eagle3": LLM(target, speculative_config={**eagle3, "adaptive": False}),
        "ngram": LLM(target, speculative_config={**NGRAM, "adaptive": False}),
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


def test_grammar_with_penalties_and_logit_bias_greedy(
    engines: dict[str, LLM], prompts: list[str]
) -> None:
    """Grammar mask + penalties + logit_bias at every draft slot: greedy EAGLE-3 and n-gram
    output equals plain output token for token; the processors change the text (not ignored)
    and cannot break the grammar (+100 on a token it forbids: still valid JSON)."""
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    ps = prompts[:4]
    tok = engines["plain"].get_tokenizer()
    forbidden = tok.encode("zzz", add_special_tokens=False)[0]  # never valid JSON here
    seven = tok.encode("7", add_special_tokens=False)[0]
    base = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so)
    ref = [o.outputs[0] for o in engines["plain"].generate(ps, base, use_tqdm=False)]
    bias = {forbidden: 100.0, seven: 30.0}
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=64,
        structured_outputs=so,
        repetition_penalty=1.4,
        frequency_penalty=0.5,
        logit_bias=bias,
    )
    plain = [o.outputs[0] for o in engines["plain"].generate(ps, sp, use_tqdm=False)]
    assert any(a.token_ids != b.token_ids for a, b in zip(ref, plain))
    assert all("7" not in str(json.loads(c.text)["n"]) for c in ref if c.finish_reason == "stop")
    sevens = 0
    for c in plain:
        assert forbidden not in c.token_ids
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
            sevens += "7" in str(json.loads(c.text)["n"])
    assert sevens > 0  # the bias reached the allowed tokens
    for drafter in ("eagle3", "ngram"):
        got = [o.outputs[0] for o in engines[drafter].generate(ps, sp, use_tqdm=False)]
        for a, b in zip(plain, got):
            assert b.token_ids == a.token_ids, (drafter, a.text, b.text)
            assert b.finish_reason == a.finish_reason


def test_grammar_with_seeded_sampling_same_text_with_and_without_speculation(
    engines: dict[str, LLM], prompts: list[str]
) -> None:
    """Coupled verification draws the target's seeded sample from the masked (and penalized)
    logits at every slot, as plain sampling does: a seeded structured request gives the same
    text with and without speculation, for EAGLE-3 and n-gram."""
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    sps = [
        SamplingParams(
            temperature=0.9,
            seed=100 + i,
            max_tokens=64,
            structured_outputs=so,
            presence_penalty=0.3 if i % 2 else 0.0,
        )
        for i in range(8)
    ]
    ps = [prompts[i % len(prompts)] for i in range(8)]
    plain = [o.outputs[0] for o in engines["plain"].generate(ps, sps, use_tqdm=False)]
    assert len({c.text for c in plain}) > 2  # really sampled
    for c in plain:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    for drafter in ("eagle3", "ngram"):
        before = engines[drafter].get_metrics()["spec_decode_num_draft_tokens_total"]
        got = [o.outputs[0] for o in engines[drafter].generate(ps, sps, use_tqdm=False)]
        assert [c.token_ids for c in got] == [c.token_ids for c in plain], drafter
        assert engines[drafter].get_metrics()["spec_decode_num_draft_tokens_total"] > before


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


def json_grammar_setup(
    family: tuple[str, dict[str, Any]],
) -> tuple[Any, Any, StructuredOutputsParams, list[int], int, int]:
    """(the family's tokenizer, its StructuredOutputs, SCHEMA's params, the token ids of an object
    SCHEMA accepts, vocab size, EOS id): the set-up of the matcher-level tests."""
    from transformers import AutoTokenizer

    from specserve.structured.grammar import StructuredOutputs

    tok = AutoTokenizer.from_pretrained(family[0])
    vocab, eos = len(tok), tok.eos_token_id
    so = StructuredOutputs(tok, vocab, {eos})
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    text = '{"color": "red", "n": 7, "tags": ["red", "blue"]}'
    ids = [t for t in tok.encode(text) if t not in tok.all_special_ids]
    return tok, so, params, ids, vocab, eos


def test_masks_per_draft_position_and_commit(family: tuple[str, dict[str, Any]]) -> None:
    """fill_masks = the masks a fresh matcher gives after each draft prefix; a draft the grammar
    rejects ends the walk (later slots copy the last mask); commit rolls back rejected drafts
    and accepts the emitted token; an accepted stop token ends the output."""
    import xgrammar as xgr

    from specserve.structured.matcher import GrammarViolationError

    tok, so, params, ids, vocab, eos = json_grammar_setup(family)
    assert len(ids) > 6

    ref = xgr.GrammarMatcher(so.compile(params))
    want = xgr.allocate_token_bitmask(len(ids) + 2, vocab)
    for j, t in enumerate(ids):
        ref.fill_next_token_bitmask(want, j)
        assert ref.accept_token(t)
    ref.fill_next_token_bitmask(want, len(ids))  # only the stop token is left
    allowed_end = [t for t in range(vocab) if (want[len(ids), t // 32] >> (t % 32)) & 1]
    assert allowed_end == [eos]

    g = so.new_request(params)
    bm = xgr.allocate_token_bitmask(8, vocab)
    g.fill_masks(ids[:3], bm, 2)  # rows 2..5: slots 0..3
    assert torch.equal(bm[2:6], want[:4]) and g.num_tentative == 3
    assert (bm[:2] == -1).all() and (bm[6:] == -1).all()

    def allowed(row: torch.Tensor, t: int) -> bool:
        return bool((row[t // 32] >> (t % 32)) & 1)

    # Verification accepted d1 and emitted ids[1] in place of d2: 2 tokens kept.
    assert g.commit([ids[0], ids[1]], 1) == 2
    g.fill_masks([], bm, 0)
    assert torch.equal(bm[0], want[2])
    # A draft the grammar rejects: the walk stops, later slots copy the last mask.
    bad = next(t for t in range(vocab) if not allowed(want[3], t))
    g.fill_masks([ids[2], bad, ids[3]], bm, 0)
    assert g.num_tentative == 1
    assert torch.equal(bm[:2], want[2:4]) and torch.equal(bm[2], want[3])
    assert torch.equal(bm[3], want[3])
    assert g.commit([ids[2], ids[3]], 1) == 2
    g.fill_masks([bad], bm, 0)
    with pytest.raises(GrammarViolationError):
        g.commit([bad, ids[4]], 1)  # more accepted than the grammar allows: a bug, loud

    # A drafted stop token: the output ends at it, whatever verification accepted after it.
    g2 = so.new_request(params)
    bm2 = xgr.allocate_token_bitmask(len(ids) + 3, vocab)
    g2.fill_masks(ids + [eos, ids[0]], bm2, 0)
    assert g2.num_tentative == len(ids) + 1 and g2.is_terminated
    assert torch.equal(bm2[: len(ids) + 1], want[: len(ids) + 1])
    assert torch.equal(bm2[len(ids) + 2], want[len(ids)])
    assert g2.commit(ids + [eos, ids[0], ids[1]], len(ids) + 2) == len(ids) + 1
    assert g2.is_terminated
    # Properties come in the order the schema declares them (not sorted).
    g4 = so.new_request(StructuredOutputsParams(json={"properties": {"z": {}, "a": {}}}))
    zfirst = [t for t in tok.encode('{"z": 1, "a": 2}') if t not in tok.all_special_ids]
    assert g4.valid_prefix(zfirst) == len(zfirst)
    # Host drafts (n-gram) cut at the first rejected token; the state is unchanged.
    g3 = so.new_request(params)
    assert g3.valid_prefix(ids[:2] + [bad]) == 2 and g3.num_tentative == 0
    g3.fill_masks([], bm, 0)
    assert torch.equal(bm[0], want[0])


def test_grammar_bitmask_step_matches_xgrammar() -> None:
    """apply_grammar_bitmask_ on the structured rows of [B, K+1, V] logits = xgrammar's own
    apply_token_bitmask_inplace over the same rows; other rows untouched."""
    import xgrammar as xgr

    from specserve.structured.bitmask import GrammarStep, apply_grammar_bitmask_, bitmask_width

    g = torch.Generator().manual_seed(0)
    B, k1, V = 5, 4, 1000
    logits = torch.randn(B, k1, V, generator=g)
    rows = torch.tensor([1, 3])
    bits = torch.randint(-(2**31), 2**31, (2, k1, bitmask_width(V)), generator=g)
    mask = bits.to(torch.int32)
    got = logits.clone()
    apply_grammar_bitmask_(got, GrammarStep(rows, mask))
    want = logits.clone().view(B * k1, V)
    full = torch.full((B * k1, bitmask_width(V)), -1, dtype=torch.int32)
    idx = [r * k1 + j for r in rows.tolist() for j in range(k1)]
    full[idx] = mask.view(-1, mask.shape[-1])
    xgr.apply_token_bitmask_inplace(want, full, indices=idx, vocab_size=V)
    assert torch.equal(got.view(B * k1, V), want)
    assert torch.equal(got[[0, 2, 4]], logits[[0, 2, 4]])
    assert torch.isinf(got[1]).any() and not torch.isinf(got[0]).any()


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gpu_greedy_speculation_equals_plain(
    family: tuple[str, dict[str, Any]], prompts: list[str], async_scheduling: bool
) -> None:
    """CUDA: graphs, the Triton rejection kernels over masked (-inf) logits, masks uploaded
    asynchronously while the forward runs, drafts read back with the step's one copy. float32
    so greedy tokens compare exactly; 50 sampled generations validate."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    target, eagle3 = family
    kw: dict[str, Any] = dict(device="cuda", dtype="float32", async_scheduling=async_scheduling)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    sp = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so)
    plain = LLM(target, **kw).generate(prompts, sp, use_tqdm=False)
    spec = LLM(target, speculative_config=eagle3, **kw)
    got = spec.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(plain, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    sps = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=64, structured_outputs=so)
        for i in range(50)
    ]
    for o in spec.generate([prompts[i % len(prompts)] for i in range(50)], sps, use_tqdm=False):
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
