"""fused_moe's Triton kernels (ops/moe_triton.py) against the torch reference (ops/moe.py).

Interpreter tests (TRITON_INTERPRET=1 pytest -m interpret) run the kernels on CPU tensors at
tiny shapes; GPU tests (-m gpu) at Qwen3-30B-A3B's and gpt-oss-20b's expert shapes and inside a
CUDA graph; the sm_90 compile test runs everywhere triton is installed (the interpreter accepts
code the compiler rejects).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from specserve.ops.moe import fused_moe, fused_moe_ref
from specserve.tunables import override, tunables

from .test_triton_attention import interpreter, needs_interpreter  # noqa: F401  (fixture)

ON_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")


def make_moe(
    T: int,
    E: int,
    H: int,
    inter: int,
    top_k: int,
    dtype: torch.dtype,
    device: str = "cpu",
    routing: str = "random",
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(x, w13, w2, topk_weights, topk_ids) with softmax top-k routing over random logits.
    routing "idle": only experts 1, 4 and 6 (mod E) can be chosen, the rest get no tokens;
    "same": every token picks the same top_k experts; "shared": top_k - 1 of the first E - 1,
    then expert E - 1 at weight 1.0 for every token (a fused shared expert, models/moe.py)."""
    g = torch.Generator(device).manual_seed(seed)  # on the device: the GPU shapes are large

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    x = randn(T, H)
    w13 = randn(E, 2 * inter, H) / H**0.5
    w2 = randn(E, H, inter) / inter**0.5
    logits = randn(T, E)
    if routing == "idle":
        allowed = torch.zeros(E, dtype=torch.bool, device=device)
        allowed[[1 % E, 4 % E, 6 % E]] = True
        logits = logits.masked_fill(~allowed, float("-inf"))
    elif routing == "same":
        logits = torch.arange(E, dtype=torch.float32, device=device) + 0.1 * logits.abs()
    if routing == "shared":
        topk_weights, topk_ids = logits[:, :-1].softmax(-1).topk(top_k - 1, dim=-1)
        topk_weights = torch.cat([topk_weights, topk_weights.new_ones(T, 1)], dim=1)
        topk_ids = torch.cat([topk_ids, torch.full_like(topk_ids[:, :1], E - 1)], dim=1)
    else:
        topk_weights, topk_ids = logits.softmax(-1).topk(top_k, dim=-1)
    if routing == "same":
        assert (topk_ids == topk_ids[0]).all()
    return x.to(dtype), w13.to(dtype), w2.to(dtype), topk_weights, topk_ids.to(torch.int32)


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        err = (out.float() - ref.float()).norm() / ref.float().norm()
        assert err < 2e-2, f"relative error {err:.2e}"


# T <= 8 takes the decode kernels by default, larger T the grouped GEMM; "gemm" and "decode"
# force one.
CASES = [
    (1, "random", "auto"),
    (3, "random", "auto"),
    (8, "random", "auto"),
    (37, "random", "auto"),
    (64, "random", "auto"),
    (3, "random", "gemm"),
    (37, "idle", "auto"),
    (8, "idle", "auto"),
    (64, "same", "auto"),
    (8, "same", "auto"),
    (1, "shared", "auto"),
    (37, "shared", "auto"),
]
# float32 everywhere; bfloat16 (16-bit loads, tensor-core dots) on the random-routing cases.
CASES_DTYPES = [
    (*case, dtype)
    for case in CASES
    for dtype in (torch.float32, torch.bfloat16)
    if dtype == torch.float32 or case[1] == "random"
]


def _decodes(T: int, path: str) -> bool:
    return path == "decode" or (path == "auto" and T <= 8)


@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("T, routing, path, dtype", CASES_DTYPES)
def test_moe_triton_matches_reference(T: int, routing: str, path: str, dtype: torch.dtype) -> None:
    from specserve.ops.moe_triton import fused_moe_triton

    top_k = 3 if routing == "shared" else 2  # shared: top-2 + 1, padded to 4 in down's tile
    args = make_moe(T, E=8, H=64, inter=32, top_k=top_k, dtype=dtype, routing=routing, seed=T)
    _check(fused_moe_triton(*args, path=path), fused_moe_ref(*args))


