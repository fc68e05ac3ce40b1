"""The skinny matmul (ops/skinny.py, 2-64 rows) against F.linear: every row bucket and shape
class under the interpreter, its sm_90 compile with PDL, and at Llama-3-8B shapes on the GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from .test_ops import _close, _dtypes, modes
from .test_triton_attention import interpreter  # noqa: F401  (fixture)

triton = pytest.importorskip("triton")

ROWS = [2, 3, 5, 8, 12, 16, 17, 32, 36, 64]
# (N, K): N > K, K > N, small N, K not a multiple of any block (and not of 16), one K tile
SHAPES = [(96, 64), (40, 136), (130, 48), (24, 200), (33, 20)]


def _cfgs():
    from specserve.ops.skinny import SkinnyConfig

    # Tiny blocks so the tiny shapes still take several column tiles and K splits: no split,
    # an explicit 3-way split (the last split shorter), and the automatic split.
    return [
        SkinnyConfig(32, 32, 1, 4, 2),
        SkinnyConfig(16, 16, 3, 4, 2),
        SkinnyConfig(16, 32, 0, 4, 2),
    ]


@pytest.mark.parametrize("device", modes)
@pytest.mark.parametrize("m", ROWS)
def test_skinny_matches_linear(request, device: str, m: int) -> None:
    """Plain, with bias, and a strided activation view: against F.linear (fp32 reference)."""
    if device == "cpu":
        request.getfixturevalue("interpreter")
    from specserve.ops.skinny import skinny_matmul, skinny_ref

    g = torch.Generator().manual_seed(m)
    for i, (n, k) in enumerate(SHAPES):
        cfg = _cfgs()[(i + m) % 3]
        for dtype in _dtypes(device):
            x = torch.randn(m, 2 * k, generator=g).to(dtype=dtype, device=device)[:, ::2]
            w = torch.randn(n, k, generator=g).to(dtype=dtype, device=device)
            b = torch.randn(n, generator=g).to(dtype=dtype, device=device) if i % 2 else None
            y = skinny_matmul(x, w, b, cfg)
            _close(y, F.linear(x.float(), w.float(), b.float() if b is not None else None), dtype)
            _close(y, skinny_ref(x, w, b), dtype)


@pytest.mark.parametrize("device", modes)
@pytest.mark.parametrize("m", [3, 16, 36])
@pytest.mark.parametrize("with_residual", [False, True])
def test_skinny_epilogues(request, device: str, m: int, with_residual: bool) -> None:
    """gate_up + SiLU-and-mul, and the RMSNorm (+ residual) prologue, split and unsplit; the
    new residual equals the reference exactly (column tile 0's splits each write their part)."""
    if device == "cpu":
        request.getfixturevalue("interpreter")
    from specserve.ops.gemv import gemv_norm_ref, gemv_silu_mul_ref
    from specserve.ops.skinny import skinny_matmul, skinny_norm

    g = torch.Generator().manual_seed(m + 100 * with_residual)
    n, k = 40, 136
    for dtype in _dtypes(device):

        def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

        x, res = rand(m, k, scale=3.0), rand(m, k) if with_residual else None
        w2, b2 = rand(2 * n, k, scale=k**-0.5), rand(2 * n)
        nw = rand(k, scale=0.5) + 1
        for cfg in _cfgs():
            _close(
                skinny_matmul(x, w2, b2, cfg, silu_mul=True), gemv_silu_mul_ref(x, w2, b2), dtype
            )
            for silu in (False, True):
                w = w2 if silu else w2[:n]
                b = b2 if silu else b2[:n]
                y, h = skinny_norm(x, w, b, nw, 1e-5, res, cfg, silu)
                y_ref, h_ref = gemv_norm_ref(x, w, b, nw, 1e-5, res, silu)
                _close(y, y_ref, dtype)
                assert torch.equal(h, h_ref)
        if res is None:  # x as a view of rows with a longer stride, read in place
            wide = torch.cat([x, rand(m, 24)], dim=1)
            y, h = skinny_norm(wide[:, :k], w2[:n], b2[:n], nw, 1e-5, None, _cfgs()[0])
            _close(y, gemv_norm_ref(x, w2[:n], b2[:n], nw, 1e-5, None)[0], dtype)
            assert h.data_ptr() == wide.data_ptr() and h.stride(0) == k + 24


@pytest.mark.parametrize("device", modes)
def test_skinny_counters_reusable(request, device: str) -> None:
    """The arrival counters are left zero: one buffer serves launch after launch (graph replays
    depend on it), and the same inputs give the same bits every time."""
    if device == "cpu":
        request.getfixturevalue("interpreter")
    from specserve.ops.skinny import SkinnyConfig, new_counters, skinny_matmul

    g = torch.Generator().manual_seed(1)
    dtype = _dtypes(device)[-1]
    x = torch.randn(5, 100, generator=g).to(dtype=dtype, device=device)
    w = torch.randn(48, 100, generator=g).to(dtype=dtype, device=device)
    counters = new_counters(torch.device(device), 16)
    cfg = SkinnyConfig(16, 16, 4, 4, 2)
    ys = [skinny_matmul(x, w, None, cfg, counters=counters) for _ in range(3)]
    assert int(counters.abs().sum()) == 0
    assert all(torch.equal(y, ys[0]) for y in ys)
    with pytest.raises(ValueError, match="skinny_matmul takes"):
        skinny_matmul(torch.zeros(65, 4, device=device), torch.zeros(3, 4, device=device))


def test_resolve_split() -> None:
    """split_k 0 fills about two programs per SM, never more splits than K tiles, and every
    split is non-empty."""
    from specserve.ops.skinny import SkinnyConfig, resolve_split

    auto = SkinnyConfig(64, 128, 0, 4, 4)
    assert resolve_split(auto, 4096, 4096, 132) == (5, 896)  # 64 tiles x 5 splits >= 264
    assert resolve_split(auto, 128256, 4096, 132) == (1, 4096)  # lm_head: tiles enough
    assert resolve_split(auto, 128, 200, 132) == (2, 128)  # 2 K tiles: at most 2 splits
    for n, k in ((4096, 14336), (6144, 4096), (300, 1000)):
        splits, per = resolve_split(auto, n, k, 132)
        assert per % 128 == 0 and (splits - 1) * per < k <= splits * per
    assert resolve_split(SkinnyConfig(64, 128, 3, 4, 4), 4096, 1000, 132) == (3, 384)


def test_plan_picks_the_fastest_candidate() -> None:
    """decode_matmul="auto"'s choice, given injected timings (no GPU): per weight shape and row
    bucket the fastest candidate wins, ties go to the earlier (cuBLAS first), gate_up gets a
    plan for the fused SiLU kernel too, every bucket 1..64 is planned, and the candidates per
    bucket stay few (start-up compiles and times each)."""
    from torch import nn

    from specserve.models.layers import MLP
    from specserve.ops.gemv import BUCKETS, DecodeLinear, bucket
    from specserve.ops.gemv_plan import candidates, tune_decode_gemv_
    from specserve.ops.skinny import SkinnyConfig

    assert BUCKETS == (1, 2, 4, 8, 16, 32, 64)
    assert [bucket(m) for m in (1, 3, 5, 9, 12, 20, 36, 40, 64)] == [
        1,
        4,
        8,
        16,
        16,
        32,
        64,
        64,
        64,
    ]
    # At most 8 (cuBLAS + 7 gemv configs at one row): Llama-3-8B's plan took 8.0 s with 5
    # gemv configs on the H100 (start-up planning is to stay under ~20 s).
    assert all(len(candidates(b)) <= 8 and candidates(b)[0] is None for b in BUCKETS)
    assert not any(isinstance(c, SkinnyConfig) for c in candidates(1))
    assert all(isinstance(c, SkinnyConfig) for c in candidates(32)[1:])
    # Every bucket has its list; one row (batch-1 decode) times every gemv config.
    from specserve.ops.gemv_plan import BUCKET_CANDIDATES, CANDIDATES

    assert set(BUCKET_CANDIDATES) == set(BUCKETS) and candidates(1)[1:] == CANDIDATES

    # A SiLU MLP's gate_up is planned for the fused SiLU epilogue only, a GELU one's plain.
    model = nn.Sequential(
        MLP(32, 48), nn.Linear(32, 80), nn.Linear(80, 32), MLP(32, 48, act="gelu")
    ).half()
    calls = []

    def timer(layers: list, rows: int, silu: bool, cfg: object) -> float:
        calls.append((layers[0].weight.shape, rows, silu, cfg))
        cands = candidates(rows, layers[0].weight.shape[1])
        # cuBLAS wins at 1 row; the last candidate at 4 rows and with the SiLU epilogue; the
        # second elsewhere; at 64 rows everything ties (cuBLAS stays).
        if rows == 64:
            return 10.0
        if rows == 1:
            best = 0
        elif rows == 4 or silu:
            best = len(cands) - 1
        else:
            best = 1
        return 5.0 if cfg == cands[best] else 7.0 + cands.index(cfg)

    report = tune_decode_gemv_([model], timer=timer)
    lins = [m for m in model.modules() if isinstance(m, DecodeLinear)]
    # 5 weight groups: the two down projections share a shape
    assert len(lins) == 6 and len(report) == 5 * len(BUCKETS)
    assert sum(r["silu_mul"] for r in report) == len(BUCKETS)
    assert len(calls) == sum(len(r["us"]) for r in report)
    gate_up = model[0].gate_up_proj
    for lin in lins:
        for b in BUCKETS:
            cands = candidates(b, lin.weight.shape[1])
            if lin is gate_up:
                assert lin.silu_plan[b] == ({1: None, 64: None}.get(b, cands[-1])), b
                assert lin.plan[b] is None  # not planned: cuBLAS
                continue
            want = {1: None, 4: cands[-1], 64: None}.get(b, cands[1])
            assert lin.plan[b] == want, (lin.weight.shape, b)
    # Near ties (within TIE_MARGIN) go to the earlier candidate; a clear win does not.
    from specserve.ops.gemv_plan import TIE_MARGIN, fastest

    lin = lins[0]
    for later, want in ((1 - TIE_MARGIN / 2, 0), (1 - 2 * TIE_MARGIN, 1)):
        times = iter([100.0, 100.0 * later] + [200.0] * 8)
        pick = fastest([lin], 16, False, lambda *_, it=times: next(it))[0]
        assert pick == candidates(16)[want]
    # At one row, a tie goes to a gemv config holding the whole row when the weight is not
    # norm-fed (it preloads everything during attention), to the earlier one when it is; a
    # clear win by another config still wins.
    from specserve.ops.gemv_plan import whole_row_wins_ties

    one = candidates(1, 4096)
    lin = DecodeLinear.sharing(nn.Linear(4096, 64, bias=False, device="meta"))
    whole = next(i for i, c in enumerate(one) if c is not None and c[1] >= 4096)
    assert whole > 2 and not whole_row_wins_ties(lin, None)
    for norm_fed, clear, want in ((False, False, whole), (True, False, 1), (False, True, 2)):
        lin.norm_fed = norm_fed
        us = [200.0] * len(one)
        us[1] = us[whole] = 100.0
        if clear:
            us[2] = 100.0 * (1 - 2 * TIE_MARGIN)
        times = iter(us)
        pick = fastest([lin], 1, False, lambda *_, it=times: next(it))[0]
        assert pick == one[want], (norm_fed, clear)
    # Per weight depth: no gemv config whose K tile is twice the row or more (all of it masked
    # past the row) unless it is the narrowest there is; skinny configs are never dropped.
    widths = sorted({c[1] for c in CANDIDATES})
    for k in (32, 768, 2048, 2880, 4096, 5120, 14336):
        kept = {c[1] for c in candidates(1, k)[1:]}
        assert kept == {w for w in widths if w < 2 * k or w == widths[0]}, k
        assert candidates(16, k) == candidates(16)
    assert 8192 in {c[1] for c in candidates(1, 5120)[1:]}  # GLM-4.7-Flash's o: a whole row
    assert 8192 not in {c[1] for c in candidates(1, 4096)[1:]}  # Qwen3-30B-A3B's o
    # An injected timer caches nothing: a second engine's real timing would not see fakes.
    from specserve.ops import gemv_plan

    assert not gemv_plan._PLANS


@pytest.mark.parametrize("device", modes)
def test_decode_linear_dispatch(request, device: str) -> None:
    """planned_matmul runs whichever kernel a plan entry configures (gemv or skinny), with and
    without the norm prologue, and both give F.linear's result."""
    if device == "cpu":
        request.getfixturevalue("interpreter")
    from specserve.ops.gemv import gemv_norm_ref, planned_matmul, planned_matmul_norm
    from specserve.ops.skinny import SkinnyConfig

    g = torch.Generator().manual_seed(5)
    dtype = _dtypes(device)[-1]
    x = torch.randn(6, 72, generator=g).to(dtype=dtype, device=device)
    w = (torch.randn(40, 72, generator=g) / 8).to(dtype=dtype, device=device)
    nw = torch.randn(72, generator=g).to(dtype=dtype, device=device)
    for cfg in ((8, 32, 4, 2), SkinnyConfig(16, 32, 2, 4, 2)):
        _close(planned_matmul(x, w, None, cfg), F.linear(x.float(), w.float()), dtype)
        y, h = planned_matmul_norm(x, w, None, nw, 1e-5, x, cfg)
        _close(y, gemv_norm_ref(x, w, None, nw, 1e-5, x)[0], dtype)
        assert torch.equal(h, x + x)
        # No residual (a first layer): x itself is the residual passed on.
        y, h = planned_matmul_norm(x, w, None, nw, 1e-5, None, cfg)
        _close(y, gemv_norm_ref(x, w, None, nw, 1e-5, None)[0], dtype)
        assert torch.equal(h, x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [2, 4, 8, 12, 16, 20, 32, 40, 64])
def test_skinny_llama8b_shapes_gpu(m: int) -> None:
    """Every launch config at the Llama-3-8B shapes (bf16) against F.linear, and bit-equal
    between launches (the split merge is deterministic)."""
    from specserve.ops.gemv import gemv_silu_mul_ref
    from specserve.ops.skinny import CONFIGS, skinny_matmul

    torch.manual_seed(m)
    bf = torch.bfloat16
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        x = torch.randn(m, k, device="cuda", dtype=bf)
        w = torch.randn(n, k, device="cuda", dtype=bf) * k**-0.5
        ref = F.linear(x.float(), w.float())
        for cfg in CONFIGS:
            y = skinny_matmul(x, w, None, cfg)
            _close(y, ref, bf)
            assert torch.equal(y, skinny_matmul(x, w, None, cfg))
            if n == 28672:
                _close(skinny_matmul(x, w, None, cfg, silu_mul=True), gemv_silu_mul_ref(x, w), bf)


def _skip_no_interpret() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("ahead-of-time compile needs the compiler, not the interpreter")


# The skinny kernel's sm_90 compiles: argument types beside test_pdl.TYPES' defaults, and the
# arguments Triton specializes as multiples of 16 at run time.
_SM90_TYPES = {"ws_ptr": "*fp32", "ss_ptr": "*fp32", "counter_ptr": "*i32", "eps": "fp32"}
_SM90_TYPES |= {"norm_w_ptr": "*bf16", "res_out_ptr": "*bf16"}
_SM90_DIV16 = ("x_ptr", "w_ptr", "ws_ptr", "stride_xm", "stride_wn", "K", "k_split")


def _sm90_consts(cfg, bm: int, silu: bool, norm: bool, bias: bool, pdl: bool = True) -> dict:
    """The skinny kernel's constexprs for `cfg` at row tile bm (the residual with the norm)."""
    return dict(
        HAS_BIAS=bias, SILU_MUL=silu, NORM=norm, HAS_RES=norm, BLOCK_M=bm,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION="tf32", PDL=pdl, PRELOAD=pdl,
    )  # fmt: skip


@pytest.mark.parametrize("silu_norm", [(False, False), (True, True)])
def test_skinny_compiles_sm90_with_pdl(silu_norm: tuple[bool, bool]) -> None:
    """The kernel compiles for sm_90 with PDL at every row tile (the preload before the wait,
    the trigger after it) and each launch config fits the H100's shared memory (228 KiB a
    block) at 64 rows, the largest tile."""
    _skip_no_interpret()
    from specserve.ops.skinny import CONFIGS, ROW_TILES, _skinny_kernel, num_stages

    from .test_pdl import compile_sm90

    silu, norm = silu_norm
    types, div = _SM90_TYPES, _SM90_DIV16

    def consts(bm: int, cfg, pdl: bool = True) -> dict:
        return _sm90_consts(cfg, bm, silu, norm, True, pdl)

    cfg0 = CONFIGS[0]
    for bm in ROW_TILES if not silu else (64,):
        out: list = []
        ptx = compile_sm90(_skinny_kernel, consts(bm, cfg0), 4, 4, types, div, out)
        wait = ptx.index("griddepcontrol.wait")
        assert ptx.index("ld.global") < wait < ptx.index("griddepcontrol.launch_dependents")
        assert "atom.global" in ptx and ("mma" in ptx)
    if silu:  # the heaviest variant: two weight tiles a stage
        for cfg in CONFIGS:
            out = []
            stages = num_stages(cfg, 64, True)
            compile_sm90(_skinny_kernel, consts(64, cfg), cfg.num_warps, stages, types, div, out)
            assert out[0].metadata.shared <= 232448, (cfg, out[0].metadata.shared)
    plain = compile_sm90(_skinny_kernel, consts(16, cfg0, pdl=False), types=types)
    assert "griddepcontrol" not in plain


def test_norm_loop_waits_on_no_load() -> None:
    """With the norm (and residual) fused, the K loop (sm_90 TTGIR) holds no cross-thread sum
    and uses no value loaded in the same step: the norm weight and residual tiles are loaded a
    step ahead (carried to the next iteration), x^T and the weights by the pipeliner's async
    copies. A load used in its own step was an L2 round trip every K step (the norm-fed shapes
    streamed at 2.0-2.4 TB/s against 2.7-2.95 unfused on an H100, benchmarks/RESULTS.md)."""
    _skip_no_interpret()
    import re

    from specserve.ops.skinny import SkinnyConfig, _skinny_kernel

    from .test_pdl import compile_sm90

    cfg = SkinnyConfig(64, 128, 3, 4, 3)
    consts = _sm90_consts(cfg, 16, silu=False, norm=True, bias=False)
    out: list = []
    compile_sm90(
        _skinny_kernel, consts, cfg.num_warps, cfg.num_stages, _SM90_TYPES, _SM90_DIV16, out
    )
    ttgir = out[0].asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for") :]
    loop = loop[: loop.index("scf.yield")]
    yielded = ttgir[ttgir.index("scf.yield") :].splitlines()[0]
    assert "tt.reduce" not in loop and "warp_group_dot" in loop
    loads = re.findall(r"(%\w+) = tt\.load ", loop)
    assert len(loads) == 2, loads  # the next step's norm weight and residual tiles
    for value in loads:
        assert re.search(rf"{value}\b", yielded), (value, yielded)
        body_uses = re.findall(rf"{value}\b", loop)
        assert len(body_uses) == 1, value  # defined here, used only by the next iteration
