"""fp8 KV cache on CUDA: the Triton kernels (paged attention with its fp8 tile loop, MLA's latent
cache) under CUDA graphs, through the engine.

- Under fp8 KV, greedy output with speculation (draft model, EAGLE-3, MTP over MLA) equals
  greedy output without, and graph replay equals eager.
- Prompt logprobs with fp8 KV stay within the CPU tests' bounds of the model dtype's, on tiny
  models and (where installed) on the default model.

Run with `pytest -m gpu`.
"""
# ruff: noqa: F811 (test arguments named as the fixtures imported from test_gpu)

from __future__ import annotations

import pytest
import torch

from .conftest import random_prompts
from .mla_utils import make_mla_checkpoint
from .spec_utils import append_mtp_layers
from .test_fp8_kv import prompt_logprob_diff

# The GPU tests' fixtures (an autouse TF32 switch-off, the drafter checkpoints, the prompts)
# and engines.
from .test_gpu import GREEDY, _no_tf32, cuda_llm, drafters, prompts  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def tokens(llm, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("method", [None, "draft_model", "eagle3"])
def test_greedy_under_fp8_cuda(drafters, prompts, kv: str, method: str | None) -> None:
    plain = tokens(cuda_llm(drafters["target"], kv_cache_dtype=kv, enforce_eager=True), prompts)
    spec = None
    if method is not None:
        spec = {"method": method, "model": drafters[method], "num_speculative_tokens": 3}
        spec["adaptive"] = False  # every step drafts
    llm = cuda_llm(drafters["target"], kv_cache_dtype=kv, speculative_config=spec)
    assert llm.engine.runner.cudagraphs is not None
    assert tokens(llm, prompts) == plain


def test_mla_mtp_under_fp8_cuda(tmp_path) -> None:
    path = append_mtp_layers(
        make_mla_checkpoint(str(tmp_path / "ds"), "deepseek_v3"), str(tmp_path / "mtp"), 1
    )
    ps = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    plain = tokens(cuda_llm(path, kv_cache_dtype="fp8", enforce_eager=True), ps)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
    assert tokens(cuda_llm(path, kv_cache_dtype="fp8"), ps) == plain
    assert tokens(cuda_llm(path, kv_cache_dtype="fp8", speculative_config=spec), ps) == plain


@pytest.mark.parametrize("family", ["llama", "deepseek_mla"])
def test_prompt_logprobs_fp8_cuda(ckpt_dir, tmp_path, family: str) -> None:
    if family == "deepseek_mla":
        path = make_mla_checkpoint(str(tmp_path / "ds"), "deepseek_v3")
    else:
        path = ckpt_dir("llama_gqa", "llama")
    diff = prompt_logprob_diff(path, random_prompts(3, 40, 120, seed=7), "fp8", device="cuda")
    print(f"\n{family} fp8_e4m3 on CUDA: mean |prompt logprob diff| = {diff:.5f} nats/token")
    assert diff < 0.3  # the CPU test's bound for tiny random models


def test_default_model_prompt_logprobs_fp8_cuda() -> None:
    from specserve import LLM
    from specserve.data import default_model, load_prompts

    try:
        gguf, _ = default_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = LLM(gguf, max_model_len=512, device="cuda").engine.tokenizer
    prompts = [tok.encode(r["prompt"])[:256] for r in load_prompts("code", 8)]
    diff = prompt_logprob_diff(gguf, prompts, "fp8", device="cuda", dtype="bfloat16")
    print(f"\nSmolLM2-135M fp8_e4m3 on CUDA: mean |prompt logprob diff| = {diff:.5f} nats/token")
    assert diff <= 0.1
