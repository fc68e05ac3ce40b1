"""Triton paged attention over draft trees (CommonAttentionMetadata's tree fields, the kernel's
TREE variant) vs the torch reference backend on the same metadata, under the Triton interpreter
(`TRITON_INTERPRET=1 pytest -m interpret tests/test_tree_attention_kernel.py`): chain-shaped,
wide and EAGLE-2 style trees, a batch mixing a tree with a decode and a prefill chunk, split KV,
sliding windows shorter than the context (and than the tree), sinks, GQA, bf16, fp32 and fp8
caches; `pytest -m gpu` runs the comparison at real head sizes over long contexts. Also what
refuses a tree: the fused RoPE + KV write, MLA, the in-place advance."""

from __future__ import annotations

import dataclasses
from typing import Any
from unittest import mock

import pytest
import torch

from specserve.attention.backend import CommonAttentionMetadata
from specserve.attention.kv_quant import quantize_kv_ref
from specserve.attention.torch_ref import TorchAttentionBackend
from specserve.spec_decode.tree import NO_TREE

from .test_triton_attention import (
    Pages,
    _backend,
    alloc_pages,
    interpreter,  # noqa: F401 - fixture
    make_common,
    needs_cuda,
    needs_interpreter,
    random_inputs,
    real_tokens,
    rel_err,
    tolerance,
)

# Parent of each draft node 1..N (node 0 is the root; parents come before their children).
CHAIN = [0, 1, 2, 3, 4]
WIDE = [0] * 7
# topk 3, depth 4: three children of the root, the best frontier expanded at each level.
EAGLE2 = [0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 8, 3, 6, 10]


@dataclasses.dataclass
class Req:
    cached: int  # keys before this step
    plain: int = 0  # this step's plain causal tokens (a prefill chunk or a decode)
    tree: list[int] | None = None  # parents of the draft nodes after them (a tree of 1 + N)

    @property
    def query_len(self) -> int:
        return self.plain + (len(self.tree) + 1 if self.tree is not None else 0)


def interpreted(fn: Any) -> Any:
    """An interpreter test (needs_interpreter) run under the `interpreter` fixture."""
    return needs_interpreter(pytest.mark.usefixtures("interpreter")(fn))


def tree_common(
    pages: Pages, reqs: list[Req], num_pad_reqs: int = 1, device: str = "cpu"
) -> CommonAttentionMetadata:
    """make_common's batch with each request's last 1 + N tokens its tree, as
    spec_decode/tree.target_tree_metadata lays it out: node m at key root + m, rotary position
    root + depth(m), ancestor-or-self bits; every other token (padding too) plain causal."""
    pad_q = max(r.query_len for r in reqs)
    qlens = [(r.cached, r.query_len) for r in reqs]
    common = make_common(pages, qlens, num_pad_reqs, pad_q, device)
    rows: list[tuple[int, int, int]] = []  # (tree_start, tree_mask, rotary position) a token
    for r in reqs:
        rows += [(NO_TREE, 0, p) for p in range(r.cached, r.cached + r.plain)]
        if r.tree is not None:
            root = r.cached + r.plain
            depth, anc = [0], [1]
            for m, parent in enumerate(r.tree, start=1):
                depth.append(depth[parent] + 1)
                anc.append(anc[parent] | (1 << m))
            rows += [(root, anc[m], root + depth[m]) for m in range(len(anc))]
    rows += [(NO_TREE, 0, p) for p in common.positions[len(rows) :].tolist()]
    start, mask, rope = (torch.tensor(x, device=device) for x in zip(*rows))
    return dataclasses.replace(common, tree_start=start, tree_mask=mask, tree_positions=rope)


def compare_tree(
    reqs: list[Req],
    heads: tuple[int, int],
    window: int | None,
    dtype: torch.dtype,
    num_splits: int | None = None,
    sinks: bool = False,
    kv_dtype: torch.dtype | None = None,
    head_dim: int = 16,
    device: str = "cpu",
) -> None:
    """The Triton backend's forward equals the torch backend's on the same tree metadata, and
    writes the same cache. `num_splits` forces split KV; `kv_dtype` an fp8 cache."""
    gen = torch.Generator().manual_seed(len(reqs) * 7 + (window or 0))
    pages = alloc_pages([r.cached + r.query_len for r in reqs], gen)
    common = tree_common(pages, reqs, device=device)
    q, k, v, cache = random_inputs(common, pages.num_blocks, *heads, head_dim, dtype, device, gen)
    kw: dict = {}
    if sinks:
        kw["sinks"] = torch.randn(heads[0], generator=gen).to(device)
    if kv_dtype is not None:
        scales = torch.tensor([0.05, 0.02], device=device)
        cache = torch.stack(
            [quantize_kv_ref(cache[i].float(), scales[i], kv_dtype) for i in (0, 1)]
        )
        kw["kv_scales"] = scales
    scale = head_dim**-0.5
    ref_b, tri = TorchAttentionBackend(), _backend()
    ref_cache = cache.clone()
    ref = ref_b.forward(q, k, v, ref_cache, ref_b.build(common, window), scale, window, **kw)
    from specserve.attention import launch_policy

    choose = (lambda *a: num_splits) if num_splits else launch_policy._num_splits
    with mock.patch.object(launch_policy, "_num_splits", choose):
        out = tri.forward(q, k, v, cache, tri.build(common, window), scale, window, **kw)
    real = real_tokens(common)
    err = rel_err(out[real], ref[real])
    tol = tolerance(dtype) if kv_dtype is None else 2e-2
    assert err < tol, f"relative error {err:.2e}"
    # The reference also writes padding into the null block's last slot; the kernel skips it.
    assert torch.equal(cache[:, :-1].view(torch.uint8), ref_cache[:, :-1].view(torch.uint8))


