"""Draft graphs draft the eager loop's bits at a padded batch and q not a power of two (issue
23): 5 requests x (1 + K = 3) tokens replay the graphs of 8 (24 rows vs 15 eagerly), in bf16
where tile shapes change the rounding. Run with `pytest -m gpu`."""

from __future__ import annotations

import os

import pytest
import torch

from specserve import LLM, SamplingParams

from .conftest import random_prompts
from .draft_utils import drafts_per_step
from .spec_utils import write_eagle3, write_multi_mtp_target, write_ptd_eagle3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def paths(ckpt_dir, tmp_path_factory) -> dict[str, str]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("draft_rows")
    target = ckpt_dir("llama_gqa", "llama")
    return {
        "target": target,
        "eagle3": write_eagle3(os.path.join(root, "eagle3")),
        "ptd": write_ptd_eagle3(os.path.join(root, "ptd")),
        "mtp2": write_multi_mtp_target(target, os.path.join(root, "mtp2"), 2, seed=3),
    }


@pytest.mark.parametrize("method", ["eagle3", "ptd", "mtp2"])
def test_draft_graphs_equal_eager_drafting_padded_bf16(paths: dict, method: str) -> None:
    k = 2
    target, cfg = (
        paths["target"],
        {"method": "eagle3", "num_speculative_tokens": k, "adaptive": False},
    )
    if method == "eagle3":
        cfg["model"] = paths["eagle3"]
    elif method == "ptd":
        cfg.update(model=paths["ptd"], parallel_draft=True)
    else:
        target, cfg = (
            paths["mtp2"],
            {"method": "mtp", "num_speculative_tokens": k, "adaptive": False},
        )
    prompts = random_prompts(5, 5, 60, seed=7)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for mode in ("auto", "eager"):
        llm = LLM(
            target, device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=8,
            speculative_config=cfg, draft_graph_mode=mode,
        )  # fmt: skip
        assert (llm.engine.runner.draft_graphs is None) == (mode == "eager")
        runs[mode] = drafts_per_step(llm, prompts, sp)
    assert runs["auto"] == runs["eager"]
