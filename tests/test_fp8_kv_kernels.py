"""fp8 KV cache kernels against their torch references under the Triton interpreter
(`TRITON_INTERPRET=1 pytest -m interpret tests/test_fp8_kv_kernels.py`): the KV writes store the
reference's bits (kv_write.fp8_quantize rounds as torch's cast does), and paged attention over
an fp8 cache (prefill, decode, verification, split KV, sliding windows, sinks, the fused RoPE +
KV write) matches the torch reference's dequantized attention."""

from __future__ import annotations

import pytest
import torch

from specserve.attention.kv_quant import quantize_kv_ref
from specserve.attention.torch_ref import TorchAttentionBackend

from .test_triton_attention import (
    _backend,
    alloc_pages,
    interpreter,  # noqa: F401 - fixture
    make_common,
    needs_interpreter,
    real_tokens,
    rel_err,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = torch.tensor([0.05, 0.02])


def _fp8_inputs(common, num_blocks, heads, kv_heads, head_dim, dtype, kv_dtype, gen):
    T = common.num_tokens
    q = torch.randn(T, heads, head_dim, generator=gen).to(dtype)
    # Values spanning the normal and subnormal fp8 range after the division by the scales.
    k = (torch.randn(T, kv_heads, head_dim, generator=gen) * 3).to(dtype)
    v = (torch.randn(T, kv_heads, head_dim, generator=gen) * 0.5).to(dtype)
    ctx = torch.randn(2, num_blocks, 16, kv_heads, head_dim, generator=gen)
    cache = torch.stack([quantize_kv_ref(ctx[i], SCALES[i], kv_dtype) for i in range(2)])
    cache[:, -1] = 0
    return q, k, v, cache


def _compare(reqs, heads, kv_heads, head_dim, window, dtype, kv_dtype, num_splits=None,
             sinks=False, rope=False):  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    pages = alloc_pages([c + q for c, q in reqs], gen)
    common = make_common(pages, reqs, 1, max(q for _, q in reqs))
    q, k, v, cache = _fp8_inputs(common, pages.num_blocks, heads, kv_heads, head_dim, dtype,
                                 kv_dtype, gen)  # fmt: skip
    scale = head_dim**-0.5
    kw: dict = {"kv_scales": SCALES.clone()}
    if sinks:
        kw["sinks"] = torch.randn(heads, generator=gen)
    ref_b, tri = TorchAttentionBackend(), _backend()
    ref_cache = cache.clone()
    q_ref, k_ref = q, k
    if rope:
        from specserve.ops.fused import rope_ref

        half = torch.arange(0, head_dim // 2).float()
        ang = torch.arange(1024).float()[:, None] * (10000 ** (-half / (head_dim // 2)))
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        q_ref = rope_ref(common.positions, q, cos, sin)
        k_ref = rope_ref(common.positions, k, cos, sin)
        kw_t = {**kw, "rope": (common.positions, cos, sin)}
    else:
        kw_t = kw
    ref = ref_b.forward(q_ref, k_ref, v, ref_cache, ref_b.build(common, window), scale, window,
                        **kw)  # fmt: skip
    from unittest import mock

    from specserve.attention import launch_policy

    choose = launch_policy._num_splits
    with mock.patch.object(
        launch_policy, "_num_splits", (lambda *a: num_splits) if num_splits else choose
    ):
        out = tri.forward(q.clone(), k, v, cache, tri.build(common, window), scale, window, **kw_t)
    real = real_tokens(common)
    err = rel_err(out[real], ref[real])
    assert err < (2e-3 if dtype == torch.float32 else 2e-2), f"relative error {err:.2e}"
    # Same bits in the cache as the reference's quantized write (the null block aside).
    assert torch.equal(cache[:, :-1].view(torch.uint8), ref_cache[:, :-1].view(torch.uint8))
    assert not cache[:, -1].view(torch.uint8).any(), "padding tokens must not write KV"


MIXED = [(0, 37), (50, 20), (70, 1), (33, 1), (90, 5), (130, 16)]


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_fp8(interpreter, kv_dtype, dtype) -> None:  # noqa: F811
    _compare(MIXED, 4, 2, 32, None, dtype, kv_dtype)


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", FP8)
def test_window_and_sinks_fp8(interpreter, kv_dtype) -> None:  # noqa: F811
    _compare(MIXED, 4, 2, 32, 24, torch.float32, kv_dtype, sinks=True)


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("reqs", [[(200, 1), (90, 1)], [(150, 4), (60, 4)]])
def test_split_kv_fp8(interpreter, kv_dtype, reqs) -> None:  # noqa: F811
    _compare(reqs, 4, 2, 32, None, torch.float32, kv_dtype, num_splits=4)


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("reqs", [[(40, 1), (70, 1)], [(40, 4), (70, 4)], [(0, 30), (20, 9)]])
def test_rope_kv_write_fp8(interpreter, kv_dtype, reqs) -> None:  # noqa: F811
    """Decode and verification batches take the attention kernel's fused RoPE + KV write; the
    prefill batch the RoPE + KV write kernel."""
    _compare(reqs, 4, 2, 32, None, torch.float32, kv_dtype, rope=True)


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_fp8_bits(interpreter, kv_dtype, dtype) -> None:  # noqa: F811
    from specserve.attention.kv_write import reshape_and_cache, reshape_and_cache_ref

    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(64, 2, 32, generator=gen) * 4).to(dtype)
    v = (torch.randn(64, 2, 32, generator=gen) * 1e-3).to(dtype)  # subnormals
    k[0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, -0.0])  # clamped, signed zeros
    slots = torch.randperm(80, generator=gen)[:64]
    slots[5] = -1
    out = torch.zeros(2, 6, 16, 2, 32, dtype=kv_dtype)
    ref = out.clone()
    reshape_and_cache(k, v, out, slots, SCALES)
    keep = slots >= 0
    reshape_and_cache_ref(k[keep], v[keep], ref, slots[keep], SCALES)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
