"""Tensor parallelism on CUDA: TP = 2 over NCCL, one GPU a rank, gives TP = 1's greedy tokens
for dense, MoE, MLA and gpt-oss targets and every drafter of the CPU tests
(tests/test_tensor_parallel.py), with the engine's CUDA defaults: CUDA graphs with the NCCL
collectives captured inside them, async scheduling and the start-up warm-up. Rank 0 (this
process) is checked to replay its graphs while serving; every step the engine compares the
tokens each rank sampled (SPECSERVE_TP_CHECK). One TP = 4 case needs 4 GPUs; one bf16 run
checks that TP = 2 serves and its ranks agree.

Run with `pytest -m gpu tests/test_tensor_parallel_gpu.py` on a machine with 2 or more GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch

from specserve import LLM
from specserve.engine.tp_executor import TPExecutor

from .mla_utils import mla_ckpt  # noqa: F401 - fixture
from .spec_utils import (
    write_eagle,
    write_eagle3,
    write_mtp_target,
    write_multi_mtp_target,
    write_ptd_eagle3,
)
from .test_gpt_oss import gpt_oss_ckpt
from .test_gpu import _no_tf32  # noqa: F401 - autouse fixture: TF32 off in rank 0's process
from .test_tensor_parallel import (
    DENSE,
    DRAFTERS,
    GLM4_MOE,
    GREEDY,
    PROMPTS,
    QWEN3_MOE,
    generate,
    spec_config,
    tp_check,  # noqa: F401 - fixture
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and torch.cuda.device_count() >= 2),
        reason="needs 2 CUDA GPUs (tensor_parallel_size 2 puts one rank on each)",
    ),
    pytest.mark.usefixtures("tp_check"),
]

# NOTE: float32 (TF32 off; the workers start with torch's default, off too) for the equivalence
# tests. Under TP every row-parallel matmul (o_proj, down_proj, the experts' down projection)
# becomes per-rank partial products that NCCL's all-reduce sums, in a different order than
# TP = 1's one matmul (and the sharded shapes may take other cuBLAS kernels). In bf16 a one-ulp
# difference there can flip the near-tied argmaxes of these random tiny weights; in fp32 it stays
# far below the logit gaps, so greedy tokens can be compared for equality. The CPU tests
# compare fp32 as well: they pass no dtype, and dtype "auto" is float32 on CPU
# (config/engine.py resolve_dtype). max_num_seqs 4: graphs for batches 1, 2 and 4 only (the
# three prompts replay batch 4), a short start-up per engine.
CUDA_FP32: dict[str, Any] = dict(device="cuda", dtype="float32", max_num_seqs=4)

# Targets of the CPU test (same checkpoint names and overrides, so conftest's session cache
# writes each once) and gpt-oss (sinks, alternating sliding / full layers, biased experts with
# the clamped SwiGLU, which the Triton MoE kernels run inside the graphs).
TARGETS: dict[str, Callable[[Callable[..., str]], str]] = {
    "qwen2_dense": lambda ckpt_dir: ckpt_dir("tp_qwen2", "qwen2", **DENSE),
    "qwen3_moe": lambda ckpt_dir: ckpt_dir("tp_qwen3_moe", "qwen3_moe", **QWEN3_MOE),
    "glm4_moe": lambda ckpt_dir: ckpt_dir("tp_glm4_moe", "glm4_moe", **GLM4_MOE),
    "gpt_oss": gpt_oss_ckpt,
}
# Drafters whose drafting runs in rank 0's draft graphs on every decode step: not n-gram
# (host drafts, and requests that found none make the batch non-uniform, so some steps run
# eagerly) nor the adaptive budget (it may choose K = 0, no drafting, for every step).
DRAFT_GRAPHS = set(DRAFTERS) - {"ngram", "eagle3_adaptive"}


@dataclass
class TPRun:
    """One TP engine's greedy tokens, and how often rank 0 replayed CUDA graphs while serving
    them (the warm-up at start-up, which replays them too, is not counted)."""

    tokens: list[list[int]]
    # target forwards replayed (CudaGraphRunner.replay)
    target_replays: int
    # drafting replayed (DraftGraphRunner.run)
    draft_replays: int


def _counting(cls: type, name: str) -> Any:
    """A patch of `cls.name` in this process (rank 0) that counts its calls and keeps its
    behaviour (autospec passes `self` on)."""
    return mock.patch.object(cls, name, autospec=True, side_effect=getattr(cls, name))


def generate_tp(path: str, tp: int, **kw: Any) -> TPRun:
    """The CPU test's `generate` at tensor_parallel_size `tp` >= 2 on CUDA (CUDA_FP32 unless
    `kw` overrides it), checking that rank 0 captured graphs and compares the ranks' tokens."""
    from specserve.worker.cudagraph import CudaGraphRunner
    from specserve.worker.draft_graphs import DraftGraphRunner

    with LLM(path, tensor_parallel_size=tp, max_model_len=128, **{**CUDA_FP32, **kw}) as llm:
        runner = llm.engine.runner
        assert isinstance(runner, TPExecutor) and len(runner.procs) == tp - 1
        assert runner.check  # tp_check: SPECSERVE_TP_CHECK reached the engine
        # Rank 0's own ModelRunner (through the executor) captured its graphs at start-up.
        assert runner.cudagraphs is not None and (1, 4) in runner.cudagraphs.graphs
        with (
            _counting(CudaGraphRunner, "replay") as target,
            _counting(DraftGraphRunner, "run") as draft,
        ):
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    tokens = [o.outputs[0].token_ids for o in outs]
    return TPRun(tokens, target.call_count, draft.call_count)