def make_oai_kw(
    E: int,
    H: int,
    inter: int,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
    limit: float = 0.8,
    bias: bool = True,
    activation: str = "swiglu_oai",
) -> dict:
    """gpt-oss's expert extras: biases [E, 2I] and [E, H] (scaled like the products, so they
    matter) and the clamped SwiGLU. The small default limit makes both clamps bite at random
    weights (gpt-oss's 7.0 would never clamp a unit-scale product)."""
    g = torch.Generator(device).manual_seed(seed + 100)
    kw: dict = dict(activation=activation, alpha=1.702, limit=limit)
    if bias:
        kw["w13_bias"] = torch.randn(E, 2 * inter, generator=g, device=device).to(dtype)
        kw["w2_bias"] = (0.5 * torch.randn(E, H, generator=g, device=device)).to(dtype)
    return kw


# (T, path, bias, activation): decode and GEMM paths; biases with each activation, and
# swiglu_oai without biases.
OAI_CASES = [
    (1, "auto", True, "swiglu_oai"),
    (5, "decode", True, "swiglu_oai"),
    (37, "gemm", True, "swiglu_oai"),
    (3, "decode", False, "swiglu_oai"),
    (3, "gemm", True, "silu"),
    (6, "decode", True, "silu"),
]


@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, path, bias, activation", OAI_CASES)
def test_moe_triton_gpt_oss_experts(
    T: int, path: str, bias: bool, activation: str, dtype: torch.dtype
) -> None:
    """Biases and the clamped SwiGLU (gpt-oss) in the decode and GEMM kernels == reference,
    with the clamps active (some gate products above the limit, some up products outside
    +-limit)."""
    from specserve.ops.moe_triton import Epilogue, fused_moe_triton

    args = make_moe(T, E=8, H=64, inter=32, top_k=2, dtype=dtype, seed=T)
    kw = make_oai_kw(8, 64, 32, dtype, seed=T, bias=bias, activation=activation)
    x, w13, *_ = args
    gate_up = x.float() @ w13.float()[0].T
    assert (gate_up > 0.8).any() and (gate_up < -0.8).any()  # the clamps have work
    out = fused_moe_triton(*args, path=path, epilogue=Epilogue(**kw))
    ref = fused_moe_ref(*args, **kw)
    _check(out, ref)
    # The extras changed the result: a kernel ignoring them would fail.
    assert (fused_moe_ref(*args).float() - ref.float()).norm() > 0.1 * ref.float().norm()


@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("path", ["decode", "gemm"])
def test_moe_triton_strided_input_and_int64_ids(path: str) -> None:
    """x a column slice of a wider tensor (row stride != H), ids int64 as routers return them."""
    from specserve.ops.moe_triton import fused_moe_triton

    x, w13, w2, tw, ids = make_moe(5, E=8, H=64, inter=32, top_k=2, dtype=torch.float32)
    wide = torch.cat([x, torch.randn_like(x)], dim=1)[:, :64]
    assert wide.stride(0) == 128
    out = fused_moe_triton(wide, w13, w2, tw, ids.long(), path=path)
    _check(out, fused_moe_ref(x, w13, w2, tw, ids))


