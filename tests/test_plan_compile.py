"""decode_matmul=auto's compile step (ops/plan_compile.py): one job per distinct compiled
kernel, compiled in threads before the plan times the candidates."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve.ops import plan_compile
from specserve.ops.gemv import DecodeLinear
from specserve.ops.skinny import SkinnyConfig


def _layer(n: int, k: int, device: str = "meta", bias: bool = False) -> DecodeLinear:
    with torch.device(device):
        lin = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    return DecodeLinear.sharing(lin.requires_grad_(False))


def test_one_job_per_compiled_kernel() -> None:
    """Shapes alike in what a launch specializes on share a job; the skinny matmul's split
    count (1 for a wide weight, more for a narrow one: resolve_split) and the launch's
    constexprs (rows, epilogue, norm, bias) do not."""
    gemv, auto = (8, 512, 4, 4), SkinnyConfig(64, 128, 0, 4, 3)
    o, down, wide = _layer(4096, 4096), _layer(4096, 14336), _layer(28672, 4096)
    job = plan_compile.job
    assert job(o, 1, False, gemv) == job(down, 1, False, gemv) == job(wide, 1, False, gemv)
    assert job(o, 16, False, auto) == job(down, 16, False, auto)
    assert job(o, 16, False, auto) != job(wide, 16, False, auto)  # 5 splits vs 1
    # Every split count above one is one compiled kernel; one split is another.
    split = [SkinnyConfig(64, 128, s, 4, 3) for s in (1, 2, 3, 4)]
    assert job(o, 16, False, auto) == job(o, 16, False, split[1]) == job(o, 16, False, split[3])
    assert job(o, 16, False, split[0]) != job(o, 16, False, split[2])
    assert job(wide, 16, False, auto) == job(o, 16, False, split[0])
    assert job(o, 16, False, auto) != job(o, 32, False, auto)
    assert job(wide, 16, False, auto) != job(wide, 16, True, auto)
    assert job(o, 1, False, gemv) != job(_layer(4096, 4096, bias=True), 1, False, gemv)
    o.norm_fed = True
    assert job(o, 1, False, gemv) != job(down, 1, False, gemv)
    assert job(o, 16, False, auto) != job(down, 16, False, auto)
    assert job(_layer(4100, 4096), 1, False, gemv) != job(o, 1, False, gemv)  # N % 16
    # A qkv gemv triggering early (pdl.early_kv) is its own compile; the skinny matmul has
    # no such switch.
    qkv = _layer(4096, 4096)
    qkv.norm_fed = qkv.early_trigger = True
    assert job(qkv, 1, False, gemv) != job(o, 1, False, gemv)
    assert job(qkv, 16, False, auto) == job(o, 16, False, auto)


@pytest.mark.gpu
def test_compiles_ahead_exactly_what_runs_gpu(caplog: pytest.LogCaptureFixture) -> None:
    """The pool's compile-only launches leave every candidate compiled for the launches that
    follow (no compile at the first run), and each then equals F.linear."""
    from specserve.ops.gemv import _gemv_kernel
    from specserve.ops.skinny import _skinny_kernel

    def compiled() -> int:
        dev = torch.cuda.current_device()
        return sum(len(k.device_caches[dev][0]) for k in (_gemv_kernel, _skinny_kernel))

    jobs, runs = {}, []
    # The 3- and 4-split configs share a job (the split count is a launch argument).
    cfgs = [(8, 512, 4, 4), SkinnyConfig(64, 128, 3, 4, 3), SkinnyConfig(32, 128, 0, 4, 3)]
    for cfg in [*cfgs, SkinnyConfig(64, 128, 4, 4, 3)]:
        for rows in (2, 8):
            lin = _layer(384, 1024, "cuda", bias=True)
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.normal_(lin.bias, std=0.02)
            jobs[plan_compile.job(lin, rows, False, cfg)] = lin
            runs.append((lin, rows, cfg))
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    jobs[next(iter(jobs))].run(x[:2], (8, 512, 4, 4))  # the device's caches exist before
    with caplog.at_level(logging.INFO, logger="specserve"):
        plan_compile.Compiles(jobs, lin.weight.device).close()
    assert any("6 candidates compiled" in r.getMessage() for r in caplog.records)
    before = compiled()
    for lin, rows, cfg in runs:
        with torch.inference_mode():
            y = lin.run(x[:rows], cfg)
        ref = F.linear(x[:rows], lin.weight, lin.bias)
        torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
    assert compiled() == before
