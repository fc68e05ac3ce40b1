"""MoE targets on CUDA: Triton attention, the fused MoE op's CUDA path, CUDA graphs.

Run with `pytest -m gpu`. float32 (TF32 off) so greedy tokens can be compared with transformers
on the CPU; bf16 runs compare CUDA graphs with eager mode and the first tokens with transformers
in bf16 on the same GPU.
"""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.tunables import override

from .conftest import hf_greedy, random_prompts
from .spec_utils import append_mtp_layers, write_speculators_eagle3
from .test_moe_models import MOE_ARCHS, moe_ckpt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
MODES = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 16},
    "preempt": {"num_gpu_blocks_override": 8, "max_num_batched_tokens": 64},
}


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, 5, 50, seed=3)


def cuda_llm(path: str, **kw: object) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)
    return LLM(path, device="cuda", **kw)


def _gen(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(MOE_ARCHS))
def test_moe_greedy_matches_transformers_cuda(ckpt_dir, prompts, name: str, mode: str) -> None:
    path = moe_ckpt(ckpt_dir, name)
    refs = [hf_greedy(path, p, GREEDY.max_tokens) for p in prompts]
    llm = cuda_llm(path, **MODES[mode])
    assert _gen(llm, prompts) == refs
    if mode == "preempt":
        assert llm.engine.stats.num_preemptions > 0


@pytest.mark.parametrize("name", list(MOE_ARCHS))
def test_moe_bf16_graphs_equal_eager_and_track_transformers(ckpt_dir, prompts, name) -> None:
    import transformers as tf

    path = moe_ckpt(ckpt_dir, name)
    graphs = _gen(cuda_llm(path, dtype="bfloat16"), prompts)
    eager = _gen(cuda_llm(path, dtype="bfloat16", enforce_eager=True), prompts)
    assert graphs == eager
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        first = [int(hf(torch.tensor([p], device="cuda")).logits[0, -1].argmax()) for p in prompts]
    assert [g[0] for g in graphs] == first


ROUTER_VARIANTS = [  # ops/moe_router.py's non-default paths: the k-rounds choice (fallback),
    {"moe_route_topk_sort": False},
    {"moe_route_softmax_topk": False},  # renormalized softmax routers by the full softmax
]


@pytest.mark.parametrize("variant", ROUTER_VARIANTS, ids=str)
@pytest.mark.parametrize("name", list(MOE_ARCHS))
def test_moe_router_variants_greedy(ckpt_dir, prompts, name: str, variant: dict) -> None:
    """Under each non-default router path, bf16 greedy decode in CUDA graphs equals
    enforce_eager token for token, and float32 matches transformers."""
    with override(**variant):
        _router_variant_greedy(ckpt_dir, prompts, name)


def _router_variant_greedy(ckpt_dir, prompts, name: str) -> None:
    path = moe_ckpt(ckpt_dir, name)
    graphs = _gen(cuda_llm(path, dtype="bfloat16"), prompts)
    eager = _gen(cuda_llm(path, dtype="bfloat16", enforce_eager=True), prompts)
    assert graphs == eager
    refs = [hf_greedy(path, p, GREEDY.max_tokens) for p in prompts[:2]]
    assert _gen(cuda_llm(path), prompts[:2]) == refs


@pytest.mark.parametrize("k", [1, 3])
def test_glm_mtp_greedy_equivalence_cuda(ckpt_dir, tmp_path, prompts, k: int) -> None:
    path = append_mtp_layers(moe_ckpt(ckpt_dir, "glm4_moe"), str(tmp_path / "glm_mtp"))
    ref = _gen(cuda_llm(path), prompts)
    llm = cuda_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    assert _gen(llm, prompts) == ref


def test_speculators_eagle3_on_moe_cuda(ckpt_dir, tmp_path, prompts) -> None:
    target = moe_ckpt(ckpt_dir, "qwen3_moe")
    head = write_speculators_eagle3(str(tmp_path / "head"), aux=[0, 1, 2])
    ref = _gen(cuda_llm(target), prompts)
    llm = cuda_llm(target, speculative_config={"method": "eagle3", "model": head})
    assert _gen(llm, prompts) == ref