@interpreted
@pytest.mark.parametrize(
    "tree,cached,window,dtype",
    [
        (CHAIN, 37, None, torch.float32),
        # Tree keys skip the window: the last q-block's window starts a key tile past the root.
        (list(range(20)), 62, 3, torch.float32),
        (WIDE, 37, 12, torch.bfloat16),
        (EAGLE2, 37, None, torch.bfloat16),
    ],
    ids=["chain", "deep-chain-short-window", "wide-window", "eagle2"],
)
def test_tree_shapes_interpreter(
    tree: list[int], cached: int, window: int | None, dtype: torch.dtype
) -> None:
    compare_tree([Req(cached, tree=tree), Req(20, tree=WIDE[:3])], (4, 2), window, dtype)


# A tree, a decode, a prefill chunk, and a request whose chunk ends in a tree.
MIXED = [Req(30, tree=EAGLE2), Req(45, plain=1), Req(9, plain=20), Req(26, plain=3, tree=CHAIN)]


@interpreted
@pytest.mark.parametrize(
    "heads,window,dtype,splits,sinks",
    [
        ((4, 1), 12, torch.float32, None, False),
        ((6, 2), None, torch.bfloat16, 2, True),  # group 3: padded BLOCK_M rows
        ((4, 2), 12, torch.float32, 4, True),
        ((4, 2), 20, torch.bfloat16, 4, False),
    ],
)
def test_mixed_batch_interpreter(
    heads: tuple[int, int],
    window: int | None,
    dtype: torch.dtype,
    splits: int | None,
    sinks: bool,
) -> None:
    compare_tree(MIXED, heads, window, dtype, splits, sinks)


@interpreted
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_interpreter(kv_dtype: torch.dtype) -> None:
    compare_tree(MIXED[:2], (4, 2), 12, torch.float32, 2, True, kv_dtype, head_dim=32)


# Long contexts (many key tiles) around an EAGLE-2 tree, a decode, a prefill chunk, a chain.
LONG = [Req(700, tree=EAGLE2), Req(1500, plain=1), Req(90, plain=64), Req(300, plain=3, tree=CHAIN)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "heads,head_dim,window,dtype,splits,sinks,kv_dtype",
    [
        ((32, 8), 128, None, torch.bfloat16, None, False, None),
        ((32, 8), 128, 256, torch.bfloat16, 8, False, None),
        ((64, 8), 64, 128, torch.bfloat16, 4, True, None),  # gpt-oss: sinks, windows
        ((8, 8), 128, 256, torch.float32, 2, True, None),
        ((32, 8), 128, 256, torch.bfloat16, 4, True, torch.float8_e4m3fn),
    ],
)
def test_tree_gpu(
    heads: tuple[int, int],
    head_dim: int,
    window: int | None,
    dtype: torch.dtype,
    splits: int | None,
    sinks: bool,
    kv_dtype: torch.dtype | None,
) -> None:
    compare_tree(LONG, heads, window, dtype, splits, sinks, kv_dtype, head_dim, "cuda")


@interpreted
def test_rope_path_interpreter() -> None:
    """A tree step's layer passes RoPE by tree_positions: the backend rotates and writes with
    the RoPE + KV write kernel (never the fused attention kernel, which turns by positions)."""
    from specserve.attention.paged_attention import paged_attention
    from specserve.ops.fused import rope_ref

    gen = torch.Generator().manual_seed(3)
    reqs = [Req(21, tree=[0, 0, 1]), Req(40, plain=1)]
    pages = alloc_pages([r.cached + r.query_len for r in reqs], gen)
    common = tree_common(pages, reqs)
    q, k, v, cache = random_inputs(common, pages.num_blocks, 4, 2, 16, torch.float32, "cpu", gen)
    ang = torch.arange(128).float()[:, None] * 10000 ** (-torch.arange(8).float() / 8)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = common.tree_positions
    ref_b, tri = TorchAttentionBackend(), _backend()
    ref_cache = cache.clone()
    qr, kr = rope_ref(rot, q, cos, sin), rope_ref(rot, k, cos, sin)
    ref = ref_b.forward(qr, kr, v, ref_cache, ref_b.build(common, 8), 0.25, 8)
    out = tri.forward(
        q.clone(), k.clone(), v, cache, tri.build(common, 8), 0.25, 8, rope=(rot, cos, sin)
    )
    real = real_tokens(common)
    assert rel_err(out[real], ref[real]) < 1e-3
    with pytest.raises(ValueError, match="draft tree"):
        paged_attention(q, cache, common, 0.25, 8, new_kv=(k, v, cos, sin))


def test_tree_refusals() -> None:
    """Paths without tree masks refuse a tree instead of attending causally: MLA (both
    backends' mla_forward) and the Triton backend's in-place advance."""
    from specserve.attention.mla import mla_forward

    pytest.importorskip("triton")
    from specserve.attention.triton_paged import TritonAttentionBackend

    gen = torch.Generator().manual_seed(0)
    pages = alloc_pages([12], gen)
    common = tree_common(pages, [Req(8, tree=[0, 0, 1])])
    x = torch.zeros(common.num_tokens, 2, 8)
    with pytest.raises(ValueError, match="draft-tree"):
        mla_forward(common.positions, x, x[:, 0], None, x, common)  # type: ignore[arg-type]
    backend = TritonAttentionBackend()
    assert backend.supports_tree
    with pytest.raises(ValueError, match="cannot advance"):
        backend.advance_decode_(backend.build(common, None), 16)
