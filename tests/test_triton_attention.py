"""Triton paged attention vs the torch reference backend on the same random paged caches.

GPU tests run with `pytest -m gpu`. The interpreter tests run the same comparison on CPU when
triton is installed and TRITON_INTERPRET=1 is set (slow, so they stay small).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import pytest
import torch

from specserve.attention.backend import CommonAttentionMetadata
from specserve.attention.torch_ref import TorchAttentionBackend
from specserve.tunables import override, tunables

if TYPE_CHECKING:
    from specserve.attention.triton_paged import TritonAttentionBackend

BLOCK_SIZE = 16

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
_no_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run on CPU"
)


def needs_interpreter(fn: Any) -> Any:
    """`make test` runs these in a second pass: TRITON_INTERPRET=1 pytest -m interpret."""
    return pytest.mark.interpret(_no_interpreter(fn))


def _backend() -> TritonAttentionBackend:
    # Deferred import: CPU CI without triton skips instead of failing at collection.
    pytest.importorskip("triton")
    from specserve.attention.triton_paged import TritonAttentionBackend

    return TritonAttentionBackend()


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run kernels under the Triton (3.6) interpreter, working around two of its bugs.

    1. It holds scalars as 1-element arrays and converts them with int(array), which numpy >= 2.3
       rejects: `range(start, end)` with tensor bounds fails.
    2. It keeps bf16 as raw uint16 and tl.dot multiplies those integers: widen them to fp32.
    (conftest.py's `interpreter_builtin_lists` spares every interpreter test one of its costs.)
    """
    pytest.importorskip("triton")
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    patch_tensor = ti._patch_lang_tensor

    def patch_lang_tensor(tensor: type, scope: ti._LangPatchScope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    create_dot = ti.InterpreterBuilder.create_dot

    def widen(h: ti.TensorHandle) -> ti.TensorHandle:
        if h.dtype != tl.bfloat16:
            return h
        return ti.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot_bf16(
        self: object, a: ti.TensorHandle, b: ti.TensorHandle, *args: object
    ) -> ti.TensorHandle:
        return create_dot(self, widen(a), widen(b), *args)

    monkeypatch.setattr(ti, "_patch_lang_tensor", patch_lang_tensor)
    monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", create_dot_bf16)


@dataclass
class Pages:
    # [num_reqs, max_blocks] int32, shuffled physical pages; unused columns hold the null block
    block_table: torch.Tensor
    num_blocks: int  # including the null block, which is the last one

    @property
    def null_block(self) -> int:
        return self.num_blocks - 1


def alloc_pages(capacities: list[int], gen: torch.Generator, spare_cols: int = 1) -> Pages:
    """Give each request enough shuffled pages for `capacities[i]` tokens."""
    need = [(c + BLOCK_SIZE - 1) // BLOCK_SIZE for c in capacities]
    total = sum(need)
    null = total + 3  # a few never-used pages, then the null block
    perm = torch.randperm(total + 3, generator=gen)
    table = torch.full((len(capacities), max(need) + spare_cols), null, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return Pages(table, null + 1)


def make_common(
    pages: Pages,
    # (num_cached, query_len) per real request
    reqs: list[tuple[int, int]],
    num_pad_reqs: int = 0,
    pad_query_len: int = 1,
    device: str = "cpu",
) -> CommonAttentionMetadata:
    """Real requests, then padded rows shaped like the CUDA-graph runner's (null pages, slot -1)."""
    qlens = [q for _, q in reqs] + [pad_query_len] * num_pad_reqs
    seq_lens = [c + q for c, q in reqs] + [pad_query_len] * num_pad_reqs
    pad_rows = torch.full((num_pad_reqs, pages.block_table.shape[1]), pages.null_block)
    block_table = torch.cat([pages.block_table, pad_rows.to(torch.int32)])
    positions, slots, token_req = [], [], []
    for r, (cached, q) in enumerate(reqs):
        for p in range(cached, cached + q):
            positions.append(p)
            blk = int(block_table[r, p // BLOCK_SIZE])
            slots.append(blk * BLOCK_SIZE + p % BLOCK_SIZE)
            token_req.append(r)
    for r in range(len(reqs), len(qlens)):
        positions += list(range(pad_query_len))
        slots += [-1] * pad_query_len
        token_req += [r] * pad_query_len
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        token_req=torch.tensor(token_req, dtype=torch.int64, device=device),
        num_reqs=len(qlens),
        num_tokens=len(positions),
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
    )


def random_inputs(
    common: CommonAttentionMetadata,
    num_blocks: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T = common.num_tokens

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    q = randn(T, num_heads, head_dim)
    k = randn(T, num_kv_heads, head_dim)
    v = randn(T, num_kv_heads, head_dim)
    # Random prior context everywhere; the null block stays zero (nothing may read garbage).
    kv_cache = randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    kv_cache[:, -1] = 0
    return q, k, v, kv_cache


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 2e-2


def real_tokens(common: CommonAttentionMetadata) -> torch.Tensor:
    return common.slot_mapping >= 0


def compare_with_reference(
    reqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int | None,
    dtype: torch.dtype,
    device: str,
    num_pad_reqs: int = 1,
    seed: int = 0,
    num_splits: int | None = None,
) -> None:
    """`num_splits` forces the split-KV path (None: the launcher's own choice)."""
    gen = torch.Generator().manual_seed(seed)
    pages = alloc_pages([c + q for c, q in reqs], gen)
    pad_q = max(q for _, q in reqs)
    common = make_common(pages, reqs, num_pad_reqs, pad_q, device)
    q, k, v, kv_cache = random_inputs(
        common, pages.num_blocks, num_heads, num_kv_heads, head_dim, dtype, device, gen
    )
    scale = head_dim**-0.5
    ref_backend, backend = TorchAttentionBackend(), _backend()
    ref_cache = kv_cache.clone()
    ref = ref_backend.forward(q, k, v, ref_cache, ref_backend.build(common, window), scale, window)
    from unittest import mock

    from specserve.attention import launch_policy

    choose = launch_policy._num_splits
    with mock.patch.object(
        launch_policy, "_num_splits", (lambda *a: num_splits) if num_splits else choose
    ):
        out = backend.forward(q, k, v, kv_cache, backend.build(common, window), scale, window)
    real = real_tokens(common)
    err = rel_err(out[real], ref[real])
    assert err < tolerance(dtype), f"relative error {err:.2e}"
    # The reference also writes padding into the null block's last slot; the kernel skips it.
    torch.testing.assert_close(kv_cache[:, :-1], ref_cache[:, :-1], rtol=0, atol=0)
    assert not kv_cache[:, -1].any(), "padding tokens must not write KV"


# A mixed batch: a fresh prefill, prefill chunks on top of cached context, plain decodes and
# 5-token verification queries, with contexts well past the sliding window below.
MIXED = [(0, 37), (50, 20), (70, 1), (33, 1), (90, 5), (15, 5), (200, 1), (130, 64)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)])
def test_mixed_batch_gpu(
    heads: tuple[int, int], head_dim: int, window: int | None, dtype: torch.dtype
) -> None:
    compare_with_reference(MIXED, *heads, head_dim, window, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize(
    "reqs",
    [
        [(0, 300)],  # one long prefill: many q-blocks and KV tiles
        [(c, 1) for c in range(0, 640, 37)],  # decode only
        [(c, 5) for c in range(3, 400, 51)],  # verification only
    ],
    ids=["prefill", "decode", "verify"],
)
def test_uniform_batches_gpu(
    reqs: list[tuple[int, int]], window: int | None, dtype: torch.dtype
) -> None:
    compare_with_reference(reqs, 32, 8, 128, window, dtype, "cuda", num_pad_reqs=3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("splits", [2, 8, 16])
@pytest.mark.parametrize(
    "reqs",
    [[(3000, 1)], [(c, 1) for c in range(0, 640, 97)], [(c, 5) for c in range(3, 900, 251)], MIXED],
    ids=["long-decode", "decode", "verify", "mixed"],
)
def test_split_kv_gpu(
    reqs: list[tuple[int, int]], splits: int, window: int | None, dtype: torch.dtype
) -> None:
    """Split-KV (flash-decoding) attention equals the reference, empty splits included."""
    compare_with_reference(reqs, 32, 8, 128, window, dtype, "cuda", 2, num_splits=splits)


def test_split_choice() -> None:
    """Splits only where the grid leaves SMs idle and keys are many; a power of two <= 16."""
    pytest.importorskip("triton")
    from specserve.attention.launch_policy import _num_splits

    cpu = torch.device("cpu")  # counted as 132 SMs
    assert _num_splits(16, 8192, cpu) == 8  # batch-1 decode, 8 KV heads, long context
    assert _num_splits(2, 100_000, cpu) == 16
    assert _num_splits(16, 400, cpu) == 4  # short contexts split too: >= 64 keys a split
    assert _num_splits(16, 100, cpu) == 1  # fewer than two splits' worth of keys
    assert _num_splits(512, 8192, cpu) == 1  # the grid already fills the GPU
    assert _num_splits(40, 4096, cpu) == 2


def test_key_loop_pipeline_depth_choice() -> None:
    """Decode / verification tiles walking a request's whole key range take the deep key
    pipeline; split launches (batch 1) and prefill tiles keep 2 stages."""
    pytest.importorskip("triton")
    from specserve.attention.launch_policy import launch_config

    decode = launch_config(4, 1, 128, torch.bfloat16)  # Llama-3-8B decode: 16 rows
    verify = launch_config(4, 5, 128, torch.bfloat16)  # K = 4 verification: 32 rows
    prefill = launch_config(4, 512, 128, torch.bfloat16)  # 128 rows
    assert decode.stages(1) == verify.stages(1) == tunables().attn_num_stages == 5
    assert decode.stages(16) == verify.stages(2) == 2
    assert prefill.stages(1) == 2


def test_split_count_same_for_graph_and_eager() -> None:
    """A captured graph (padded batch in `uniform_batch(bg, bg)`, max_model_len) and the eager
    step it stands for (the real batch, in the runner's `eager_rows`) choose the same split
    count, so they compute the same bits."""
    pytest.importorskip("triton")
    from specserve.attention.launch_policy import split_count
    from specserve.ops.graph_rows import uniform_batch
    from specserve.worker.cudagraph import capture_sizes, eager_rows

    cpu = torch.device("cpu")
    for max_num_seqs in (1, 3, 20, 100, 256):
        sizes = capture_sizes(max_num_seqs)
        for b in range(1, max_num_seqs + 1):
            bg = next(s for s in sizes if s >= b)  # the graph a batch of b replays
            for q, block_q, kv_heads in ((1, 4, 8), (5, 4, 8), (3, 4, 2), (8, 32, 2)):
                for max_len in (400, 4096, 32768):
                    with eager_rows(b, b * q, q, max_num_seqs):
                        eager = split_count(b * q, b, block_q, kv_heads, max_len, cpu)
                    with uniform_batch(bg, bg):
                        graph = split_count(bg * q, bg, block_q, kv_heads, max_len, cpu)
                    assert eager == graph, (max_num_seqs, b, q, max_len)
    # Without the bound the counts differ: 3 decode requests are 3 q-blocks (24 programs over 8
    # KV heads: 4 splits), their graph of 4 has 5 (40 programs: 2 splits).
    assert split_count(3, 3, 4, 8, 4096, cpu) == 4
    assert split_count(4, 4, 4, 8, 4096, cpu) == 2
    assert split_count(1, 1, 4, 8, 4096, cpu) == 16  # batch-1 decode at max_model_len 4096
    assert split_count(1, 1, 4, 8, 400, cpu) == 4
    assert split_count(4, 4, 4, 8, 4096, cpu) == 2  # 5 q-blocks x 8 KV heads
    assert split_count(64, 64, 4, 8, 32768, cpu) == 1  # the grid fills the GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", [(28, 4), (12, 4)])  # Qwen2-7B-like group 7; group 3
def test_non_power_of_two_group_gpu(heads: tuple[int, int]) -> None:
    compare_with_reference(MIXED, *heads, 128, 24, torch.bfloat16, "cuda")


@needs_interpreter
@pytest.mark.parametrize(
    "dtype,window,heads,head_dim",
    [
        (torch.float32, None, (4, 1), 32),
        (torch.float32, 12, (2, 2), 16),
        (torch.bfloat16, 12, (6, 2), 16),  # group 3: padded BLOCK_M rows
    ],
)
def test_mixed_batch_interpreter(
    interpreter: None,
    dtype: torch.dtype,
    window: int | None,
    heads: tuple[int, int],
    head_dim: int,
) -> None:
    reqs = [(0, 21), (30, 9), (40, 1), (17, 5), (70, 1)]
    compare_with_reference(reqs, *heads, head_dim, window, dtype, "cpu", num_pad_reqs=1)


@needs_interpreter
@pytest.mark.parametrize(
    "dtype,window,splits",
    [(torch.float32, None, 4), (torch.float32, 12, 2), (torch.bfloat16, 12, 4)],
)
def test_split_kv_interpreter(
    interpreter: None,
    dtype: torch.dtype,
    window: int | None,
    splits: int,
) -> None:
    """Split-KV on CPU: short contexts leave some splits empty (m = -inf, l = 0), merged by
    the combine kernel."""
    reqs = [(0, 21), (30, 9), (40, 1), (17, 5), (70, 1)]
    compare_with_reference(reqs, 4, 2, 16, window, dtype, "cpu", 1, num_splits=splits)


@needs_interpreter
@pytest.mark.parametrize("tile", [16, 32])
def test_split_small_tiles_interpreter(interpreter: None, tile: int) -> None:
    """Split launches with smaller key tiles (tunables attn_split_block_n) at a 128-wide head:
    the reference's output, and with the RoPE + KV write and qk-norm fused (Qwen3's path) the
    unfused kernels' bits."""
    with override(attn_split_block_n=tile):
        reqs = [(0, 21), (30, 9), (40, 1), (17, 5), (70, 1)]
        compare_with_reference(reqs, 4, 2, 128, None, torch.bfloat16, "cpu", 1, num_splits=4)
        _check_fused_kv_write("cpu", torch.bfloat16, (4, 2), 128, None, 4, qk_norm=True)


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_combine_splits_interpreter(interpreter: None, splits: int) -> None:
    """The split-KV merge kernel equals its torch reference, empty splits (m = -inf, l = 0)
    and rows with nothing visible at all included."""
    pytest.importorskip("triton")
    from specserve.attention.split_merge import combine_splits, combine_splits_ref

    g = torch.Generator().manual_seed(5)
    T, H, D = 5, 3, 16
    ws_acc = torch.randn(T, H, splits, D, generator=g)
    ws_m = torch.randn(T, H, splits, generator=g) * 4
    ws_l = torch.rand(T, H, splits, generator=g) + 0.5
    ws_m[1, :, 0] = float("-inf")  # an empty split
    ws_l[1, :, 0] = 0.0
    ws_acc[1, :, 0] = 0.0
    ws_m[2], ws_l[2], ws_acc[2] = float("-inf"), 0.0, 0.0  # every split empty
    out = torch.empty(T, H, D)
    combine_splits(out, ws_acc, ws_m, ws_l)
    torch.testing.assert_close(out, combine_splits_ref(ws_acc, ws_m, ws_l))
    assert not out[2].any()


# ---- advance_decode_ ----------------------------------------------------------------------------
DECODE = [(5, 1), (15, 1), (16, 1), (47, 1), (100, 1)]  # crosses page boundaries on advance


def _assert_same_metadata(a: object, b: object) -> None:
    for f in fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "common":
            _assert_same_metadata(x, y)
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif f.name != "max_seq_len":  # a host-side upper bound only
            assert x == y, f.name


@pytest.mark.parametrize("window", [None, 8])
def test_advance_decode_matches_fresh_build(window: int | None) -> None:
    backend = _backend()
    gen = torch.Generator().manual_seed(1)
    pages = alloc_pages([c + 4 for c, _ in DECODE], gen)
    meta = backend.build(make_common(pages, DECODE, num_pad_reqs=2), window)
    for step in range(1, 4):
        backend.advance_decode_(meta, BLOCK_SIZE)
        fresh = make_common(pages, [(c + step, 1) for c, _ in DECODE], num_pad_reqs=2)
        # Padded rows are advanced too; they stay inert because their slot stays -1.
        fresh.positions[len(DECODE) :] += step
        fresh.seq_lens[len(DECODE) :] += step
        _assert_same_metadata(meta, backend.build(fresh, window))
        assert meta.common.max_seq_len >= int(meta.common.seq_lens.max())


def _advance_then_attend(device: str, window: int | None, dtype: torch.dtype) -> None:
    """Attention after advance_decode_ equals the reference on freshly built metadata."""
    backend, ref_backend = _backend(), TorchAttentionBackend()
    gen = torch.Generator().manual_seed(2)
    pages = alloc_pages([c + 4 for c, _ in DECODE], gen)
    meta = backend.build(make_common(pages, DECODE, 1, 1, device), window)
    common = meta.common
    q, k, v, kv_cache = random_inputs(common, pages.num_blocks, 8, 2, 32, dtype, device, gen)
    ref_cache = kv_cache.clone()
    for step in range(1, 3):
        backend.advance_decode_(meta, BLOCK_SIZE)
        out = backend.forward(q, k, v, kv_cache, meta, 0.2, window)
        fresh = make_common(pages, [(c + step, 1) for c, _ in DECODE], 1, 1, device)
        ref = ref_backend.forward(q, k, v, ref_cache, ref_backend.build(fresh, window), 0.2, window)
        real = real_tokens(common)
        assert rel_err(out[real], ref[real]) < tolerance(dtype)
        torch.testing.assert_close(kv_cache[:, :-1], ref_cache[:, :-1], rtol=0, atol=0)


@needs_interpreter
def test_advance_then_attend_interpreter(interpreter: None) -> None:
    _advance_then_attend("cpu", 8, torch.float32)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 8])
def test_advance_then_attend_gpu(window: int | None) -> None:
    _advance_then_attend("cuda", window, torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 8])
def test_cuda_graph_advance_and_attend(window: int | None) -> None:
    """advance_decode_ + forward captured in one graph; each replay matches eager reference."""
    backend, ref_backend = _backend(), TorchAttentionBackend()
    gen = torch.Generator().manual_seed(3)
    pages = alloc_pages([c + 4 for c, _ in DECODE], gen)
    common = make_common(pages, DECODE, 2, 1, "cuda")
    meta = backend.build(common, window)
    q, k, v, kv_cache = random_inputs(
        common, pages.num_blocks, 32, 8, 128, torch.bfloat16, "cuda", gen
    )
    saved = [t.clone() for t in (common.positions, common.seq_lens, common.slot_mapping, kv_cache)]
    ref_cache = kv_cache.clone()

    def step() -> torch.Tensor:
        backend.advance_decode_(meta, BLOCK_SIZE)
        return backend.forward(q, k, v, kv_cache, meta, 0.1, window)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for dst, src in zip((common.positions, common.seq_lens, common.slot_mapping, kv_cache), saved):
        dst.copy_(src)
    real = real_tokens(common)
    for i in range(1, 4):
        graph.replay()
        fresh = make_common(pages, [(c + i, 1) for c, _ in DECODE], 2, 1, "cuda")
        ref = ref_backend.forward(q, k, v, ref_cache, ref_backend.build(fresh, window), 0.1, window)
        assert rel_err(out[real], ref[real]) < tolerance(torch.bfloat16)
        torch.testing.assert_close(kv_cache[:, :-1], ref_cache[:, :-1], rtol=0, atol=0)


# ---- RoPE fused into the KV write ---------------------------------------------------------------
def _check_rope_and_cache(device: str, dtype: torch.dtype, heads: tuple[int, int], d: int) -> None:
    """rope_and_cache_ leaves q and the cache bit-equal to the RoPE kernel followed by the KV
    write (q, k as strided views into one qkv tensor; padding slots write nothing), and close to
    the torch reference."""
    from specserve.attention.kv_write import reshape_and_cache
    from specserve.attention.rope_kv_write import rope_and_cache_, rope_and_cache_ref
    from specserve.ops.fused import rope_ref
    from specserve.ops.triton_kernels import rope_triton_

    hq, hk = heads
    g = torch.Generator().manual_seed(7)
    T, num_blocks = 11, 6
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(dtype).to(device)
    positions = torch.randint(0, 60, (T,), generator=g).to(device)
    slots = torch.randperm((num_blocks - 1) * BLOCK_SIZE, generator=g)[:T]
    slots[[2, 7]] = -1
    slots = slots.to(device)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(64, dtype=torch.float32), inv)
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(device) for f in (torch.cos, torch.sin))

    def views(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = x.split([hq * d, hk * d, hk * d], dim=-1)
        return q.view(T, hq, d), k.view(T, hk, d), v.view(T, hk, d)

    cache = torch.randn(2, num_blocks, BLOCK_SIZE, hk, d, generator=g).to(dtype).to(device)
    fused_x, fused_cache = qkv.clone(), cache.clone()
    q, k, v = views(fused_x)
    rope_and_cache_(positions, q, k, v, cos, sin, fused_cache, slots)
    assert torch.equal(views(fused_x)[1], views(qkv)[1])  # k itself is left as it was

    two_x, two_cache = qkv.clone(), cache.clone()
    q2, k2, v2 = views(two_x)
    rope_triton_(positions, q2, k2, cos, sin)
    reshape_and_cache(k2, v2, two_cache, slots)
    assert torch.equal(q, q2) and torch.equal(fused_cache, two_cache)

    ref_x, ref_cache = qkv.clone(), cache.clone()
    q0, k0, v0 = views(ref_x)
    rope_and_cache_ref(positions, q0, k0, v0, cos, sin, ref_cache, slots)
    q0 = views(qkv.clone())[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        q.float(), rope_ref(positions, q0, cos, sin).float(), atol=tol, rtol=tol
    )
    torch.testing.assert_close(fused_cache.float(), ref_cache.float(), atol=tol, rtol=tol)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 16), ((6, 2), 32)])
