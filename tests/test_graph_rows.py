"""Row-count-dependent kernel choices do not depend on graph padding.

A uniform batch of B requests x q tokens runs eagerly at B x q rows and, with CUDA graphs, in
the graph of the next capture size bg at bg x q rows. The decode matmul's plan bucket
(ops/gemv.py), the skinny row tile, the MoE decode/GEMM switch and grouped-GEMM config
(ops/moe_triton.py) are chosen from `graph_rows.row_bound`, which the runner sets for both
(worker/cudagraph.py `eager_rows` and the capture's `uniform_batch(bg, bg)`): host tests over
every capture size and 1..8 tokens per request, and an interpreter test that fused_moe's real
rows are bitwise equal at B x q and at bg x q rows.
"""

from __future__ import annotations

import pytest
import torch

from specserve.ops import gemv, graph_rows, skinny
from specserve.worker.cudagraph import capture_sizes, eager_rows, padded_size

from .test_moe_ops import make_moe
from .test_triton_attention import interpreter, needs_interpreter  # noqa: F401

TOKENS_PER_REQ = range(1, 9)


def _batches(max_num_seqs: int) -> list[tuple[int, int]]:
    """(B, bg) for every batch size up to max_num_seqs and the capture size it replays."""
    return [(b, padded_size(b, max_num_seqs)) for b in range(1, max_num_seqs + 1)]


def _choices(rows: int) -> tuple:
    """Every row-dependent choice, under whatever `uniform_batch` is active."""
    from specserve.ops import moe_triton

    bound = graph_rows.row_bound(rows)
    takes = bound <= skinny.MAX_M
    moe = [
        moe_triton.gemm_config(bound * top_k, e, dtype)
        for e in (8, 64, 128)
        for top_k in (2, 8)
        for dtype in (torch.bfloat16, torch.float32)
    ]
    return (
        bound,
        takes,
        gemv.bucket(gemv.plan_rows(rows)) if takes else None,
        skinny.block_m(min(bound, skinny.MAX_M)),
        moe_triton.uses_decode_path(rows),
        moe,
    )


@pytest.mark.parametrize("max_num_seqs", [3, 20, 64, 130])
def test_eager_choices_equal_graph_choices(max_num_seqs: int) -> None:
    pytest.importorskip("triton")
    sizes = capture_sizes(max_num_seqs)
    for B, bg in _batches(max_num_seqs):
        assert bg in sizes and bg >= B
        for q in TOKENS_PER_REQ:
            with eager_rows(B, B * q, q, max_num_seqs):
                eager = _choices(B * q)
            with graph_rows.uniform_batch(bg, bg):  # as CudaGraphRunner._run captures
                graph = _choices(bg * q)
            assert eager == graph, (B, bg, q)
            assert eager[0] == bg * q  # exactly the rows the graph runs


def test_bound_is_needed() -> None:
    """Without the bound the choices differ (the test above can fail): 5 requests x 3 tokens
    are 15 rows, their graph of 8 has 24."""
    assert gemv.bucket(15) != gemv.bucket(24)
    assert skinny.block_m(15) != skinny.block_m(24)
    with graph_rows.uniform_batch(5, 8):
        assert gemv.bucket(gemv.plan_rows(15)) == gemv.bucket(24) == 32


def test_no_bound_outside_uniform_batches() -> None:
    """Mixed / prefill batches (and anything outside a runner forward) keep their own rows."""
    assert graph_rows.row_bound(15) == 15
    with eager_rows(3, 7, 4, 64):  # 3 requests, 7 tokens: not uniform
        assert graph_rows.row_bound(7) == 7
    with eager_rows(5, 15, 3, 64):
        assert graph_rows.row_bound(15) == 24
    assert graph_rows.row_bound(15) == 15  # reset on exit
    with pytest.raises(ValueError, match="num_reqs <= padded_reqs"):
        with graph_rows.uniform_batch(9, 8):
            pass


# NOTE: the interpreter's tl.dot gives each row the same result whatever the tile, so this test
# checks that padded rows never leak into real ones; the GPU test below is the one that the
# unbounded choice fails (tile shapes change bf16 rounding there).
# (B, q, bg): 15 real tokens / 24 padded (2 pairs an expert at E = 8: gemm configs (16, 64, ..)
# vs (16, 128, ..) without the bound); a decode-path batch (6 / 8 tokens).
MOE_CASES = [(5, 3, 8), (3, 2, 4)]


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,q,bg", MOE_CASES)
def test_fused_moe_padded_equals_eager(B: int, q: int, bg: int, dtype: torch.dtype) -> None:
    from specserve.ops.moe_triton import fused_moe_triton

    T, tg = B * q, bg * q
    # The padded batch: the real tokens first, then padded rows with their own routing.
    x, w13, w2, topk_w, topk_ids = make_moe(tg, E=8, H=64, inter=32, top_k=2, dtype=dtype)
    with graph_rows.uniform_batch(B, bg):
        eager = fused_moe_triton(x[:T], w13, w2, topk_w[:T], topk_ids[:T])
    with graph_rows.uniform_batch(bg, bg):
        graph = fused_moe_triton(x, w13, w2, topk_w, topk_ids)[:T]
    assert torch.equal(eager, graph)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,q,bg", [*MOE_CASES, (5, 5, 8), (17, 3, 24)])
