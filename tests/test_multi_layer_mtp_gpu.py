"""Multi-layer MTP drafting captured in CUDA graphs (one graph per target graph for the whole
module chain) proposes exactly the drafts of the eager chain. Run with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams

from .conftest import random_prompts
from .draft_utils import drafts_per_step
from .mla_utils import mla_ckpt  # noqa: F401 - fixture
from .spec_utils import append_mtp_layers, write_multi_mtp_target

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="module")
def targets(mla_ckpt, ckpt_dir, tmp_path_factory) -> dict[str, str]:  # noqa: F811
    root = tmp_path_factory.mktemp("mtp_graphs")
    return {
        "deepseek_v3": append_mtp_layers(mla_ckpt("deepseek_v3"), str(root / "ds"), 3, seed=3),
        "llama": write_multi_mtp_target(
            ckpt_dir("llama_gqa", "llama"), str(root / "llama"), 3, seed=4
        ),
    }


def _llm(path: str, k: int, mode: str, sampled: bool = False) -> LLM:
    # A fixed K: the adaptive budget's choices follow each mode's own step timings, and these
    # tests compare drafts step by step.
    spec: dict = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}
    if sampled:
        spec["draft_sample_method"] = "probabilistic"
        spec["rejection_sample_method"] = "probabilistic"
    # max_num_seqs 4: graphs for batches 1, 2, 4; three requests replay batch 4 (one padded row).
    return LLM(
        path, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=4,
        speculative_config=spec, draft_graph_mode=mode,
    )  # fmt: skip


def _count_runs(dg) -> list[int]:  # noqa: ANN001
    """Record each replay of the draft graphs (the run keeps its behaviour)."""
    calls: list[int] = []
    run = dg.run

    def counted(*a, **kw) -> None:  # noqa: ANN002, ANN003
        calls.append(1)
        run(*a, **kw)

    dg.run = counted
    return calls


@pytest.mark.parametrize("name", ["deepseek_v3", "llama"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_multi_layer_graph_gives_eager_drafts(targets: dict, name: str, k: int) -> None:
    """Greedy: after every step, every request's tokens and its K drafts are identical with
    the module chain captured (auto) and eager; the captured run replayed its graphs."""
    from specserve.spec_decode.multi_layer_mtp import MultiLayerMTPSpeculator

    prompts = random_prompts(3, 5, 60, seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    runs = {}
    for mode in ("auto", "eager"):
        llm = _llm(targets[name], k, mode)
        assert isinstance(llm.engine.speculator, MultiLayerMTPSpeculator)
        dg = llm.engine.runner.draft_graphs
        assert (dg is None) == (mode == "eager")
        if dg is not None:
            assert ("prefill", k + 1, 4) in dg.graphs
            replays = _count_runs(dg)
        runs[mode] = drafts_per_step(llm, prompts, sp)
        if dg is not None:
            assert len(replays) > 10
    assert runs["auto"] == runs["eager"]
    # End to end with graphs: speculative greedy output equals no speculation.
    batch = [{"prompt_token_ids": p} for p in prompts]
    ref = LLM(targets[name], device="cuda", dtype="float32", max_model_len=256, max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in ref.generate(batch, sp)]
    got = [o.outputs[0].token_ids for o in _llm(targets[name], k, "auto").generate(batch, sp)]
    assert got == want


def test_multi_layer_graph_sampled_drafts(targets: dict) -> None:
    """Probabilistic drafting (seeded): the captured chain draws the same drafts as eager."""
    prompts = random_prompts(3, 5, 60, seed=6)
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    runs = {
        mode: drafts_per_step(_llm(targets["deepseek_v3"], 3, mode, sampled=True), prompts, sp)
        for mode in ("auto", "eager")
    }
    assert runs["auto"] == runs["eager"]
