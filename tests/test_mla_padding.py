"""MLA numerics do not depend on graph padding: a uniform decode / verification batch
of B requests x q tokens, run as the eager step runs it (B rows, the batch's own metadata) and as
its captured graph runs it (padded to the next capture size: padded rows at positions 0..q-1,
slot -1, null-block tables, max_seq_len = max_model_len), gives bitwise the same real rows and
the same written latent cache. Every size-dependent choice of attention/mla*.py (split count,
the fused-vs-torch switch, the key tile) must come from sizes both runs share: the token count
bounded by `graph_rows.row_bound` (the eager step runs in `uniform_batch(B, bg)`, the capture in
`uniform_batch(bg, bg)`, as worker/cudagraph.py sets them) and max_model_len."""

from __future__ import annotations

import pytest
import torch

from specserve.attention.backend import CommonAttentionMetadata
from specserve.ops.graph_rows import row_bound, uniform_batch

from .test_mla_triton import _batch, _prologue_inputs
from .test_triton_attention import interpreter, needs_interpreter  # noqa: F401

MAX_MODEL_LEN = 512  # the split_len the engine passes (tests/test_mla_triton.py's GPU model test)
# the tiny GLM-4.7-Flash of tests/mla_utils.py: heads, nope, kv_lora_rank, rope, v
HEADS, NOPE, LORA, ROPE, V = 4, 16, 32, 8, 16
PAGE = 4


def _padded(c: CommonAttentionMetadata, bg: int, null_block: int) -> CommonAttentionMetadata:
    """`c` (a uniform batch) as CudaGraphRunner fills its buffers for padded batch `bg`."""
    B, q, T = c.num_reqs, c.max_query_len, c.num_tokens
    tg = bg * q
    ar = torch.arange(tg)
    table = torch.full((bg, c.block_table.shape[1]), null_block, dtype=torch.int32)
    table[:B] = c.block_table
    slots = torch.full((tg,), -1, dtype=torch.int64)
    slots[:T] = c.slot_mapping
    positions = ar % q
    positions[:T] = c.positions
    seq_lens = torch.full((bg,), q, dtype=torch.int32)
    seq_lens[:B] = c.seq_lens
    return CommonAttentionMetadata(
        query_start_loc=(torch.arange(bg + 1) * q).to(torch.int32),
        seq_lens=seq_lens,
        positions=positions,
        block_table=table,
        slot_mapping=slots,
        token_req=ar // q,
        num_reqs=bg,
        num_tokens=tg,
        max_query_len=q,
        max_seq_len=MAX_MODEL_LEN,
    )


# (B, q, bg): the GPU model test's batch of 3 (decode, and K = 3 verification) padded to 4;
# K = 2 at B = 5 (15 real tokens, 24 padded: fused vs torch path and 8 vs 4 splits before the
# token bound); a batch of 9 padded to 16; 20 verification tokens padded to 32 (torch path).
CASES = [(3, 1, 4), (3, 4, 4), (5, 3, 8), (9, 1, 16), (5, 4, 8)]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,q,bg", CASES)
def test_mla_forward_padded_equals_eager_interpreter(interpreter, B, q, bg, dtype) -> None:  # noqa: F811
    from specserve.attention.mla import mla_forward

    g = torch.Generator().manual_seed(B * 10 + q)
    seq_lens = torch.randint(q, 90, (B,), generator=g).tolist()
    _, _, cache, c = _batch([q] * B, seq_lens, HEADS, LORA, ROPE, PAGE, dtype, "cpu", seed=B)
    null_block = cache.shape[0] - 1  # _batch leaves the last block unused
    cg = _padded(c, bg, null_block)
    # Padded rows' inputs are whatever the graph's buffers hold: random here.
    q_all, kv_a_all, w = _prologue_inputs(cg.num_tokens, HEADS, NOPE, LORA, ROPE, V, "cpu")
    w.w_uk, w.w_uv = w.w_uk.to(dtype), w.w_uv.to(dtype)
    w.kv_norm_weight = w.kv_norm_weight.to(dtype)
    q_all, kv_a_all = q_all.to(dtype), kv_a_all.to(dtype)
    T = c.num_tokens
    eager_cache, graph_cache = cache.clone(), cache.clone()
    with uniform_batch(B, bg):  # as the runner's eager_rows sets it
        eager = mla_forward(
            c.positions, q_all[:T], kv_a_all[:T], w, eager_cache, c, True, MAX_MODEL_LEN
        )
    with uniform_batch(bg, bg):  # as the graph capture sets it
        graph = mla_forward(cg.positions, q_all, kv_a_all, w, graph_cache, cg, True, MAX_MODEL_LEN)
    assert eager.shape == (T, HEADS, V)
    assert torch.equal(graph[:T], eager)
    # Padded rows write no real block (the torch path sends slot -1 to the null block's last
    # row, which nothing reads as a key: every table entry past a context is masked).
    assert torch.equal(graph_cache[:null_block], eager_cache[:null_block])


def test_mla_choices_same_for_graph_and_eager() -> None:
    """Host-side choices over every batch a graph may stand for: the eager step (B requests,
    in `eager_rows`) and its padded graph (bg, in `uniform_batch(bg, bg)`) take the same path
    and split count, for any query length; outside a uniform batch the bound is the count."""
    pytest.importorskip("triton")
    from specserve.attention.mla_triton import mla_split_count
    from specserve.tunables import tunables
    from specserve.worker.cudagraph import capture_sizes, eager_rows

    cpu = torch.device("cpu")

    def choices(tokens: int) -> tuple:
        bound = row_bound(tokens)
        assert bound >= tokens
        splits = [
            mla_split_count(bound, head_blocks, split_len, cpu)
            for head_blocks, split_len in ((1, 512), (2, 4096), (8, 32768))
        ]
        return bound <= tunables().mla_fuse_max_tokens, splits

    for max_num_seqs in (1, 3, 6, 20, 100, 256):
        sizes = capture_sizes(max_num_seqs)
        for b in range(1, max_num_seqs + 1):
            bg = next(s for s in sizes if s >= b)
            for q in range(1, 9):
                with eager_rows(b, b * q, q, max_num_seqs):
                    eager = choices(b * q)
                with uniform_batch(bg, bg):
                    graph = choices(bg * q)
                assert eager == graph, (b, bg, q)
    # 5 requests x 3 tokens: 15 tokens take the fused path, their graph's 24 do not; the
    # bound is what makes the test above fail-able.
    assert 15 <= tunables().mla_fuse_max_tokens < 24
    with uniform_batch(5, 8):
        assert row_bound(15) == 24
