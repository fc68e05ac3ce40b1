"""Seeded sampling under speculation ("coupled" verification) and penalties per verified slot.

- The same seed gives the same tokens with and without speculation, for every drafter kind and
  both draft sampling methods, with chunked prefill and preemption in the mix.
- Penalties, logit_bias and min_tokens match a reference computed here from transformers'
  logits; greedy spec == greedy plain with them.
- Sampled outputs with penalties follow the exact two-token distribution with speculation on,
  both under coupled verification and under speculative sampling (its residual path).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams

from .conftest import random_prompts
from .spec_utils import (
    write_eagle,
    write_eagle3,
    write_mtp_target,
    write_multi_mtp_target,
    write_ptd_eagle3,
)

TARGET = ("llama_gqa", "llama")


@pytest.fixture(scope="module")
def setup(ckpt_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("seeded")
    target = ckpt_dir(*TARGET)
    return {
        "target": target,
        "prompts": random_prompts(3, 4, 30, seed=3),
        "self": target,  # the target as its own drafter: coupled drafts are always accepted
        "draft_model": ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
        "eagle": write_eagle(os.path.join(root, "eagle")),
        "eagle3": write_eagle3(os.path.join(root, "eagle3")),
        "mtp": write_mtp_target(target, os.path.join(root, "mtp_target")),
        "mtp2": write_multi_mtp_target(target, os.path.join(root, "mtp2"), 2, seed=3),
        "ptd": write_ptd_eagle3(os.path.join(root, "ptd")),
    }


def _llm(setup: dict, kind: str, draft_sample: str, adaptive: bool = True, **kw) -> LLM:
    target = setup["target"]
    cfg: dict = {
        "num_speculative_tokens": 3,
        "draft_sample_method": draft_sample,
        "adaptive": adaptive,
    }
    if kind in ("self", "draft_model"):
        cfg |= {"method": "draft_model", "model": setup[kind]}
    elif kind in ("eagle", "eagle3"):
        cfg |= {"method": kind, "model": setup[kind]}
    elif kind in ("mtp", "mtp2"):
        cfg |= {"method": "mtp", "num_speculative_tokens": 2 if kind == "mtp2" else 3}
        target = setup[kind]
    elif kind == "ptd":
        cfg |= {"method": "eagle3", "model": setup["ptd"], "parallel_draft": True}
    else:
        cfg |= {"method": "ngram", "prompt_lookup_min": 1}
    return LLM(target, max_model_len=128, speculative_config=cfg, **kw)


def _tokens(llm: LLM, prompts: list[list[int]], sps: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


KINDS = ["self", "draft_model", "eagle", "eagle3", "mtp", "mtp2", "ptd", "ngram"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("draft_sample", ["greedy", "probabilistic"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_same_seed_same_text_with_and_without_speculation(
    setup: dict, kind: str, draft_sample: str, adaptive: bool
) -> None:
    prompts = setup["prompts"]
    # Seeded and unseeded-but-engine-seeded rows, top-k / top-p on one, a penalty on another.
    sps = [
        SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=12, top_k=20, top_p=0.9, max_tokens=16),
        SamplingParams(temperature=0.7, seed=13, max_tokens=16, presence_penalty=0.5),
    ]
    # Prompts repeated, so n-gram finds drafts.
    prompts = [p * 2 for p in prompts]
    plain = _tokens(LLM(setup["target"], max_model_len=128), prompts, sps)
    llm = _llm(setup, kind, draft_sample, adaptive, max_num_batched_tokens=32)
    assert _tokens(llm, prompts, sps) == plain
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts_total"] > 0
    # (Under the adaptive budget a stretch without drafting leaves holes in the drafter's KV,
    # so even the target drafting itself may miss right after.)
    if kind == "self" and not adaptive:
        # The drafter draws the target's own noise: every draft is the target's sample.
        assert m["spec_decode_num_accepted_tokens_total"] > 0
        if draft_sample == "probabilistic":
            assert m["spec_decode_acceptance_rate"] > 0.99, m


def test_coupled_survives_preemption(setup: dict) -> None:
    prompts = random_prompts(4, 20, 40, seed=9)
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True)
    plain = _tokens(LLM(setup["target"], max_model_len=128), prompts, [sp] * 4)
    llm = _llm(setup, "eagle3", "probabilistic", num_gpu_blocks_override=9)
    assert _tokens(llm, prompts, [sp] * 4) == plain
    assert llm.get_metrics()["num_preemptions_total"] > 0


# ---- penalties ---------------------------------------------------------------------------------
def _penalized(
    logits: torch.Tensor, prompt: list[int], out: list[int], sp: SamplingParams, eos: int
) -> torch.Tensor:
    """vLLM's order: min_tokens mask, logit_bias, repetition (prompt + output), frequency and
    presence (output), written per token with Python loops as an independent reference."""
    x = logits.double().clone()
    if len(out) < sp.min_tokens:
        for t in [*(sp.stop_token_ids or []), eos]:
            x[t] = float("-inf")
    for t, b in (sp.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(out):
        x[t] -= sp.frequency_penalty * out.count(t) + sp.presence_penalty
    return x


def _hf_greedy_penalized(path: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(sp.max_tokens):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(_penalized(logits, prompt, out, sp, eos=2).argmax()))
    return out


PENALTIES = [
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=1.5, presence_penalty=0.7),
    dict(repetition_penalty=0.7, presence_penalty=-1.0, min_tokens=12, stop_token_ids=[5]),
]


@pytest.mark.parametrize("pen", PENALTIES)
def test_greedy_penalties_match_reference_with_and_without_spec(setup: dict, pen: dict) -> None:
    prompt = setup["prompts"][0]
    sp = SamplingParams(temperature=0.0, max_tokens=12, **pen)
    ref = _hf_greedy_penalized(setup["target"], prompt, sp)
    plain = _tokens(LLM(setup["target"], max_model_len=128), [prompt], [sp])[0]
    assert plain[: len(ref)] == ref
    unpenalized = _tokens(LLM(setup["target"], max_model_len=128), [prompt], [
        SamplingParams(temperature=0.0, max_tokens=12)
    ])[0]  # fmt: skip
    assert unpenalized != ref  # the penalty does something here
    for kind in ("self", "eagle3", "ngram"):
        assert _tokens(_llm(setup, kind, "greedy"), [prompt], [sp])[0] == plain, kind


def test_logit_bias_and_min_tokens(setup: dict) -> None:
    prompt = setup["prompts"][1]
    llm = LLM(setup["target"], max_model_len=128)
    greedy = _tokens(llm, [prompt], [SamplingParams(temperature=0.0, max_tokens=1)])[0][0]
    sp = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={greedy: -100.0})
    assert _tokens(llm, [prompt], [sp])[0][0] != greedy
    sp = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={7: 100.0})
    assert _tokens(llm, [prompt], [sp])[0] == [7] * 4
    # min_tokens masks the stop token (here a +100 bias would pick it otherwise).
    sp = SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=5, stop_token_ids=[7], logit_bias={7: 100.0}
    )
    for spec_llm in (llm, _llm(setup, "self", "greedy")):
        out = _tokens(spec_llm, [prompt], [sp])[0]
        assert len(out) == 6 and out[-1] == 7 and 7 not in out[:5], out


# ---- distribution ------------------------------------------------------------------------------
V_SMALL = 8


@pytest.mark.parametrize("method", ["coupled", "probabilistic"])
def test_sampled_penalties_distribution_with_spec(ckpt_dir, method: str) -> None:
    """First two tokens of 3000 seeded samples with penalties, K = 2 self-drafting (drafts from
    the UNpenalized distribution, so verification must correct them), against the exact joint
    distribution computed from transformers' logits: a chi-square test."""
    import transformers as tf

    from .test_sampling import chi2_pvalue

    path = ckpt_dir("tiny_vocab", "llama", vocab_size=V_SMALL, num_hidden_layers=2,
                    bos_token_id=0, eos_token_id=1, pad_token_id=0, initializer_range=0.5)  # fmt: skip
    prompt = [3, 4, 3, 5]
    sp_kw = dict(temperature=1.0, max_tokens=2, ignore_eos=True)
    pen = dict(repetition_penalty=1.5, frequency_penalty=0.8, logit_bias={6: 1.0})
    base = SamplingParams(**sp_kw, **pen)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    joint = np.zeros((V_SMALL, V_SMALL))
    with torch.no_grad():
        l1 = model(torch.tensor([prompt])).logits[0, -1]
        p1 = _penalized(l1, prompt, [], base, eos=1).softmax(-1)
        for a in range(V_SMALL):
            l2 = model(torch.tensor([prompt + [a]])).logits[0, -1]
            joint[a] = p1[a].item() * _penalized(l2, prompt, [a], base, eos=1).softmax(-1).numpy()
    cfg = {"method": "draft_model", "model": path, "num_speculative_tokens": 2,
           "draft_sample_method": "probabilistic", "rejection_sample_method": method}  # fmt: skip
    llm = LLM(path, max_model_len=32, max_num_seqs=256, speculative_config=cfg)
    n = 3000
    sps = [SamplingParams(**sp_kw, **pen, seed=i) for i in range(n)]
    outs = _tokens(llm, [prompt] * n, sps)
    assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0
    counts = np.zeros((V_SMALL, V_SMALL))
    for a, b in outs:
        counts[a, b] += 1
    # Cells with a tiny expectation are pooled so the chi-square approximation holds.
    big = joint.ravel() * n >= 5
    obs = np.append(counts.ravel()[big], counts.ravel()[~big].sum())
    probs = np.append(joint.ravel()[big], joint.ravel()[~big].sum())
    p = chi2_pvalue(torch.tensor(obs), torch.tensor(probs / probs.sum()))
    assert p > 1e-3, p


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["eagle3", "ptd", "ngram"])
def test_coupled_and_penalties_on_cuda(setup: dict, kind: str) -> None:
    """The CUDA path (Triton coupled kernels, captured target and draft graphs): seeded sampled
    and greedy-penalized outputs equal plain decoding's."""
    prompts = [p * 2 for p in setup["prompts"]]
    sps = [
        SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=12, top_k=20, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.5,
                       frequency_penalty=0.5, logit_bias={9: 3.0}, ignore_eos=True),
    ]  # fmt: skip
    kw = dict(device="cuda", dtype="float32")
    plain = _tokens(LLM(setup["target"], max_model_len=128, **kw), prompts, sps)
    for draft_sample in ("greedy", "probabilistic"):
        assert _tokens(_llm(setup, kind, draft_sample, **kw), prompts, sps) == plain
