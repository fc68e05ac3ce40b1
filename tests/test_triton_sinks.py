"""Attention sinks (gpt-oss) in the Triton paged kernel vs the torch reference: per-head sink
logits with and without a sliding window, unsplit and split-KV (combine kernel or in-kernel
merge), mixed prefill / decode / verification batches with padded rows."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from specserve.attention.torch_ref import TorchAttentionBackend

from .test_triton_attention import (  # noqa: F401 - interpreter is a fixture
    _backend,
    alloc_pages,
    interpreter,
    make_common,
    needs_cuda,
    needs_interpreter,
    random_inputs,
    real_tokens,
    rel_err,
    tolerance,
)


def compare_sinks(
    reqs: list[tuple[int, int]],
    heads: tuple[int, int],
    head_dim: int,
    window: int | None,
    dtype: torch.dtype,
    device: str,
    num_splits: int,
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    pages = alloc_pages([c + q for c, q in reqs], gen)
    common = make_common(pages, reqs, 1, max(q for _, q in reqs), device)
    q, k, v, kv_cache = random_inputs(
        common, pages.num_blocks, *heads, head_dim, dtype, device, gen
    )
    # Sinks around the scores' scale: some rows give the sink most of the mass, some little.
    sinks = (torch.randn(heads[0], generator=gen) * 2).to(dtype=dtype, device=device)
    scale = head_dim**-0.5
    ref_backend, backend = TorchAttentionBackend(), _backend()
    ref_meta = ref_backend.build(common, window)
    ref = ref_backend.forward(q, k, v, kv_cache.clone(), ref_meta, scale, window, sinks=sinks)
    plain = ref_backend.forward(q, k, v, kv_cache.clone(), ref_meta, scale, window)
    from specserve.attention import launch_policy

    with mock.patch.object(launch_policy, "_num_splits", lambda *a: num_splits):
        meta = backend.build(common, window)
        out = backend.forward(q, k, v, kv_cache, meta, scale, window, sinks=sinks)
    real = real_tokens(common)
    assert rel_err(plain[real], ref[real]) > 0.05  # the sinks matter at these scales
    err = rel_err(out[real], ref[real])
    assert err < tolerance(dtype), f"relative error {err:.2e}"


@needs_interpreter
@pytest.mark.parametrize(
    "dtype,window,splits",
    [
        (torch.float32, None, 1),
        (torch.float32, 12, 1),
        (torch.float32, 12, 4),
        (torch.bfloat16, None, 2),
    ],
)
def test_sinks_interpreter(
    interpreter: None,  # noqa: F811
    dtype: torch.dtype,
    window: int | None,
    splits: int,
) -> None:
    """The sink logits loaded with the metadata, before the PDL wait."""
    reqs = [(0, 21), (30, 9), (40, 1), (17, 5), (70, 1)]
    compare_sinks(reqs, (4, 2), 16, window, dtype, "cpu", splits)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("splits", [1, 4])
def test_sinks_gpu(dtype: torch.dtype, window: int | None, splits: int) -> None:
    """gpt-oss-20b's attention shape: 64 query heads over 8 KV heads, head_dim 64."""
    reqs = [(0, 37), (50, 20), (70, 1), (300, 1), (90, 5), (200, 1), (130, 64)]
    compare_sinks(reqs, (64, 8), 64, window, dtype, "cuda", splits)