def test_fused_moe_padded_equals_eager_gpu(B: int, q: int, bg: int) -> None:
    """As the interpreter test, on the GPU in bf16 (where tile shapes change the rounding)."""
    from specserve.ops.moe_triton import fused_moe_triton

    T, tg = B * q, bg * q
    args = make_moe(tg, E=8, H=256, inter=128, top_k=2, dtype=torch.bfloat16, device="cuda")
    x, w13, w2, topk_w, topk_ids = args
    with graph_rows.uniform_batch(B, bg):
        eager = fused_moe_triton(x[:T], w13, w2, topk_w[:T], topk_ids[:T])
    with graph_rows.uniform_batch(bg, bg):
        graph = fused_moe_triton(*args)[:T]
    assert torch.equal(eager, graph)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,q,bg", [(5, 3, 8), (5, 5, 8), (3, 6, 4), (9, 6, 16)])
def test_decode_linear_padded_equals_eager_gpu(B: int, q: int, bg: int) -> None:
    """A DecodeLinear's real rows at B x q and at bg x q rows, bitwise (bf16, Triton plan)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 768, bias=False, device="cuda", dtype=torch.bfloat16)
    dl = gemv.DecodeLinear.sharing(lin)
    x = torch.randn(bg * q, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        with graph_rows.uniform_batch(B, bg):
            eager = dl(x[: B * q])
        with graph_rows.uniform_batch(bg, bg):
            graph = dl(x)[: B * q]
    assert torch.equal(eager, graph)


def _draft_choices(rows: int, num_reqs: int) -> tuple:
    """`_choices` plus the attention choices of a drafter forward over `rows` rows."""
    from specserve.attention.launch_policy import split_count
    from specserve.attention.mla_triton import mla_split_count
    from specserve.tunables import tunables

    cpu = torch.device("cpu")
    bound = graph_rows.row_bound(rows)
    return (
        _choices(rows),
        split_count(rows, num_reqs, 4, 8, 4096, cpu),
        split_count(rows, num_reqs, 16, 2, 400, cpu),
        bound <= tunables().mla_fuse_max_tokens,
        mla_split_count(bound, 2, 4096, cpu),
    )


# Rows per request of each drafter forward, for a target batch of q tokens per request: the
# EAGLE / EAGLE-3 prefill (q), one draft step (1), PTD's proposal (q + E slots, E = K - 1 here
# up to 7) and multi-layer MTP module k (q + k - 1 slots, k = 1..3).
def _draft_rows_per_req(q: int) -> list[int]:
    return sorted({q, 1, *(q + e for e in range(1, 8)), *(q + k - 1 for k in (1, 2, 3))})


@pytest.mark.parametrize("max_num_seqs", [3, 20, 64])
def test_draft_choices_equal_graph_choices(max_num_seqs: int) -> None:
    """Eager drafting of a uniform batch (the runner wraps `propose` in `eager_rows`) and the
    draft graphs of its padded batch (DraftGraphRunner bodies in `uniform_batch(bg, bg)`) choose
    every row-dependent kernel alike: matmul plan, skinny tile, MoE, attention splits, MLA."""
    pytest.importorskip("triton")
    for B, bg in _batches(max_num_seqs):
        for q in TOKENS_PER_REQ:
            for per_req in _draft_rows_per_req(q):
                with eager_rows(B, B * q, q, max_num_seqs):
                    eager = _draft_choices(B * per_req, B)
                with graph_rows.uniform_batch(bg, bg):
                    graph = _draft_choices(bg * per_req, bg)
                assert eager == graph, (B, bg, q, per_req)


def test_eager_drafting_runs_in_the_row_bound(ckpt_dir, tmp_path) -> None:  # noqa: ANN001
    """The CPU engine's eager drafting (multi-layer MTP, K = 2: q = 3) of a uniform batch of 5
    requests runs in `uniform_batch(5, 8)`, the padded batch a graph engine drafts for; a
    mixed batch (prefills) in none. Without the runner's wrapper it would see no bound."""
    from specserve import LLM, SamplingParams

    from .conftest import random_prompts
    from .spec_utils import write_multi_mtp_target

    target = write_multi_mtp_target(
        ckpt_dir("llama_gqa", "llama"), str(tmp_path / "mtp2"), 2, seed=3
    )
    llm = LLM(
        target,
        max_model_len=128,
        max_num_seqs=8,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    spec = llm.engine.speculator
    seen: list[tuple[int, int, int, tuple[int, int] | None]] = []
    propose = spec.propose

    def recorded(runner, t, **kw) -> None:  # noqa: ANN001, ANN003
        inp = t.inp
        seen.append((inp.num_reqs, inp.num_tokens, inp.max_query_len, graph_rows._UNIFORM.get()))
        propose(runner, t, **kw)

    spec.propose = recorded
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, 5, 30, seed=2)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    uniform = [s for s in seen if s[0] == 5 and s[1] == 5 * s[2]]
    assert uniform, seen
    assert all(s[3] == (5, 8) for s in uniform), seen
    assert all(s[3] is None for s in seen if s[1] != s[0] * s[2]), seen
