"""The decode-path kernels of MoE layers: the fused norm + router + expert choice
(ops/moe_router.py) and the per-head q/k RMSNorm (ops/fused.py qk_norm_), against their torch
references.

Interpreter tests (TRITON_INTERPRET=1 pytest -m interpret) run the kernels on CPU tensors at
tiny shapes; the sm_90 compile test runs wherever triton is installed; GPU tests (-m gpu) at
Qwen3-30B-A3B / GLM-4.5-Air / DeepSeek-V3 router shapes and inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.ops.fused import qk_norm_, qk_norm_ref
from specserve.ops.moe_router import norm_route, norm_route_ref, select_experts_ref
from specserve.tunables import override

from .test_triton_attention import interpreter, needs_interpreter  # noqa: F401  (fixture)

ON_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")


def make_route(
    T: int,
    E: int,
    H: int,
    scoring: str,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
    residual: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """(x, residual, norm weight, router weight, correction bias): sigmoid routers keep a
    float32 weight and a bias, as GLM / DeepSeek checkpoints do."""
    g = torch.Generator(device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    x = randn(T, H).to(dtype)
    res = randn(T, H).to(dtype) if residual else None
    norm_w = (1 + 0.1 * randn(H)).to(dtype)
    sigmoid = scoring == "sigmoid"
    w = (randn(E, H) / H**0.5).to(torch.float32 if sigmoid else dtype)
    bias = 0.1 * randn(E) if sigmoid else None
    return x, res, norm_w, w, bias


def _check_route(out: tuple, ref: tuple, dtype: torch.dtype, choice: bool = True) -> None:
    """Same experts per token (as sets: the sigmoid router's order is unspecified), the same
    weights for them, the same normed input, the new residual bit for bit (on the GPU)."""
    (w, ids, normed, res), (rw, rids, rnormed, rres) = out, ref
    assert ids.dtype == rids.dtype == torch.int64 and w.dtype == rw.dtype == torch.float32
    ids_s, order = ids.sort(dim=-1)
    rids_s, rorder = rids.sort(dim=-1)
    # 16-bit: the sum of squares in another order rounds an ulp apart at most on the GPU; the
    # interpreter's float32 -> bf16 conversion truncates (the norm rounds twice: 2 ulps).
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    if choice:
        assert torch.equal(ids_s, rids_s)
        torch.testing.assert_close(w.gather(1, order), rw.gather(1, rorder), **tol)
    torch.testing.assert_close(normed, rnormed, **({} if dtype == torch.float32 else tol))
    if dtype == torch.float32 or res.is_cuda:
        assert torch.equal(res, rres)
    else:
        torch.testing.assert_close(res, rres, **tol)


# (T, E, H, top_k, scoring, renormalize, scale, n_group, topk_group, n_shared)
ROUTE_CASES = [
    (1, 8, 64, 2, "softmax", True, 1.0, 1, 1, 0),
    (3, 16, 96, 4, "softmax", False, 1.0, 1, 1, 0),  # H not a multiple of BLOCK_K
    (8, 12, 64, 3, "softmax", True, 1.0, 1, 1, 0),  # E and top_k not powers of two
    (2, 16, 64, 4, "sigmoid", True, 2.5, 1, 1, 0),
    (5, 16, 64, 4, "sigmoid", True, 1.0, 4, 2, 0),  # group-limited choice
    (4, 32, 64, 6, "sigmoid", False, 1.5, 8, 3, 0),
    (1, 32, 96, 4, "softmax_topk", False, 1.0, 1, 1, 0),  # gpt-oss: biased logits, softmax of k
    (6, 16, 64, 2, "softmax_topk", False, 1.0, 1, 1, 0),
    # Fused shared experts appended (ids E.., weight 1.0): GLM-4.7-Flash's top-4 + 1 (8
    # columns a tile), top-8 + 1 (16) grouped as DeepSeek-V3, two shared filling a tile of 4.
    (1, 16, 64, 4, "sigmoid", True, 2.5, 1, 1, 1),
    (3, 32, 64, 8, "sigmoid", True, 2.5, 4, 2, 1),
    (2, 8, 64, 2, "softmax", True, 1.0, 1, 1, 2),
]


def router_bias(scoring: str, E: int, dtype: torch.dtype, seed: int) -> torch.Tensor | None:
    """gpt-oss's router bias (softmax_topk routers), large enough to move the choice."""
    if scoring != "softmax_topk":
        return None
    return torch.randn(E, generator=torch.Generator().manual_seed(seed)).to(dtype)


@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("case", ROUTE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_route_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    from specserve.ops.moe_router import norm_route_triton

    T, E, H, top_k, scoring, renorm, scale, n_group, topk_group, n_shared = case
    routing = dict(scoring=scoring, top_k=top_k, renormalize=renorm, scale=scale)
    routing.update(n_group=n_group, topk_group=topk_group, n_shared=n_shared)
    x, res, norm_w, w, bias = make_route(T, E, H, scoring, dtype, seed=T + E)
    rb = router_bias(scoring, E, dtype, seed=T)
    counter = torch.zeros(1, dtype=torch.int32)
    ref = norm_route_ref(x, res, norm_w, 1e-6, w, bias, rb, **routing)
    # One program per expert included; several K tiles; the choice by one partial sort
    # (tl.topk, the default) and by k rounds. Each case x dtype runs two of the six, in turn,
    # so each meets ~7 of the 22 (all six on each took ~4 of the interpreter stage's minutes).
    runs = [((4, 512, 4), True), ((8, 32, 4), True), ((1, 16, 2), True), ((1, 16, 1), True)]
    runs += [((4, 512, 4), False), ((1, 16, 2), False)]
    i = 2 * ROUTE_CASES.index(case) + (dtype != torch.float32)
    for config, topk_sort in (runs[i % 6], runs[(i + 3) % 6]):
        with override(moe_route_topk_sort=topk_sort):
            out = norm_route_triton(
                x, res, norm_w, 1e-6, w, bias, counter, config, router_bias=rb, **routing
            )
        # The shared experts after the k chosen, written by the kernel: ids E.., weight 1.0.
        assert out[1].shape == out[0].shape == (T, top_k + n_shared)
        assert out[1][:, top_k:].tolist() == [list(range(E, E + n_shared))] * T
        assert torch.equal(out[0][:, top_k:], torch.ones(T, n_shared))
        if dtype == torch.float32:
            _check_route(out, ref, dtype)
            continue
        # NOTE: the interpreter's float32 -> bf16 conversion truncates, so its normed x and
        # 16-bit logits sit an ulp or two from torch's and can flip a near tie: check the
        # normed x against the reference, then the choice against the reference routing of
        # the kernel's normed x: exactly for sigmoid routers (float32 logits), for softmax
        # routers the chosen experts' logits equal the k best up to an ulp.
        _check_route(out, ref, dtype, choice=False)
        if scoring == "sigmoid":
            logits = F.linear(out[2].float(), w.float())
            _check_route(out, (*select_experts_ref(logits, bias, **routing), *ref[2:]), dtype)
        else:
            logits = F.linear(out[2], w, rb).float()
            chosen = logits.gather(1, out[1][:, :top_k]).sort(dim=-1, descending=True)[0]
            best = logits.topk(top_k, dim=-1)[0]
            torch.testing.assert_close(chosen, best, atol=2e-2, rtol=2e-2)
            if scoring == "softmax_topk":  # the weights: the chosen logits' softmax
                want = F.linear(out[2], w, rb).gather(1, out[1]).softmax(-1, dtype=torch.float32)
                torch.testing.assert_close(out[0], want, atol=2e-2, rtol=2e-2)
        assert int(counter) == 0  # reset by the last program: the next launch starts at 0


@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("case", [c for c in ROUTE_CASES if c[4] == "softmax"])
def test_norm_route_softmax_topk_switch(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """tunables().moe_route_softmax_topk (the default): a renormalized softmax router routed as the k best
    logits' softmax equals the reference (float32) and the full softmax's choice; without
    renormalization the switch changes nothing."""
    from specserve.ops import moe_router as mr
    from specserve.ops.moe_router import norm_route_triton

    T, E, H, top_k, scoring, renorm, scale, n_group, topk_group, n_shared = case
    routing = dict(scoring=scoring, top_k=top_k, renormalize=renorm, scale=scale)
    routing.update(n_group=n_group, topk_group=topk_group, n_shared=n_shared)
    x, res, norm_w, w, _ = make_route(T, E, H, scoring, torch.float32, seed=T + E)
    counter = torch.zeros(1, dtype=torch.int32)
    args = (x, res, norm_w, 1e-6, w, None, counter, (4, 512, 4))
    with override(moe_route_softmax_topk=False):
        plain = norm_route_triton(*args, **routing)
    kernel, launched = mr._norm_route_kernel, []

    class Spy:  # records the path each launch takes
        def __getitem__(self, grid):
            def launch(*a, **kw):
                launched.append((kw["TOPK_SOFTMAX"], kw["RENORM"]))
                return kernel[grid](*a, **kw)

            return launch

    monkeypatch.setattr(mr, "_norm_route_kernel", Spy())
    out = norm_route_triton(*args, **routing)
    assert launched == [(renorm, False)]  # renormalized: the k best logits' softmax
    _check_route(out, norm_route_ref(x, res, norm_w, 1e-6, w, None, **routing), torch.float32)
    assert torch.equal(out[1], plain[1])
    if not renorm:  # the switch does not apply: the same launch
        assert torch.equal(out[0], plain[0])


@needs_interpreter
@pytest.mark.usefixtures("interpreter")
def test_norm_route_without_residual_and_ties() -> None:
    """No residual (x is returned as it); equal logits pick the lowest expert ids first, by
    the one-sort choice (the default) and by k rounds alike."""
    from specserve.ops.moe_router import norm_route_triton

    x, _, norm_w, _, _ = make_route(2, 8, 32, "softmax", torch.float32, residual=False)
    w = torch.zeros(8, 32)
    w[5] = 1.0  # expert 5 best, the rest tie at logit 0
    routing = dict(scoring="softmax", top_k=3, renormalize=False)
    counter = torch.zeros(1, dtype=torch.int32)
    out = norm_route_triton(x.abs(), None, norm_w.abs(), 1e-6, w, None, counter, **routing)
    assert out[3] is not None and torch.equal(out[3], x.abs())
    assert out[1].tolist() == [[5, 0, 1], [5, 0, 1]]
    args = (x.abs(), None, norm_w.abs(), 1e-6, w, None, counter)
    with override(moe_route_topk_sort=False):  # the k rounds break ties alike
        assert norm_route_triton(*args, **routing)[1].tolist() == [[5, 0, 1], [5, 0, 1]]
    ref = norm_route_ref(x.abs(), None, norm_w.abs(), 1e-6, w, None, **routing)
    torch.testing.assert_close(out[0], ref[0])


def test_norm_route_cpu_is_reference_and_select_experts_validates() -> None:
    """On CPU norm_route is the reference; the reference routes as the Router always did."""
    x, res, norm_w, w, bias = make_route(3, 8, 32, "sigmoid", torch.float32)
    routing = dict(scoring="sigmoid", top_k=2, renormalize=True, n_group=4, topk_group=2)
    counter = torch.zeros(1, dtype=torch.int32)
    out = norm_route(x, res, norm_w, 1e-6, w, bias, counter, **routing)
    ref = norm_route_ref(x, res, norm_w, 1e-6, w, bias, **routing)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)
    # Group-limited: no chosen expert outside the two best groups of two experts each.
    h = x + res
    logits = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w) @ w.t()
    choice = (logits.sigmoid() + bias).view(3, 4, 2)
    best_groups = choice.sum(-1).topk(2, dim=-1)[1]  # groups of 2: the top-2 sum is the sum
    assert all(set((out[1][t] // 2).tolist()) <= set(best_groups[t].tolist()) for t in range(3))
    with pytest.raises(ValueError, match="scoring must be one of"):
        select_experts_ref(logits, None, scoring="topk_softmax", top_k=2, renormalize=False)
    # softmax_topk (gpt-oss): the k best logits, softmaxed among themselves.
    w2, ids2 = select_experts_ref(logits, None, scoring="softmax_topk", top_k=3, renormalize=False)
    assert torch.equal(ids2, logits.topk(3, dim=-1)[1])
    torch.testing.assert_close(w2, logits.topk(3, dim=-1)[0].softmax(-1))
    # Fused shared experts: ids E.. at weight 1.0 (not scaled) after the k chosen, which keep
    # their renormalized, scaled weights; norm_route_ref appends them the same way.
    routing.update(scale=2.5)
    w0, ids0 = select_experts_ref(logits, bias, **routing)  # type: ignore[arg-type]
    ws, ids_s = select_experts_ref(logits, bias, **routing, n_shared=2)  # type: ignore[arg-type]
    assert torch.equal(ids_s, torch.cat([ids0, torch.tensor([[8, 9]] * 3)], dim=1))
    assert torch.equal(ws, torch.cat([w0, torch.ones(3, 2)], dim=1))
    out = norm_route(x, res, norm_w, 1e-6, w, bias, counter, **routing, n_shared=2)
    assert torch.equal(out[0], ws) and torch.equal(out[1], ids_s)


@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_matches_reference(dtype: torch.dtype) -> None:
    """In place on strided q / k views of one fused qkv row, v untouched."""
    from specserve.ops.triton_kernels import qk_norm_triton_

    T, hq, hk, d = 3, 4, 2, 16
    qkv = torch.randn(T, (hq + 2 * hk) * d).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(T, hq, d), k.view(T, hk, d)
    qw, kw = (1 + 0.1 * torch.randn(d)).to(dtype), (1 + 0.1 * torch.randn(d)).to(dtype)
    ref_q, ref_k = qk_norm_ref(q, k, qw, kw, 1e-6, 1e-5)
    v_before = v.clone()
    qk_norm_triton_(q, k, qw, kw, 1e-6, 1e-5)
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)  # see _check_route
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(k, ref_k, **tol)
    assert torch.equal(v, v_before)
    # On CPU the dispatch returns the reference and leaves the inputs alone.
    q2, k2 = qk_norm_(ref_q, ref_k, qw, kw, 1e-6, 1e-5)
    assert q2.data_ptr() != ref_q.data_ptr()


# ---- sm_90 compile (no GPU needed) ---------------------------------------------------------
def test_router_kernels_compile_for_sm90() -> None:
    """The fused router compiles for sm_90 without spills at Qwen3-30B-A3B (softmax, bf16
    router, 128 experts, top-8, 1 and 8 tokens; every ROUTE_CONFIGS entry at 1 token, with and
    without PDL), GLM-4.7-Flash (64 experts), GLM-4.5-Air (sigmoid, float32 router) and
    DeepSeek-V3 (256 experts, 8 groups, top-4 groups, its shared expert fused) and gpt-oss
    (biased router, softmax of the k best) shapes, the other sigmoid ones also with a fused
    shared expert appended, and
    requests its router rows before the PDL wait; the choice by one partial sort (the
    default) and, at ROUTE_CONFIG, by k rounds (more barriers), moe_route_softmax_topk at Qwen3 batch
    1 (fewer barriers after the atomic); qk-norm at Qwen3's 32 q / 4 kv
    heads of 128."""
    pytest.importorskip("triton")
    from specserve.ops import moe_router as mr
    from specserve.ops import triton_kernels as tk

    from .test_moe_ops import _compile

    types = {
        "logits_ptr": "*fp32",
        "counter_ptr": "*i32",
        "topk_w_ptr": "*fp32",
        "topk_ids_ptr": "*i64",
        "bias_ptr": "*fp32",
        "eps": "fp32",
        "scale": "fp32",
    }
    cases = [  # (scoring, router dtype, TOP_K, N_GROUP, TOPK_GROUP, BLOCK_T, E, H, N_SHARED)
        ("softmax", "bf16", 8, 1, 1, 1, 128, 2048, 0),
        ("softmax", "bf16", 8, 1, 1, 8, 128, 2048, 0),
        ("softmax", "bf16", 4, 1, 1, 1, 64, 2048, 0),  # GLM-4.7-Flash-sized softmax
        ("sigmoid", "fp32", 8, 1, 1, 1, 128, 4096, 0),
        ("softmax_topk", "bf16", 4, 1, 1, 1, 32, 2880, 0),  # gpt-oss-20b (router bias)
        ("softmax_topk", "bf16", 4, 1, 1, 8, 128, 2880, 0),  # gpt-oss-120b
        ("softmax_topk", "bf16", 4, 1, 1, 8, 32, 2880, 0),  # 20b, 8 tokens (2 K tiles spilled)
        # Shared experts fused (appended columns): GLM-4.7-Flash, GLM-4.5-Air, DeepSeek-V3
        # (whose bf16 and fp8 experts always run its shared expert fused: models/moe.py).
        ("sigmoid", "fp32", 4, 1, 1, 1, 64, 2048, 1),
        ("sigmoid", "fp32", 4, 1, 1, 8, 64, 2048, 1),
        ("sigmoid", "fp32", 8, 1, 1, 8, 128, 4096, 1),
        ("sigmoid", "fp32", 8, 8, 4, 4, 256, 7168, 1),
        ("sigmoid", "fp32", 8, 8, 4, 8, 256, 7168, 1),
    ]
    for scoring, w_dtype, top_k, n_group, topk_group, block_t, E, H, n_shared in cases:
        sigmoid, topk_softmax = scoring == "sigmoid", scoring == "softmax_topk"
        # Every swept config at Qwen3's batch-1 shape, without PDL once; the default elsewhere.
        runs = [(True, mr.ROUTE_CONFIG)]
        if (E, H, block_t) == (128, 2048, 1):
            runs = [(True, c) for c in mr.ROUTE_CONFIGS] + [(False, mr.ROUTE_CONFIG)]
        for pdl, config in runs:
            block_e, block_k = config[0], mr.route_block_k(H, config)
            consts = dict(HAS_RES=True, SIGMOID=sigmoid, ROUND_LOGITS=not sigmoid)
            consts.update(HAS_ROUTER_BIAS=topk_softmax, TOPK_SOFTMAX=topk_softmax)
            consts.update(HAS_BIAS=sigmoid, RENORM=not topk_softmax, TOP_K=top_k)
            consts.update(N_SHARED=n_shared, N_GROUP=n_group, TOPK_GROUP=topk_group)
            block_topk = 1 << (top_k + n_shared - 1).bit_length()  # next power of two
            consts.update(BLOCK_T=block_t, BLOCK_TOPK=block_topk)
            consts.update(BLOCK_E=block_e, BLOCK_K=block_k, K_TILES=-(-H // block_k))
            consts.update(BLOCK_ALL_E=E, PDL=pdl, TOPK_SORT=True)
            warps = mr.route_warps(block_t, config)
            ptx = _compile(
                mr._norm_route_kernel, consts, warps, 3, {**types, "w_ptr": f"*{w_dtype}"}
            )
            assert ("griddepcontrol.wait" in ptx) == pdl
            assert "atom.global.gpu.acq_rel.add" in ptx
            if pdl:  # the router rows are requested before the wait
                assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait")
            # The k rounds: no spills, more barriers (not at DeepSeek-V3's 8 tokens: ~35 s of
            # compile on the CI's 2 cores for what its 4 tokens already show)
            if config == mr.ROUTE_CONFIG and pdl and (E, block_t) != (256, 8):
                rounds_ptx = _compile(
                    mr._norm_route_kernel, {**consts, "TOPK_SORT": False}, warps, 3,
                    {**types, "w_ptr": f"*{w_dtype}"},
                )  # fmt: skip
                assert ptx.count("bar.sync") <= rounds_ptx.count("bar.sync"), (E, block_t)
                if block_t == 1 and n_group == 1 and E >= 64:  # Qwen3, GLM batch 1: < 60%
                    assert ptx.count("bar.sync") < 0.6 * rounds_ptx.count("bar.sync"), E
            if (scoring, E, block_t, config, pdl) == ("softmax", 128, 1, mr.ROUTE_CONFIG, True):
                # moe_route_softmax_topk at Qwen3-30B-A3B batch 1: no spills, and the choosing
                # program (after the arrival atomic) without the full softmax's max and sum
                # reductions: fewer than 60% of the barrier rounds.
                topk_ptx = _compile(
                    mr._norm_route_kernel, {**consts, "TOPK_SOFTMAX": True, "RENORM": False},
                    warps, 3, {**types, "w_ptr": f"*{w_dtype}"},
                )  # fmt: skip
                rounds = [p[p.index("atom.global.gpu.acq_rel") :].count("bar.sync")
                          for p in (ptx, topk_ptx)]  # fmt: skip
                assert rounds[1] < 0.6 * rounds[0], rounds
    for pdl in (True, False):
        consts = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_HQ=32, BLOCK_HK=4, PDL=pdl)
        types = {"q_eps": "fp32", "k_eps": "fp32", "stride_qh": "i32", "stride_kh": "i32"}
        ptx = _compile(tk._qk_norm_kernel, consts, 4, 3, types)
        assert ("griddepcontrol.wait" in ptx) == pdl


# ---- GPU ---------------------------------------------------------------------------------------
GPU_SHAPES = {  # (E, H, top_k, scoring, n_group, topk_group, scale)
    "qwen3-30b-a3b": (128, 2048, 8, "softmax", 1, 1, 1.0),
    "glm-4.5-air": (128, 4096, 8, "sigmoid", 1, 1, 1.0),
    "deepseek-v3": (256, 7168, 8, "sigmoid", 8, 4, 2.5),
    "gpt-oss-120b": (128, 2880, 4, "softmax_topk", 1, 1, 1.0),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(GPU_SHAPES))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_norm_route_gpu_real_shapes(name: str, T: int) -> None:
    from specserve.ops.moe_router import fusable

    E, H, top_k, scoring, n_group, topk_group, scale = GPU_SHAPES[name]
    routing = dict(scoring=scoring, top_k=top_k, renormalize=True, scale=scale)
    routing.update(n_group=n_group, topk_group=topk_group)
    x, res, norm_w, w, bias = make_route(T, E, H, scoring, torch.bfloat16, "cuda", seed=T)
    rb = router_bias(scoring, E, torch.bfloat16, seed=T)
    rb = None if rb is None else rb.cuda()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    with torch.inference_mode():
        assert fusable(x, w, scoring, n_group, topk_group)
        out = norm_route(x, res, norm_w, 1e-6, w, bias, counter, rb, **routing)
        ref = norm_route_ref(x, res, norm_w, 1e-6, w, bias, rb, **routing)
        _check_route(out, ref, x.dtype)
    assert int(counter) == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 3, 8])
def test_norm_route_gpu_full_softmax(T: int) -> None:
    """moe_route_softmax_topk off (the full softmax, then the k best renormalized) at
    Qwen3-30B-A3B's router routes as the reference on the GPU."""
    with override(moe_route_softmax_topk=False):
        test_norm_route_gpu_real_shapes("qwen3-30b-a3b", T)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(GPU_SHAPES))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_norm_route_gpu_k_rounds(name: str, T: int) -> None:
    """The choice by k rounds (moe_route_topk_sort off; the kernel's fallback where the k best
    do not fit tl.topk) routes as the reference on the GPU."""
    with override(moe_route_topk_sort=False):
        test_norm_route_gpu_real_shapes(name, T)


@pytest.mark.gpu
@needs_cuda
def test_norm_route_cuda_graph_replay() -> None:
    """Captured once, replayed over new inputs: equal to the eager call bit for bit, and the
    counter is back at 0 after every replay."""
    E, H = 128, 2048
    routing = dict(scoring="softmax", top_k=8, renormalize=True)
    x, res, norm_w, w, bias = make_route(4, E, H, "softmax", torch.bfloat16, "cuda", seed=1)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    with torch.inference_mode():
        norm_route(x, res, norm_w, 1e-6, w, bias, counter, **routing)  # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = norm_route(x, res, norm_w, 1e-6, w, bias, counter, **routing)
        for seed in (2, 3):
            x2, res2 = make_route(4, E, H, "softmax", torch.bfloat16, "cuda", seed=seed)[:2]
            x.copy_(x2)
            res.copy_(res2)
            graph.replay()
            eager = norm_route(x, res, norm_w, 1e-6, w, bias, counter, **routing)
            assert all(torch.equal(a, b) for a, b in zip(out, eager))
            _check_route(out, norm_route_ref(x, res, norm_w, 1e-6, w, bias, **routing), x.dtype)
            assert int(counter) == 0


@pytest.mark.gpu
@needs_cuda
def test_qk_norm_gpu_qwen3_shape() -> None:
    T, hq, hk, d = 5, 32, 4, 128
    qkv = torch.randn(T, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(T, hq, d), k.view(T, hk, d)
    qw = 1 + 0.1 * torch.randn(d, device="cuda", dtype=torch.bfloat16)
    kw = 1 + 0.1 * torch.randn(d, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        ref_q, ref_k = qk_norm_ref(q, k, qw, kw, 1e-6, 1e-6)
        out_q, out_k = qk_norm_(q, k, qw, kw, 1e-6, 1e-6)
    assert out_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(out_q, ref_q, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out_k, ref_k, atol=1e-2, rtol=1e-2)