@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("routing", ["random", "idle", "same"])
@pytest.mark.parametrize("E, block_m", [(8, 16), (6, 4), (5, 64)])
def test_moe_align(routing: str, E: int, block_m: int) -> None:
    """Pairs grouped by expert in pair order, segments padded with P, the expert of every
    block and the padded total equal the torch layout; E not a power of two included."""
    from specserve.ops.moe_triton import moe_align, moe_align_ref

    for T, top_k in ((1, 2), (37, 2), (50, 3)):
        ids = make_moe(T, E, 4, 4, top_k, torch.float32, routing=routing, seed=E + T)[-1]
        sorted_ids, expert_ids, total = moe_align(ids, E, block_m)
        ref_sorted, ref_experts, ref_total = moe_align_ref(ids, E, block_m)
        assert int(total) == ref_total
        assert len(sorted_ids) >= ref_total and len(expert_ids) * block_m == len(sorted_ids)
        assert torch.equal(sorted_ids[:ref_total], ref_sorted)
        assert torch.equal(expert_ids[: ref_total // block_m], ref_experts)


# (H, I, top_k) of the real models -> the down config: every row of DECODE_DOWN_TABLE.
DOWN_TABLE_SHAPES = {
    (2048, 768, 8): (2, 256, 4),  # Qwen3-30B-A3B
    (2048, 1536, 4): (2, 256, 4),  # GLM-4.7-Flash
    (2880, 2880, 4): (1, 512, 4),  # gpt-oss (biases)
    (2048, 1536, 5): (1, 256, 4),  # GLM-4.7-Flash + shared
    (4096, 1408, 8): (1, 256, 4),  # GLM-4.5-Air
    (7168, 2048, 8): (1, 256, 4),  # DeepSeek-V3
    (4096, 1408, 9): (1, 256, 8),  # GLM-4.5-Air + shared
    (7168, 2048, 9): (1, 256, 8),  # DeepSeek-V3 + shared
}


@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize(
    "routing, top_k, bias, config",
    [
        ("idle", 2, False, (2, 32, 2)),  # I = 48: 2 steps, the second half masked
        ("shared", 3, True, (1, 16, 1)),  # 3 steps, none masked; 3 rows padded to 4; biases
        ("random", 5, True, (4, 128, 4)),  # one step wider than I; 5 rows padded to 8
    ],
)
def test_moe_decode_down_steps(
    routing: str, top_k: int, bias: bool, config: tuple[int, int, int]
) -> None:
    """The down kernel's unrolled K steps at I = 48 (masking past I in the last step or the
    only one), experts that get no tokens, padded top_k rows and expert biases: equal to the
    reference."""
    from specserve.ops import moe_triton as mt

    args = make_moe(3, E=8, H=64, inter=48, top_k=top_k, dtype=torch.float32, routing=routing)
    kw = make_oai_kw(8, 64, 48, torch.float32, activation="silu") if bias else {}
    epilogue = mt.Epilogue(**kw)
    configs = (mt.DECODE_GATE_UP_CONFIG, config)
    out = mt.fused_moe_decode(*args, configs=configs, epilogue=epilogue)
    _check(out, fused_moe_ref(*args, **kw))


@needs_interpreter
@pytest.mark.usefixtures("interpreter")
def test_every_launch_config() -> None:
    """Every grouped-GEMM config the token count may pick, and every decode config
    benchmarks/moe.py --sweep may recommend, is correct (tiles wider than N and K included)."""
    from specserve.ops import moe_triton as mt

    args = make_moe(37, E=8, H=64, inter=32, top_k=2, dtype=torch.float32, seed=5)
    ref = fused_moe_ref(*args)
    for _, cfg in mt.GEMM_CONFIGS:
        _check(mt.fused_moe_gemm(*args, config=cfg), ref)
    args = make_moe(2, E=8, H=64, inter=48, top_k=2, dtype=torch.float32, seed=6)
    ref = fused_moe_ref(*args)
    down0 = mt.DECODE_DOWN_CONFIGS[0]
    for gate_up in mt.DECODE_GATE_UP_CONFIGS:
        _check(mt.fused_moe_decode(*args, configs=(gate_up, down0)), ref)
    for down in mt.DECODE_DOWN_CONFIGS:
        _check(mt.fused_moe_decode(*args, configs=(mt.DECODE_GATE_UP_CONFIG, down)), ref)
    # The shape tables: gate_up one K tile at Qwen3-30B-A3B / GLM-4.7-Flash, the fallback
    # beyond (gpt-oss, GLM-4.5-Air's H = 4096); down a program's whole slab in registers
    # (BLOCK_N shrinks as top_k and I grow); every table config is one the sweep times.
    gate_ups = {
        (2048, 768, 8): (4, 2048, 4),  # one token: persistent at (4, 2048, 8)
        (2048, 1536, 4): (2, 2048, 8),
        (2048, 1536, 5): (2, 2048, 8),  # shared expert fused: top-4 + 1
    }
    for shape, down in DOWN_TABLE_SHAPES.items():
        gate_up = gate_ups.get(shape, mt.DECODE_GATE_UP_CONFIG)
        assert mt.decode_configs(*shape) == (gate_up, down), shape
    assert {c for *_, c in mt.DECODE_GATE_UP_TABLE} <= set(mt.DECODE_GATE_UP_CONFIGS)
    assert {c for *_, c in mt.DECODE_DOWN_TABLE} == set(DOWN_TABLE_SHAPES.values())
    assert {c for *_, c in mt.DECODE_DOWN_TABLE} <= set(mt.DECODE_DOWN_CONFIGS)
    # The default pick (one K tile each here: BLOCK_K >= K) on this shape.
    _check(mt.fused_moe_decode(*args, configs=((4, 64, 4), (2, 64, 4))), ref)


@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("per_sm", [1, 3, 64])
@pytest.mark.parametrize(
    "T, routing, top_k, bias",
    [(1, "random", 2, False), (1, "idle", 6, True), (3, "random", 2, False)],
)
def test_moe_decode_gate_up_persistent(
    monkeypatch: pytest.MonkeyPatch, per_sm: int, T: int, routing: str, top_k: int, bias: bool
) -> None:
    """The persistent gate_up kernel (a table config's moe_gate_up_persistent tunable: its own config
    (4, 64, 4) at per_sm programs an SM, 4 SMs on the interpreter), for one token only: 1 and 3
    an SM give each program several column blocks (I = 48 in blocks of 4, 12 a pair: with 2
    pairs and 4 SMs 2 programs a pair, 6 blocks each; with 6 pairs one program a pair), 64 one
    block each (the grid capped at the blocks); the last block's prefetch runs past I. Three
    tokens, or a persistent config whose K tile is narrower than H, run the table config in
    waves. Equal to the reference either way, with expert
    biases and gpt-oss's activation too."""
    from specserve.ops import moe_triton as mt

    launched = []
    kernel = mt._moe_decode_gate_up_kernel

    class Spy:
        def __getitem__(self, grid: tuple) -> object:
            def launch(*args: object, **kw: object) -> object:
                launched.append((grid, kw["PERSISTENT"]))
                return kernel[grid](*args, **kw)

            return launch

    monkeypatch.setattr(mt, "_moe_decode_gate_up_kernel", Spy())
    args = make_moe(T, E=8, H=64, inter=48, top_k=top_k, dtype=torch.float32, routing=routing)
    kw = make_oai_kw(8, 64, 48, torch.float32, activation="swiglu_oai") if bias else {}
    configs = ((8, 64, 4), (2, 64, 4))
    with override(moe_gate_up_persistent={(8, 64, 4): ((4, 64, 4), per_sm)}):
        out = mt.fused_moe_decode(*args, configs=configs, epilogue=mt.Epilogue(**kw))
    _check(out, fused_moe_ref(*args, **kw))
    P = T * top_k
    persistent = ((P * min(12, -(-per_sm * 4 // P)),), True)
    assert launched == [persistent if T == 1 else ((P * 6,), False)]  # 8-column blocks
    # A persistent config whose K tile does not span H (it has no K loop) is never launched.
    launched.clear()
    with override(moe_gate_up_persistent={(8, 64, 4): ((4, 32, 4), per_sm)}):
        out = mt.fused_moe_decode(*args, configs=configs, epilogue=mt.Epilogue(**kw))
    _check(out, fused_moe_ref(*args, **kw))
    assert launched == [((P * 6,), False)]


def test_fused_moe_dispatch_and_validation() -> None:
    """On CPU fused_moe is the reference; a bad path or bad shapes fail with one clear line."""
    args = make_moe(5, E=4, H=16, inter=8, top_k=2, dtype=torch.float32)
    assert torch.equal(fused_moe(*args), fused_moe_ref(*args))
    with pytest.raises(ValueError, match="path must be one of auto, decode, gemm"):
        fused_moe(*args, path="fast")
    pytest.importorskip("triton")
    from specserve.ops.moe_triton import fused_moe_triton

    x, w13, w2, tw, ids = args
    with pytest.raises(ValueError, match="fused_moe takes"):
        fused_moe_triton(x, w13, w2[:, :, :4], tw, ids)


# ---- sm_90 compile (no GPU needed) ---------------------------------------------------------
MOE_TYPES = {
    "topk_ids_ptr": "*i32",
    "sorted_ids_ptr": "*i32",
    "expert_ids_ptr": "*i32",
    "num_post_pad_ptr": "*i32",
    "topk_w_ptr": "*fp32",
}


def _compile(
    kernel,
    consts: dict,
    num_warps: int = 4,
    num_stages: int = 3,
    types: dict | None = None,
    compiled_out: list | None = None,
) -> str:
    """PTX for sm_90, pointers, strides, N and K specialized as multiples of 16 as at run time
    for the real shapes; asserts the cubin keeps every value in registers (no local memory:
    spills would cost the bandwidth these kernels exist for)."""
    from .test_pdl import compile_sm90

    # As at run time: arguments the kernel does not specialize stay unaligned.
    unspecialized = {
        kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize
    }
    aligned = tuple(
        n
        for n in kernel.arg_names
        if (n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K"))
        and n not in unspecialized
    )
    out = compiled_out if compiled_out is not None else []
    types = {**MOE_TYPES, **(types or {})}
    ptx = compile_sm90(kernel, consts, num_warps, num_stages, types, aligned, out)
    usage = _cuobjdump(out[-1], "--dump-resource-usage")
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, (kernel.__name__, consts, usage)
    return ptx


def _cuobjdump(compiled, flag: str) -> str:
    """cuobjdump's `flag` output ("--dump-resource-usage", "-sass") on a compiled kernel."""
    import subprocess
    import tempfile

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([cuobjdump, flag, f.name], capture_output=True, text=True).stdout


def test_moe_kernels_compile_for_sm90() -> None:
    """Every kernel compiles for sm_90 without spills at the configs the real shapes use; the
    grouped GEMM runs on tensor cores; the decode kernels wait for their predecessor and
    trigger their successor under PDL, and emit no PDL code without it. gpt-oss's epilogue
    (biases, swiglu_oai) compiles the same way, and the plain SiLU kernels carry none of it."""
    pytest.importorskip("triton")
    from specserve.ops import moe_triton as mt

    silu = mt.PLAIN.consts()
    oai = mt.Epilogue(activation="swiglu_oai").consts()
    _compile(mt._moe_align_kernel, dict(BLOCK_E=128, BLOCK_P=1024, BLOCK_M=16))
    # DeepSeek-V3's 256 experts + a fused shared one: 512 bins.
    _compile(mt._moe_align_kernel, dict(BLOCK_E=512, BLOCK_P=1024, BLOCK_M=16))
    _compile(mt._moe_sum_kernel, dict(BLOCK_TOPK=8, BLOCK_H=1024))
    # gate_up at every token density in 16 and 32 bits, down at the extremes: fits the H100's
    # shared memory (227 KB a block), runs on tensor cores where 16-bit. gpt-oss (bias +
    # swiglu_oai on gate_up, bias on down) at the densities it decodes and verifies at.
    gemm_cases = [
        (gate_up, per_expert, dtype, False)
        for per_expert in (1, 16, 1000)
        for dtype in ("bf16", "fp32")
        for gate_up in (True, False)
        if gate_up or (dtype == "bf16" and per_expert != 16)
    ]
    gemm_cases += [(g, pe, "bf16", True) for g, pe, dt, _ in gemm_cases if dt == "bf16"]
    plain_ptx = {}
    for gate_up, per_expert, dtype, gpt_oss in gemm_cases:
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        bm, bn, bk, group, warps, stages = mt.gemm_config(per_expert * 8, 8, torch_dtype)
        consts = dict(GATE_UP=gate_up, MUL_WEIGHT=not gate_up, HAS_BIAS=gpt_oss)
        consts.update(oai if gpt_oss and gate_up else silu)
        consts.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group)
        consts.update(DOT_PRECISION="tf32" if dtype == "bf16" else "ieee")
        types = {name: f"*{dtype}" for name in ("a_ptr", "w_ptr", "b_ptr", "c_ptr")}
        out: list = []
        ptx = _compile(mt._moe_gemm_kernel, consts, warps, stages, types, out)
        assert out[0].metadata.shared <= 227 * 1024, (consts, out[0].metadata.shared)
        if dtype == "bf16":
            assert ("wgmma" if bm >= 64 else "mma.sync") in ptx
            key = (gate_up, per_expert)
            if gpt_oss:  # the extras are there: more loads (biases), more math (clamps)
                assert ptx.count("ld.global") > plain_ptx[key].count("ld.global")
                assert (ptx.count("min.f32") > plain_ptx[key].count("min.f32")) == gate_up
            else:
                plain_ptx[key] = ptx
    decode_cases = [
        (mt._moe_decode_gate_up_kernel, mt.DECODE_GATE_UP_CONFIG, dict(HAS_BIAS=False, **silu)),
        (mt._moe_decode_gate_up_kernel, mt.DECODE_GATE_UP_CONFIG, dict(HAS_BIAS=True, **oai)),
    ]
    decode_cases += [
        (kernel, config, dict(BLOCK_TOPK=8, **steps, **extra))
        for kernel, config, steps in ((mt._moe_decode_down_kernel, (2, 256, 4), dict(STEPS=3)),)
        for bias in (False, True)
        for extra in (dict(PRELOAD=False, HAS_BIAS=bias), dict(PRELOAD=True, HAS_BIAS=bias))
    ]
    for kernel, (bn, bk, warps), extra in decode_cases:
        preload = extra.get("PRELOAD", False)
        for pdl in (True, False) if not preload else (True,):  # preloading is a PDL launch
            ptx = _compile(kernel, dict(BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, **extra), warps)
            assert ("griddepcontrol.wait" in ptx) == pdl
            assert ("griddepcontrol.launch_dependents" in ptx) == pdl
            if pdl:  # only down's preload (routing, weight tiles) loads before the wait
                assert (ptx.index("ld.global") < ptx.index("griddepcontrol.wait")) == preload
    # down may launch once gate_up waited (not after its weights)
    consts = dict(BLOCK_N=8, BLOCK_K=512, PDL=True, HAS_BIAS=False, **silu)
    ptx = _compile(mt._moe_decode_gate_up_kernel, consts, 4)
    trigger, wait = (
        ptx.index("griddepcontrol.launch_dependents"),
        ptx.index("griddepcontrol.wait"),
    )
    assert wait < trigger < ptx.rindex("ld.global")
    # gate_up's table configs at their real shapes (Qwen3-30B-A3B: H 2048, I 768, top-8;
    # GLM-4.7-Flash: I 1536, top-4; with a fused shared expert top-4 + 1, and GLM-4.5-Air /
    # DeepSeek-V3's top-8 + 1): no spills.
    shapes = ((2048, 768, 8), (2048, 1536, 4), (2048, 1536, 5), (4096, 1408, 9), (7168, 2048, 9))
    for hidden, inter, top_k in shapes:
        gn, gk, gw = mt.decode_configs(hidden, inter, top_k)[0]
        consts = dict(PDL=True, HAS_BIAS=False, **silu)
        _compile(mt._moe_decode_gate_up_kernel, dict(BLOCK_N=gn, BLOCK_K=gk, **consts), gw)
        persistent = tunables().moe_gate_up_persistent
        if (gn, gk, gw) in persistent:  # one token: its two blocks in flight fit too
            (pn, pk, pw), _ = persistent[gn, gk, gw]
            _compile(mt._moe_decode_gate_up_kernel,
                     dict(BLOCK_N=pn, BLOCK_K=pk, PERSISTENT=True, **consts), pw)  # fmt: skip
    # down's table at every row's shapes (gpt-oss with its biases): no spills, registers for
    # >= 4 programs an SM (3 at 8 warps; DeepSeek-V3 + shared's 64 KB slab allows 2), and the
    # program's WHOLE slab, [next_pow2(top_k), BLOCK_N, STEPS * BLOCK_K] bf16 in 16-byte
    # loads, requested before the PDL wait.
    for (hidden, inter, top_k), down in DOWN_TABLE_SHAPES.items():
        dn, dk, dw = mt.decode_configs(hidden, inter, top_k)[1]
        assert (dn, dk, dw) == down
        block_topk, steps = 1 << (top_k - 1).bit_length(), -(-inter // dk)
        consts = dict(BLOCK_TOPK=block_topk, BLOCK_N=dn, BLOCK_K=dk, STEPS=steps, PDL=True)
        consts.update(PRELOAD=True, HAS_BIAS=inter == 2880)
        out = []
        ptx = _compile(mt._moe_decode_down_kernel, consts, dw, compiled_out=out)
        regs = int(re.search(r"REG:(\d+)", _cuobjdump(out[0], "--dump-resource-usage"))[1])
        programs = 65536 // (regs * 32 * dw)
        assert programs >= (2 if (inter, top_k) == (2048, 9) else 3 if dw == 8 else 4), regs
        early = ptx[: ptx.index("griddepcontrol.wait")]
        slab = block_topk * dn * steps * dk * 2
        assert early.count("ld.global.v4") * 16 * 32 * dw == slab, (hidden, inter, top_k)
        if (hidden, inter, top_k) == (2048, 768, 8):
            # Qwen3-30B-A3B in SASS (after ptxas's scheduling): all 12 weight loads of the
            # three steps are in flight before the wait (ACQBULK), and no FMA or reduction
            # comes before it.
            sass = _cuobjdump(out[0], "-sass")
            wait = sass.index("ACQBULK")
            assert sass[:wait].count("LDG.E.128") == slab // (16 * 32 * dw) == 12
            assert "FFMA" not in sass[:wait] and "SHFL" not in sass[:wait]


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_moe_gpu_qwen3_shape(T: int) -> None:
    """bf16 at Qwen3-30B-A3B's experts (H=2048, I=768, E=128, top-8): the default path and, up
    to 64 tokens, the other one too."""
    args = make_moe(T, 128, 2048, 768, 8, torch.bfloat16, device="cuda", seed=T)
    with torch.inference_mode():
        ref = fused_moe_ref(*args)
        _check(fused_moe(*args), ref)
        if T <= 64:
            _check(fused_moe(*args, path="decode" if T > 8 else "gemm"), ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_moe_gpu_dtypes(dtype: torch.dtype) -> None:
    for T, path in ((5, "decode"), (5, "gemm"), (100, "gemm"), (100, "idle")):
        routing = "idle" if path == "idle" else "random"
        args = make_moe(T, 16, 256, 96, 4, dtype, device="cuda", routing=routing, seed=T)
        with torch.inference_mode():
            _check(fused_moe(*args, path="auto" if path == "idle" else path), fused_moe_ref(*args))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 8, 64, 512])
def test_moe_gpu_gpt_oss_20b_shape(T: int) -> None:
    """bf16 at gpt-oss-20b's experts (H=I=2880: tiles overhang K, E=32, top-4) with biases and
    swiglu_oai (limit 2: the clamps bite at unit-scale products): the default path and, up to
    64 tokens, the other one too."""
    E, H, inter = 32, 2880, 2880
    args = make_moe(T, E, H, inter, 4, torch.bfloat16, device="cuda", seed=T)
    kw = make_oai_kw(E, H, inter, torch.bfloat16, device="cuda", seed=T, limit=2.0)
    with torch.inference_mode():
        ref = fused_moe_ref(*args, **kw)
        _check(fused_moe(*args, **kw), ref)
        if T <= 64:
            _check(fused_moe(*args, **kw, path="decode" if T > 8 else "gemm"), ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("T", [4, 96])
def test_moe_cuda_graph_replay(T: int, gpt_oss: bool) -> None:
    """fused_moe captures into a CUDA graph (no host sync, fixed shapes) and a replay over new
    inputs copied in place equals the eager call bit for bit; gpt-oss's experts (biases,
    swiglu_oai) too."""
    x, w13, w2, tw, ids = make_moe(T, 32, 512, 256, 4, torch.bfloat16, device="cuda", seed=1)
    kw = make_oai_kw(32, 512, 256, torch.bfloat16, "cuda", limit=2.0) if gpt_oss else {}
    with torch.inference_mode():
        fused_moe(x, w13, w2, tw, ids, **kw)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe(x, w13, w2, tw, ids, **kw)
        for seed in (2, 3):
            x2, _, _, tw2, ids2 = make_moe(T, 32, 512, 256, 4, torch.bfloat16, "cuda", seed=seed)
            x.copy_(x2)
            tw.copy_(tw2)
            ids.copy_(ids2)
            graph.replay()
            eager = fused_moe(x, w13, w2, tw, ids, **kw)
            assert torch.equal(out, eager)
            _check(out, fused_moe_ref(x, w13, w2, tw, ids, **kw))


@pytest.mark.gpu
@needs_cuda
def test_moe_pdl_on_off_equal() -> None:
    """The decode kernels launched with PDL (down preloading its first weight tile) compute
    exactly what plain launches do."""

    args = make_moe(4, 32, 512, 256, 4, torch.bfloat16, device="cuda", seed=4)
    with torch.inference_mode():
        with_pdl = fused_moe(*args, path="decode")
        with override(pdl=False):
            assert torch.equal(fused_moe(*args, path="decode"), with_pdl)
