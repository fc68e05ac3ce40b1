"""ops/fp8_matmul.py: the block-scaled fp8 W8A16 kernel against dequantize-then-F.linear, under
the Triton interpreter (TRITON_INTERPRET=1 pytest -m interpret), at M = 1 .. 300 with N and K
not multiples of the block, with and without bias, bf16 and fp32 activations."""

from __future__ import annotations

import pytest
import torch

from specserve.ops.fp8_matmul import fp8_block_matmul, fp8_block_matmul_ref

from .test_moe_ops import needs_interpreter
from .test_triton_attention import interpreter  # noqa: F401  (fixture)


def _fp8_weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple:
    """(fp8 weight [n, k], scale_inv): codes over e4m3's range, scales over 2^-8 .. 2^2."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    nb, kb = -(-n // block[0]), -(-k // block[1])
    scale = torch.exp2(torch.randint(-8, 3, (nb, kb), generator=g).float())
    scale *= torch.rand(nb, kb, generator=g) + 0.5
    return w, scale


def test_reference_is_the_block_dequantization() -> None:
    """The reference itself, against a per-element loop's weight (an independent formula)."""
    block = (16, 32)
    w, s = _fp8_weight(37, 70, block, 0)
    dense = torch.empty(37, 70)
    for n in range(37):
        for k in range(70):
            dense[n, k] = w[n, k].float() * s[n // 16, k // 32]
    x = torch.randn(3, 70)
    torch.testing.assert_close(fp8_block_matmul_ref(x, w, s, block), x @ dense.T)
    with pytest.raises(ValueError, match="needs a scale of shape"):
        fp8_block_matmul_ref(x, w, s[:, :1].contiguous(), block)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("m", [1, 5, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_reference(m: int, dtype: torch.dtype) -> None:
    # N, K ragged against the block; block (16, 32): the kernel's K step (32) is the whole
    # scale column, its 64-wide column tiles span 4 scale rows.
    n, k, block = 90, 100, (16, 32)
    w, s = _fp8_weight(n, k, block, m)
    g = torch.Generator().manual_seed(m + 1)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if m % 2 else None
    with torch.no_grad():
        got = fp8_block_matmul(x, w, s, block, bias)
    want = fp8_block_matmul_ref(x, w, s, block, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = {"atol": 1e-3, "rtol": 1e-4}
    if dtype != torch.float32:
        # The kernel rounds the scaled weight and the output to bf16 (8 bits): errors of a few
        # output ulps, measured against the output's range (sums of terms that cancel).
        tol = {"atol": 1e-2 * want.float().abs().max().item(), "rtol": 0.0}
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # Not the identity: a wrong scale index moves the result well past the tolerance.
    wrong = fp8_block_matmul_ref(x, w, s.roll(1, 0), block, bias)
    assert (wrong.float() - want.float()).abs().max() > 10 * tol["atol"]


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.usefixtures("interpreter")
def test_kernel_3d_input_and_bias_with_large_block() -> None:
    """[B, T, K] inputs, a 128-wide block (DeepSeek's) over a K of 200 (two scale columns)."""
    n, k, block = 130, 200, (128, 128)
    w, s = _fp8_weight(n, k, block, 7)
    x = torch.randn(2, 3, k)
    bias = torch.randn(n)
    with torch.no_grad():
        got = fp8_block_matmul(x, w, s, block, bias)
    want = fp8_block_matmul_ref(x, w, s, block, bias)
    assert got.shape == (2, 3, n)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
