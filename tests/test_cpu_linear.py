"""Few-row CPU matmuls as W @ x^T (ops/cpu_linear.py): the same products as F.linear, in
row-major memory, on the engine's CPU models (tied weights kept), and off with
decode_matmul="cublas"."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve import LLM
from specserve.ops.cpu_linear import MAX_ROWS, CpuLinear, skinny_linear, takes


@pytest.mark.parametrize("rows", [2, 3, 4, MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    y = skinny_linear(x, w, b)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # Row-major, as the next layer's W @ x^T needs its rows (a transposed view is slow there).
    assert y.is_contiguous() and y.shape == (rows, 300)
    # Leading dimensions are kept.
    x3 = x.view(1, rows, 96)
    torch.testing.assert_close(skinny_linear(x3, w, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)


def test_takes_few_float32_rows_without_grad_only() -> None:
    with torch.no_grad():
        assert takes(torch.zeros(2, 8)) and takes(torch.zeros(MAX_ROWS, 8))
        assert takes(torch.zeros(1, 4, 8))  # 4 rows behind a leading dimension
        assert not takes(torch.zeros(1, 8))  # one row: a matrix-vector product either way
        assert not takes(torch.zeros(MAX_ROWS + 1, 8))  # prompt chunks
        assert not takes(torch.zeros(4, 8, dtype=torch.bfloat16))
    assert not takes(torch.zeros(4, 8))  # gradients on: training keeps F.linear


def test_cpu_linear_keeps_the_layer() -> None:
    lin = nn.Linear(16, 32)
    lin.norm_fed = True
    new = CpuLinear.sharing(lin)
    assert new.weight is lin.weight and new.bias is lin.bias and new.norm_fed
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(new(x), lin(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new(x[:1]), lin(x[:1]))


def test_the_cpu_engine_uses_it_unless_told_not_to(ckpt_dir) -> None:
    path = ckpt_dir("tied_cpu_linear", "llama", tie_word_embeddings=True)
    model = LLM(path, max_model_len=64).engine.model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is CpuLinear for m in linears)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    plain = LLM(path, max_model_len=64, decode_matmul="cublas").engine.model
    assert all(type(m) is nn.Linear for m in plain.modules() if isinstance(m, nn.Linear))