def test_rope_and_cache_interpreter(
    interpreter: None, dtype: torch.dtype, heads: tuple[int, int], head_dim: int
) -> None:
    _check_rope_and_cache("cpu", dtype, heads, head_dim)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((28, 4), 64)])
def test_rope_and_cache_gpu(dtype: torch.dtype, heads: tuple[int, int], head_dim: int) -> None:
    _check_rope_and_cache("cuda", dtype, heads, head_dim)


# ---- RoPE + KV write inside the attention kernel (tunables attn_fuse_rope_kv) ---------------
def _check_fused_kv_write(
    device: str,
    dtype: torch.dtype,
    heads: tuple[int, int],
    d: int,
    window: int | None,
    splits: int,
    qk_norm: bool = False,
) -> None:
    """paged_attention(new_kv=...) == rope_and_cache_ then paged_attention: the same cache (every
    new key written once, by the program whose key range holds it; padded rows write nothing)
    and the same outputs, for decode and 4-token verification requests. qk_norm: Qwen3's
    per-head RMSNorm fused too (paged_attention(qk_norm=...)) == the qk-norm kernel first."""
    from specserve.attention.paged_attention import paged_attention
    from specserve.attention.rope_kv_write import rope_and_cache_
    from specserve.ops.triton_kernels import qk_norm_triton_

    hq, hk = heads
    g = torch.Generator().manual_seed(11 + splits)
    reqs = [(37, 1), (20, 4), (50, 1), (5, 4), (0, 1)]
    pages = alloc_pages([c + q for c, q in reqs], g)
    common = make_common(pages, reqs, 1, 4, device)
    T = common.num_tokens
    qkv = (3 * torch.randn(T, (hq + 2 * hk) * d, generator=g)).to(dtype).to(device)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(T, hq, d), k.view(T, hk, d), v.view(T, hk, d)
    cache = torch.randn(2, pages.num_blocks, BLOCK_SIZE, hk, d, generator=g).to(dtype).to(device)
    cache[:, -1] = 0
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(64, dtype=torch.float32), inv)
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(device) for f in (torch.cos, torch.sin))
    scale = d**-0.5
    norm = None
    if qk_norm:
        qw, kw = ((1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(device) for _ in "qk")
        norm = (qw, kw, 1e-6, 1e-5)

    two_q, two_k = q.clone(), k.clone()
    if qk_norm:
        qk_norm_triton_(two_q, two_k, *norm)
    two_cache = cache.clone()
    rope_and_cache_(common.positions, two_q, two_k, v, cos, sin, two_cache, common.slot_mapping)
    two = paged_attention(two_q, two_cache, common, scale, window, num_splits=splits)
    one_cache = cache.clone()
    one = paged_attention(
        q, one_cache, common, scale, window, num_splits=splits, new_kv=(k, v, cos, sin),
        qk_norm=norm,
    )  # fmt: skip
    real = real_tokens(common)
    if device == "cpu":  # the interpreter computes both the same way, bit for bit
        assert torch.equal(one_cache, two_cache)
        assert torch.equal(one[real], two[real])
    else:
        torch.testing.assert_close(one_cache.float(), two_cache.float(), atol=1e-6, rtol=1e-2)
        assert rel_err(one[real], two[real]) < tolerance(dtype)


@needs_interpreter
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("splits", [1, 2])
def test_fused_kv_write_interpreter(interpreter: None, window: int | None, splits: int) -> None:
    _check_fused_kv_write("cpu", torch.float32, (4, 2), 16, window, splits)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_qk_norm_interpreter(interpreter: None, dtype: torch.dtype) -> None:
    """The norm weights loaded with the metadata, before the PDL wait: the unfused kernels'
    bits."""
    _check_fused_kv_write("cpu", dtype, (4, 2), 16, None, 2, qk_norm=True)
    with pytest.raises(ValueError, match="qk_norm is fused only with new_kv"):
        from specserve.attention.paged_attention import paged_attention

        q = torch.zeros(1, 4, 16)
        paged_attention(q, None, None, 1.0, None, qk_norm=(q, q, 1e-6, 1e-6))  # type: ignore


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("splits", [1, 4])
def test_fused_kv_write_gpu(dtype: torch.dtype, window: int | None, splits: int) -> None:
    _check_fused_kv_write("cuda", dtype, (32, 8), 128, window, splits)
    if dtype == torch.bfloat16:  # Qwen3-30B-A3B's heads: 32 q / 4 kv of 128, qk-norm fused
        _check_fused_kv_write("cuda", dtype, (32, 4), 128, window, splits, qk_norm=True)
