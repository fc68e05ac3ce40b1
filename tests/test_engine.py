"""End-to-end engine behaviour on CPU against transformers' generate."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

from .conftest import hf_greedy, random_prompts

ARCHS = {
    "llama_gqa": ("llama", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True, "head_dim": 32}),
    "mistral_swa": ("mistral", {"sliding_window": 24}),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_refs(ckpt_dir) -> dict[str, list[list[int]]]:
    prompts = random_prompts(5, 5, 60, seed=3)
    refs = {}
    for name, (arch, over) in ARCHS.items():
        path = ckpt_dir(name, arch, **over)
        refs[name] = [hf_greedy(path, p, 64) for p in prompts]
    refs["_prompts"] = prompts
    return refs


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        {"max_num_batched_tokens": 32},  # chunked prefill
        {"num_gpu_blocks_override": 10, "max_num_batched_tokens": 64},  # preemption
    ],
    ids=["plain", "chunked", "preempt"],
)
def test_greedy_matches_transformers(ckpt_dir, hf_refs, name: str, engine_kw: dict) -> None:
    arch, over = ARCHS[name]
    llm = LLM(ckpt_dir(name, arch, **over), max_model_len=256, **engine_kw)
    prompts = hf_refs["_prompts"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for o, ref in zip(outs, hf_refs[name]):
        assert o.outputs[0].token_ids == ref
        assert o.outputs[0].finish_reason == "length"
    if "num_gpu_blocks_override" in engine_kw:
        assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.kv.usage() == 0.0


def test_seeded_sampling_is_batch_invariant(ckpt_dir) -> None:
    llm = LLM(ckpt_dir("llama_gqa", "llama"), max_model_len=256)
    sp = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True
    )
    prompt = {"prompt_token_ids": random_prompts(1, 12, 12, seed=9)[0]}
    alone = llm.generate([prompt], sp)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in random_prompts(7, 3, 40, seed=10)]
    other_sp = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    batch = llm.generate(others[:3] + [prompt] + others[3:], [other_sp] * 3 + [sp] + [other_sp] * 4)
    assert batch[3].outputs[0].token_ids == alone
    again = llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert again == alone


def test_bad_inputs(ckpt_dir, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    llm = LLM(ckpt_dir("llama_gqa", "llama"), max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.generate({"prompt_token_ids": [5] * 80}, GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    # The engine still works after the rejected requests.
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