def assert_tp2_equals_tp1(path: str) -> None:
    """fp32 greedy tokens at TP = 2 equal TP = 1's; rank 0's decode steps replayed graphs."""
    ref = generate(path, 1, **CUDA_FP32)
    run = generate_tp(path, 2)
    assert run.tokens == ref
    assert run.target_replays > 0


@pytest.mark.parametrize("target", list(TARGETS))
def test_target_tp2_equals_tp1(ckpt_dir: Callable[..., str], target: str) -> None:
    """Dense (qkv biases, one KV head replicated on both ranks, tied embeddings, a vocabulary
    whose last shard is padded), Qwen3-MoE, GLM-4-MoE (grouped router, shared expert) and
    gpt-oss (sinks split by heads, expert biases): TP = 2 in CUDA graphs gives TP = 1's tokens."""
    assert_tp2_equals_tp1(TARGETS[target](ckpt_dir))


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_no_q_lora"])
def test_mla_tp2_equals_tp1(mla_ckpt: Callable[[str], str], name: str) -> None:  # noqa: F811
    """MLA (q / kv_b / o by heads, the latent cache replicated), with and without q LoRA:
    TP = 2 in CUDA graphs gives TP = 1's tokens."""
    assert_tp2_equals_tp1(mla_ckpt(name))


@pytest.fixture(scope="module")
def drafters(
    ckpt_dir: Callable[..., str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The CPU test's drafter checkpoints under `spec_config`'s keys, over its llama target
    (4 query heads, 2 KV heads), and that target's plain TP = 1 fp32 tokens on CUDA ("ref")."""
    root = tmp_path_factory.mktemp("tp_gpu_drafters")
    target = ckpt_dir("llama_gqa", "llama")
    heads = {"eagle": write_eagle, "eagle3": write_eagle3, "ptd": write_ptd_eagle3}
    setup: dict[str, Any] = {name: write(str(root / name)) for name, write in heads.items()}
    setup.update(
        target=target,
        draft_model=ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
        mtp=write_mtp_target(target, str(root / "mtp_target")),
        mtp2=write_multi_mtp_target(target, str(root / "mtp2"), 2, seed=3),
    )
    setup["ref"] = generate(target, 1, **CUDA_FP32)
    return setup


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_drafter_tp2_equals_tp1_plain(drafters: dict[str, Any], name: str) -> None:
    """Every drafter of the CPU test (draft model, EAGLE, EAGLE-3 sharded and whole, PTD, MTP,
    multi-layer MTP, n-gram, the adaptive budget, draft trees; K = 3): speculative greedy
    decoding at TP = 2 gives plain TP = 1 decoding's tokens; rank 0 verified in target graphs
    and, for the device drafters at a fixed K, drafted in draft graphs."""
    cfg, target = spec_config(drafters, name)
    run = generate_tp(target, 2, speculative_config=cfg)
    assert run.tokens == drafters["ref"]
    if name != "ngram":
        assert run.target_replays > 0
    if name in DRAFT_GRAPHS:
        assert run.draft_replays > 0


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
def test_eagle3_tp4_equals_tp1_plain(drafters: dict[str, Any]) -> None:
    """A larger group: EAGLE-3 at TP = 4 gives plain TP = 1 decoding's tokens, in graphs.

    No overrides needed: the target and the EAGLE-3 head have 4 query heads (one a rank) and
    2 KV heads, fewer than the ranks, so ranks 0-1 keep KV head 0 and ranks 2-3 KV head 1
    (rank r keeps r // 2: replicated and split at once, which no TP = 2 run does); the MLPs'
    128 intermediate rows split evenly, and the vocabularies (384 target, 160 draft) need no
    padding. DENSE would fit TP = 4 too (one query head a rank, its one KV head on all four),
    but the EAGLE-3 head (spec_utils.write_eagle3) maps its draft tokens into a 384-token
    target vocabulary, and DENSE has 385."""
    cfg, target = spec_config(drafters, "eagle3")
    run = generate_tp(target, 4, speculative_config=cfg)
    assert run.tokens == drafters["ref"]
    assert run.target_replays > 0 and run.draft_replays > 0


def test_bf16_tp2_serves_in_graphs(ckpt_dir: Callable[..., str]) -> None:
    """bf16, the CUDA default dtype, on the dense target: TP = 2 serves from CUDA graphs, every
    request gets its max_tokens tokens and every step the ranks sampled the same tokens
    (tp_check raises otherwise). Not compared with TP = 1: in bf16 the all-reduce's order of
    summation may flip a near-tied argmax (see CUDA_FP32)."""
    run = generate_tp(TARGETS["qwen2_dense"](ckpt_dir), 2, dtype="bfloat16")
    assert [len(t) for t in run.tokens] == [GREEDY.max_tokens] * len(PROMPTS)
    assert run.target_replays > 0
