"""Fused hot-path kernels against their torch references (interpreter on CPU, or CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from specserve.ops import fused

from .test_triton_attention import interpreter  # noqa: F401  (fixture)

ON_CUDA = torch.cuda.is_available()
modes = [
    pytest.param(
        "cpu",
        marks=[
            pytest.mark.interpret,
            pytest.mark.skipif(
                os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
            ),
        ],
    ),
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")],
    ),
]


def _dtypes(device: str) -> list[torch.dtype]:
    # The interpreter holds bf16 as raw integers: fp16 stands in for it on the CPU.
    return [torch.float32, torch.float16] if device == "cpu" else [torch.float32, torch.bfloat16]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (a.float() - b.float()).norm() / b.float().norm()
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("device", modes)
@pytest.mark.parametrize("hidden", [64, 200])
def test_rms_norm(device: str, hidden: int) -> None:
    from specserve.ops.triton_kernels import rms_norm_triton

    for dtype in _dtypes(device):
        g = torch.Generator().manual_seed(hidden)
        x = torch.randn(7, hidden, generator=g).to(device, dtype)
        r = torch.randn(7, hidden, generator=g).to(device, dtype)
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
        out, none = rms_norm_triton(x, w, 1e-6, None)
        ref, _ = fused.rms_norm_ref(x, w, 1e-6)
        assert none is None
        _close(out, ref, dtype)
        out, res = rms_norm_triton(x, w, 1e-6, r)
        ref, ref_res = fused.rms_norm_ref(x, w, 1e-6, r)
        _close(out, ref, dtype)
        assert torch.equal(res, ref_res)


@pytest.mark.parametrize("device", modes)
@pytest.mark.parametrize("heads", [(4, 2), (6, 6)])
def test_rope_in_place_on_strided_views(device: str, heads: tuple[int, int]) -> None:
    from specserve.models.layers import RotaryEmbedding
    from specserve.ops.triton_kernels import rope_triton_

    hq, hk = heads
    dim = 32
    rope = RotaryEmbedding(dim, 128, 10000.0, None).to(device)
    for dtype in _dtypes(device):
        g = torch.Generator().manual_seed(hq)
        qkv = torch.randn(9, (hq + 2 * hk) * dim, generator=g).to(device, dtype)
        pos = torch.randint(0, 128, (9,), generator=g).to(device)
        q, k, _ = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)
        q, k = q.view(9, hq, dim), k.view(9, hk, dim)
        ref_q = fused.rope_ref(pos, q, rope.cos, rope.sin)
        ref_k = fused.rope_ref(pos, k, rope.cos, rope.sin)
        v_before = qkv[:, (hq + hk) * dim :].clone()
        rope_triton_(pos, q, k, rope.cos, rope.sin)
        _close(q, ref_q, dtype)
        _close(k, ref_k, dtype)
        assert torch.equal(qkv[:, (hq + hk) * dim :], v_before)  # v untouched


@pytest.mark.parametrize("device", modes)
@pytest.mark.parametrize("inter", [96, 1500])
def test_silu_and_mul(device: str, inter: int) -> None:
    from specserve.ops.triton_kernels import silu_and_mul_triton

    for dtype in _dtypes(device):
        x = torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        _close(silu_and_mul_triton(x), fused.silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("device", modes)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n, k, bias", [(40, 96, False), (257, 1000, True)])
def test_gemv(request, device: str, m: int, n: int, k: int, bias: bool) -> None:
    """The skinny-matmul kernel against its reference: ragged N and K tiles, M not a power of
    two, a strided activation view, with and without bias."""
    pytest.importorskip("triton")
    if device == "cpu":
        request.getfixturevalue("interpreter")  # its K loop has tensor bounds
    from specserve.ops.gemv import gemv, gemv_ref, gemv_silu_mul_ref

    g = torch.Generator().manual_seed(m * 7 + n)
    for dtype in _dtypes(device):
        x = torch.randn(m, 2 * k, generator=g).to(dtype=dtype, device=device)[:, ::2]
        w = torch.randn(n, k, generator=g).to(dtype=dtype, device=device)
        b = torch.randn(n, generator=g).to(dtype=dtype, device=device) if bias else None
        _close(gemv(x, w, b), gemv_ref(x, w, b), dtype)
        # The MLP's gate_up + SiLU-and-mul in one kernel: [2n, k] weights -> [m, n].
        w2 = torch.randn(2 * n, k, generator=g).to(dtype=dtype, device=device) / k**0.5
        b2 = torch.randn(2 * n, generator=g).to(dtype=dtype, device=device) if bias else None
        _close(gemv(x, w2, b2, silu_mul=True), gemv_silu_mul_ref(x, w2, b2), dtype)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.zeros(9, 4, device=device), torch.zeros(3, 4, device=device))


@pytest.mark.parametrize("device", modes)
def test_argmax(device: str) -> None:
    """ops.argmax (two-launch Triton reduction on CUDA, the kernels themselves here on CPU)
    equals torch.argmax: ragged vocabularies, ties across chunks (the first index wins), rows
    of -inf, a row whose max sits in the last partial chunk."""
    pytest.importorskip("triton")
    from specserve.ops.triton_kernels import argmax_triton

    g = torch.Generator().manual_seed(0)
    for vocab, block in ((100, 32), (1000, 128), (20000, 8192)):
        for dtype in _dtypes(device):
            x = torch.randn(5, vocab, generator=g).to(dtype=dtype, device=device)
            x[1, 3] = x[1, vocab - 2] = x[1].max() + 1  # a tie across chunks: 3 wins
            x[2] = float("-inf")
            x[3, vocab - 1] = 100.0  # in the last, partial chunk
            x[4, 7] = x[4, 8] = x[4].max() + 1  # a tie inside one chunk
            got = argmax_triton(x, block=block)
            assert got.dtype == torch.int64
            assert torch.equal(got.cpu(), x.float().argmax(-1).cpu()), (vocab, dtype)
    big = torch.randn(2, 20000, generator=g).to(device)
    assert torch.equal(fused.argmax(big).cpu(), big.argmax(-1).cpu())


@pytest.mark.parametrize("device", modes)
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_argmax_epilogue(request, device: str, m: int) -> None:
    """The lm_head gemv's greedy tokens (ops/greedy_head.py) equal the argmax of the logits it
    stores, over several steps on one key buffer: ties across programs and inside one (the
    first column wins), all-negative rows (negative floats order backwards in their bits), a
    -0.0 before a +0.0 max, a NaN row (NaN counts as +inf, as ops.argmax), a ragged last
    program; the keys are empty again after each take."""
    pytest.importorskip("triton")
    if device == "cpu":
        request.getfixturevalue("interpreter")
    from specserve.ops.gemv import KEY_EMPTY, gemv
    from specserve.ops.greedy_head import new_keys, take_tokens_, take_tokens_ref_

    n, k = 203, 64
    keys = new_keys(8, torch.device(device))
    g = torch.Generator().manual_seed(m)
    for dtype in _dtypes(device):
        for step in range(5):
            x = torch.randn(m, k, generator=g).to(dtype=dtype, device=device)
            w = torch.randn(n, k, generator=g).to(dtype=dtype, device=device)
            if step == 1:  # row 0: one weight row twice, in different programs (and adjacent)
                w[150] = w[40] = w[41] = w[(x[0].float() @ w.float().t()).argmax()] * 3
            if step in (2, 4):  # every logit of row 0 negative
                x[0] = x[0].abs()
                x[0, 0] = 0.25
                w = -w.abs() - 0.01
            if step == 4:  # ... but column 7's -0.0 and 9's +0.0
                w[7] = w[9] = 0.0
                # a quarter of the smallest subnormal: -0.0 once rounded to 16 bits
                w[7, 0] = -torch.finfo(dtype).tiny * torch.finfo(dtype).eps
            if step == 3 and m > 1:  # row 1 all NaN after row 0's; row 0 a NaN at column 5
                x[1, 0] = float("nan")
                w[5, 0] = float("nan")
            cfg = (4, 32, 1, 1) if step % 2 else (8, 64, 2, 1)
            y = gemv(x, w, None, config=cfg, argmax_keys=keys)
            ref = torch.where(y.float().isnan(), float("inf"), y.float()).argmax(-1)
            if step == 2:
                assert y[0].max() < 0
            if step == 4 and dtype != torch.float32 and device == "cpu":
                # (on CUDA the fp32 product may flush to zero: then no -0.0 to check)
                assert y[0, 7] == 0 and y[0, 7].signbit() and ref[0] == 7
            got = take_tokens_(keys[:m])
            assert torch.equal(got.cpu(), ref.cpu()), (dtype, step, got, ref)
            assert bool((keys == KEY_EMPTY).all())
        y = gemv(x, w, None, argmax_keys=keys)
        assert torch.equal(take_tokens_ref_(keys[:m].clone()).cpu(), ref.cpu())
        take_tokens_(keys[:m])
    with pytest.raises(ValueError, match="argmax keys"):
        gemv(x, w, None, argmax_keys=keys[: m - 1])


@pytest.mark.parametrize("device", modes)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_norm(request, device: str, m: int, with_residual: bool, silu_mul: bool) -> None:
    """RMSNorm (+ residual add) inside the gemv's K loop against norm-then-matmul: ragged K,
    bias, both outputs (the product and the new residual, written by program 0 alone)."""
    pytest.importorskip("triton")
    if device == "cpu":
        request.getfixturevalue("interpreter")
    from specserve.ops import fused
    from specserve.ops.gemv import gemv_norm, gemv_norm_ref, gemv_ref, gemv_silu_mul_ref

    g = torch.Generator().manual_seed(m + 10 * with_residual + 100 * silu_mul)
    k, n = 1000, 70
    for dtype in _dtypes(device):

        def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

        x, res = rand(m, k, scale=3.0), rand(m, k) if with_residual else None
        w, b = rand(2 * n if silu_mul else n, k, scale=k**-0.5), rand(2 * n if silu_mul else n)
        nw = rand(k, scale=0.5) + 1
        # Three block configs: 1, 8 and 2 programs over N (program 0 writes the residual).
        for cfg in ((128, 256, 4, 2), (8, 512, 4, 3), (64, 128, 4, 2)):
            y, h = gemv_norm(x, w, b, nw, 1e-5, res, cfg, silu_mul)
            y_ref, h_ref = gemv_norm_ref(x, w, b, nw, 1e-5, res, silu_mul)
            _close(y, y_ref, dtype)
            assert torch.equal(h, h_ref)
            # ... and close to the unfused path (norm kernel, rounding, then the matmul)
            normed, _ = fused.rms_norm(x, nw, 1e-5, res)
            unfused = gemv_silu_mul_ref(normed, w, b) if silu_mul else gemv_ref(normed, w, b)
            _close(y, unfused, dtype)
        if res is None:  # x as a view of rows with a longer stride, read in place
            wide = torch.cat([x, rand(m, 24)], dim=1)
            y, h = gemv_norm(wide[:, :k], w, b, nw, 1e-5, None, (8, 512, 4, 3), silu_mul)
            _close(y, gemv_norm_ref(x, w, b, nw, 1e-5, None, silu_mul)[0], dtype)
            assert h.data_ptr() == wide.data_ptr() and h.stride(0) == k + 24


@pytest.mark.parametrize("device", modes)
def test_gemv_every_config(request, device: str) -> None:
    """Every launch config benchmarks/gemv.py and decode_matmul="auto" may pick is correct."""
    pytest.importorskip("triton")
    if device == "cpu":
        request.getfixturevalue("interpreter")
    from specserve.ops.gemv import CONFIGS, gemv, gemv_ref
    from specserve.ops.gemv_plan import CANDIDATES

    assert set(CANDIDATES) <= set(CONFIGS)
    g = torch.Generator().manual_seed(3)
    dtype = _dtypes(device)[-1]
    for cfg in CONFIGS:
        x = torch.randn(3, 1100, generator=g).to(dtype=dtype, device=device)
        w = torch.randn(37, 1100, generator=g).to(dtype=dtype, device=device)
        _close(gemv(x, w, config=cfg), gemv_ref(x, w), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_decode_linear_gpu() -> None:
    """`decode_matmul="triton"`: every nn.Linear becomes a DecodeLinear whose decode-sized calls
    run the Triton gemv and whose larger ones stay F.linear; outputs match nn.Linear."""
    from torch import nn

    from specserve.ops.gemv import DecodeLinear, use_decode_gemv_

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 300), nn.Linear(300, 96, bias=False)).cuda().bfloat16()
    with torch.inference_mode():
        xs = [torch.randn(m, 512, device="cuda", dtype=torch.bfloat16) for m in (1, 5, 8, 40)]
        refs = [model(x) for x in xs]
        assert use_decode_gemv_(model) == 2
        assert all(type(m) is DecodeLinear for m in model)
        for x, ref in zip(xs, refs):
            _close(model(x), ref, torch.bfloat16)

    # The MLP then runs gate_up + SiLU-and-mul as one kernel for decode-sized inputs.
    from specserve.models.layers import MLP

    mlp = MLP(512, 384).cuda().bfloat16()
    with torch.inference_mode():
        refs = [mlp(x) for x in xs]
        use_decode_gemv_(mlp)
        for x, ref in zip(xs, refs):
            _close(mlp(x), ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_decode_matmul_auto_gpu() -> None:
    """`decode_matmul="auto"`: every shape gets a timed plan for every row bucket 1..64 (cuBLAS,
    gemv or skinny matmul), the gate_up weights also for the fused SiLU kernel, and outputs
    match nn.Linear at row counts of every bucket."""
    from torch import nn

    from specserve.models.layers import MLP
    from specserve.ops.gemv import BUCKETS, DecodeLinear
    from specserve.ops.gemv_plan import candidates, tune_decode_gemv_

    torch.manual_seed(0)
    model = nn.Sequential(MLP(512, 1024), nn.Linear(512, 4096), nn.Linear(4096, 512))
    model = model.cuda().bfloat16()
    with torch.inference_mode():
        xs = [torch.randn(m, 512, device="cuda", dtype=torch.bfloat16) for m in (1, 2, 5, 12, 40)]
        refs = [model[2](model[1](model[0](x))) for x in xs]
    report = tune_decode_gemv_([model])
    lins = [m for m in model.modules() if isinstance(m, DecodeLinear)]
    assert len(lins) == 4 and len(report) == 4 * len(BUCKETS)  # gate_up: fused SiLU only
    for lin in lins:
        plan = lin.silu_plan if lin is model[0].gate_up_proj else lin.plan
        assert all(plan[b] in candidates(b, lin.weight.shape[1]) for b in BUCKETS)
    assert all(
        set(r["us"]) == {str(c) for c in candidates(r["rows"], r["shape"][1])} for r in report
    )
    with torch.inference_mode():
        for x, ref in zip(xs, refs):
            _close(model[2](model[1](model[0](x))), ref, torch.bfloat16)


def test_decode_matmul_config() -> None:
    from specserve.config import EngineConfig

    with pytest.raises(ValueError, match="decode_matmul must be cublas, triton or auto"):
        EngineConfig(model=os.path.dirname(__file__), decode_matmul="cutlass")
