"""vLLM's `allowed_token_ids` and `bad_words` sampling parameters.

- The processors against a Python-loop reference of vLLM's rule, slot by slot, with drafts in
  the token buffer (speculative verification), prompt boundaries and shared last tokens.
- Greedy output equals a reference computed here from transformers' logits with the same rules,
  with and without speculation (n-gram, EAGLE-3, a draft model).
- Bad values are refused when the request is added, naming the field.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.request import Request
from specserve.sample.logits_processors import (
    apply_logits_processors,
    build_logits_processor_inputs,
)

from .spec_utils import write_eagle3
from .tok_utils import make_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [1, 50, 60, 70, 80, 90]
NEG = float("-inf")


def _banned_reference(out: list[int], words: list[list[int]]) -> set[int]:
    """vLLM's rule over the output so far (the prompt does not count)."""
    banned = set()
    for w in words:
        if len(w) == 1:
            banned.add(w[0])
        elif len(w) - 1 <= len(out) and out[len(out) - len(w) + 1 :] == w[:-1]:
            banned.add(w[-1])
    return banned


def test_processors_match_the_rule_slot_by_slot() -> None:
    torch.manual_seed(0)
    V, S, width = 32, 4, 24
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
    outputs = [[5, 6, 7, 5], [8, 9], []]  # verified output tokens
    drafts = [[6, 7, 8], [9, 8, 9], [10, 11, 12]]  # this step's drafts d1..d3
    words = [
        [[6, 7], [5, 6, 7], [12], [4, 5], [7, 9]],  # [4, 5] ends in the prompt: never fires
        [[8, 9], [9, 8], [30, 8, 9]],  # two words ending in 9, one matching
        [[11, 12], [10, 11]],  # prefix 11 sits in the prompt at slot 0, in drafts later
    ]
    allowed = [None, None, list(range(10, 20))]
    reqs, tokens = [], torch.zeros(3, width, dtype=torch.int64)
    out_pos0 = []
    for i in range(3):
        sp = SamplingParams(allowed_token_ids=allowed[i], bad_words=["x"])
        r = Request(str(i), prompts[i], sp)
        r.output_token_ids = list(outputs[i])
        r.bad_words_token_ids = words[i]
        reqs.append(r)
        seq = prompts[i] + outputs[i] + drafts[i]
        tokens[i, : len(seq)] = torch.tensor(seq)
        out_pos0.append(len(prompts[i]) + len(outputs[i]))
    # Persistent rows in another order than the batch's.
    buffer = tokens[[2, 0, 1]]
    idx_mapping = torch.tensor([1, 2, 0])
    lp = build_logits_processor_inputs(reqs, set(), torch.device("cpu"))
    assert lp is not None
    logits = torch.randn(3, S, V)
    got = apply_logits_processors(logits, buffer, idx_mapping, torch.tensor(out_pos0), width, lp)
    for b in range(3):
        for j in range(S):
            out = outputs[b] + drafts[b][:j]  # slot j: after d1..dj
            want = logits[b, j].clone()
            if allowed[b] is not None:
                keep = torch.zeros(V, dtype=torch.bool)
                keep[allowed[b]] = True
                want[~keep] = NEG
            for t in _banned_reference(out, words[b]):
                want[t] = NEG
            assert torch.equal(got[b, j], want), (b, j)
    # The rule fired where the reference says (guards against a mask that never fires).
    assert got[0, 1, 7] == NEG and got[0, 0, 7] != NEG and got[0, 2, 9] == NEG
    assert got[1, 2, 9] == NEG and got[1, 0, 9] != NEG  # [8, 9] matches there, [30, 8, 9] not
    assert got[2, 2, 12] == NEG and got[2, 0, 12] != NEG  # 11 in the prompt does not count


@pytest.fixture(scope="module")
def setup(ckpt_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad_words")
    return {
        "target": ckpt_dir("llama"),
        "tokenizer": make_tokenizer(root / "tok"),
        "eagle3": write_eagle3(os.path.join(root, "eagle3")),
        "draft": ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
    }


def _reference(path: str, allowed: list[int] | None, words: list[list[int]], n: int) -> list[int]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            x = model(torch.tensor([PROMPT + out])).logits[0, -1].double()
            if allowed is not None:
                keep = torch.zeros_like(x, dtype=torch.bool)
                keep[allowed] = True
                x[~keep] = NEG
            for t in _banned_reference(out, words):
                x[t] = NEG
            out.append(int(x.argmax()))
    return out


def _engines(setup: dict[str, str]) -> list[LLM]:
    kw: dict[str, Any] = dict(tokenizer=setup["tokenizer"], max_model_len=128)
    specs = [
        None,
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        {"method": "eagle3", "model": setup["eagle3"], "num_speculative_tokens": 3},
        {"method": "draft_model", "model": setup["draft"], "num_speculative_tokens": 3},
    ]
    return [LLM(setup["target"], speculative_config=s, **kw) for s in specs]


def _greedy(llm: LLM, n: int, **kw: Any) -> list[int]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)
    return list(
        llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0].token_ids
    )


def _word_ids(tok: Any, word: str) -> list[list[int]]:
    """vLLM's tokenization of one bad word, written out here for the reference."""
    plain = tok.encode(word.lstrip(), add_special_tokens=False)
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    return [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])


def test_greedy_equals_reference_with_and_without_speculation(setup: dict[str, str]) -> None:
    n = 16
    engines = _engines(setup)
    plain = engines[0]
    free = _greedy(plain, n)
    tok = plain.get_tokenizer()
    # A two-token word the unconstrained output completes after its first output token, and a
    # one-token word from it: both must change the output.
    two = next(
        w
        for i in range(1, n - 1)
        for w in [tok.decode(free[i : i + 2])]
        if _word_ids(tok, w)[0] == free[i : i + 2]
    )
    one = next(w for t in free for w in [tok.decode([t])] if _word_ids(tok, w) == [[t]])
    allowed = list(range(100, 140))
    cases = [
        ({"allowed_token_ids": allowed}, allowed, []),
        ({"bad_words": [two]}, None, _word_ids(tok, two)),
        ({"bad_words": [one, two]}, None, _word_ids(tok, one) + _word_ids(tok, two)),
        ({"allowed_token_ids": allowed, "bad_words": [two]}, allowed, _word_ids(tok, two)),
    ]
    for kw, allow, words in cases:
        ref = _reference(setup["target"], allow, words, n)
        assert ref != free, kw  # the constraint changes the output here
        for llm in engines:
            assert _greedy(llm, n, **kw) == ref, (kw, llm.engine.config.speculative_config)
    assert all(t in allowed for t in _greedy(plain, n, allowed_token_ids=allowed))


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"allowed_token_ids": [1.0]}, "allowed_token_ids"),
        ({"bad_words": "word"}, "bad_words"),
        ({"bad_words": ["ok", " "]}, "bad_words"),
    ],
)
def test_bad_values_refused(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**kw)


def test_engine_checks(setup: dict[str, str], ckpt_dir: Any) -> None:
    llm = LLM(setup["target"], tokenizer=setup["tokenizer"], max_model_len=64)
    with pytest.raises(ValueError, match=r"allowed_token_ids 384 \(position 1\) is outside"):
        _greedy(llm, 2, allowed_token_ids=[5, 384])
    bare = LLM(ckpt_dir("llama"), max_model_len=64)  # no tokenizer
    with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
        _greedy(bare, 2, bad_words=["hello"])
    assert len(_greedy(bare, 2, allowed_token_ids=[5, 6])) == 2  # ids need no tokenizer
