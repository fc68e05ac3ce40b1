"""The decode path's Triton kernels compile for sm_90 with programmatic dependent launch.

Compiled ahead of time on the CPU (Triton's bundled ptxas, no GPU): the interpreter runs these
kernels as Python and accepts code the compiler rejects, and PDL only exists compiled. Each
kernel must wait for its predecessor (griddepcontrol.wait) and let its successor launch. GPU equivalence with PDL on
is in test_gpu.py (graph == eager, greedy == transformers) and test_ops.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from specserve.attention.kv_quant import kv_quant_args  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
# Pointer arguments are bf16 unless named here; other runtime arguments are i32 unless named.
TYPES = {
    "slot_mapping_ptr": "*i64",
    "pos_ptr": "*i64",
    "positions_ptr": "*i64",
    "query_start_loc_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "block_table_ptr": "*i32",
    "cos_ptr": "*fp32",
    "sin_ptr": "*fp32",
    "ws_acc_ptr": "*fp32",
    "ws_m_ptr": "*fp32",
    "ws_l_ptr": "*fp32",
    "counter_ptr": "*i32",
    "kv_scales_ptr": "*fp32",
    "tree_start_ptr": "*i64",
    "tree_mask_ptr": "*i64",
    "tree_pos_ptr": "*i64",
    "scale": "fp32",
    "eps": "fp32",
    "res_ptr": "*bf16",
    "val_ptr": "*fp32",
    "idx_ptr": "*i32",
}


def compile_sm90(
    kernel,
    constexprs: dict,
    num_warps: int = 4,
    num_stages: int = 2,
    types: dict | None = None,
    divisible_by_16: tuple[str, ...] = (),
    compiled_out: list | None = None,
) -> str:
    """PTX of `kernel` compiled for sm_90 with PDL launch, given all its constexprs (and
    argument types where TYPES and the defaults do not fit). `divisible_by_16`: arguments
    compiled as multiples of 16 (16-byte aligned pointers), as Triton specializes them at run
    time; without it wide tiles compile to scalar loads. `compiled_out` receives the kernel."""
    sig, attrs = {}, {}
    # constexpr parameters with a default (e.g. ops/l2.py's W_EVICT) take it unless given
    defaults = {
        p.name: p.default
        for p in kernel.params
        if p.is_constexpr and p.default is not inspect.Parameter.empty
    }
    if "KV_FP8" in kernel.arg_names:  # the KV kernels: a 16-bit cache unless given
        defaults.update(kv_quant_args(torch.bfloat16))
    constexprs = {**defaults, **constexprs}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            default = TYPES.get(name, "*bf16" if name.endswith("_ptr") else "i32")
            sig[name] = (types or {}).get(name, default)
            if name in divisible_by_16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": True}
    compiled = triton.compile(src, target=SM90, options=opts)
    assert compiled.asm["cubin"], "no cubin"
    if compiled_out is not None:
        compiled_out.append(compiled)
    return compiled.asm["ptx"]


def _pdl_ptx(ptx: str) -> None:
    assert "griddepcontrol.wait" in ptx
    assert "griddepcontrol.launch_dependents" in ptx


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_gemv_compiles_with_pdl(silu_mul: bool, norm: bool, overlap: bool) -> None:
    """overlap: the first weight tile loaded before the wait (PRELOAD, every PDL launch), the
    successor triggered at the start (EARLY_TRIGGER: a qkv projection feeding attention that
    preloads its first key tile, pdl.early_kv)."""
    from specserve.ops.gemv import _gemv_kernel

    def constexprs(pdl: bool, **over: object) -> dict:
        base = dict(HAS_BIAS=True, SILU_MUL=silu_mul, NORM=norm, HAS_RES=norm, BLOCK_M=1)
        base.update(BLOCK_N=4, BLOCK_K=512, PDL=pdl, EARLY_TRIGGER=pdl and overlap)
        return {**base, "PRELOAD": pdl and overlap, **over}

    ptx = compile_sm90(_gemv_kernel, constexprs(True), num_stages=4)
    _pdl_ptx(ptx)
    # Where the first global load sits relative to the wait: before it only with the preload.
    first_load = ptx.index("ld.global")
    assert (first_load < ptx.index("griddepcontrol.wait")) == overlap
    trigger, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
    assert (trigger < wait) == overlap
    # Without PDL none of it is emitted: the kernel is the plain one.
    plain = compile_sm90(_gemv_kernel, constexprs(False, HAS_BIAS=False, HAS_RES=False))
    assert "griddepcontrol" not in plain


def test_gemv_argmax_epilogue_compiles_for_sm90() -> None:
    """The lm_head gemv's argmax epilogue for sm_90: one 64-bit atomic max a row behind a
    volatile read (ops/greedy_head.py), and the take kernel after it."""
    from specserve.ops.gemv import _gemv_kernel
    from specserve.ops.greedy_head import _take_kernel

    consts = dict(HAS_BIAS=False, SILU_MUL=False, NORM=False, HAS_RES=False, BLOCK_M=1)
    consts.update(BLOCK_N=4, BLOCK_K=2048, PDL=True, EARLY_TRIGGER=False, PRELOAD=True)
    consts.update(W_EVICT="evict_first", ARGMAX=True)
    ptx = compile_sm90(_gemv_kernel, consts, 4, 2, {"keys_ptr": "*i64"})
    _pdl_ptx(ptx)
    assert "atom.global" in ptx and ".max.s64" in ptx
    assert "ld.volatile.global" in ptx
    plain = compile_sm90(_gemv_kernel, {**consts, "ARGMAX": False}, 4, 2)
    assert "atom." not in plain and "ld.volatile" not in plain
    take = compile_sm90(_take_kernel, dict(BLOCK=1, PDL=True), 1, 1, {"keys_ptr": "*i64"})
    _pdl_ptx(take)


def test_gemv_plan_candidates_keep_their_rows_in_registers() -> None:
    """Every gemv config the one-row plan times compiles for sm_90 without spills (a whole-row
    config holds its row in registers: 64 a thread at (4, 4096, 8, 1) and (2, 4096, 4, 1)),
    with its whole first K tile requested before the PDL wait."""
    from specserve.ops.gemv import _gemv_kernel
    from specserve.ops.gemv_plan import CANDIDATES

    from .test_moe_ops import _cuobjdump

    div = tuple(
        n
        for n in _gemv_kernel.arg_names
        if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K")
    )
    for block_n, block_k, warps, stages in CANDIDATES:
        consts = dict(HAS_BIAS=False, SILU_MUL=False, NORM=False, HAS_RES=False, BLOCK_M=1)
        consts.update(BLOCK_N=block_n, BLOCK_K=block_k, PDL=True, EARLY_TRIGGER=False)
        out: list = []
        ptx = compile_sm90(_gemv_kernel, {**consts, "PRELOAD": True}, warps, stages, None, div, out)
        assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait")
        usage = _cuobjdump(out[-1], "--dump-resource-usage")
        assert "STACK:0 " in usage and "LOCAL:0 " in usage, (block_n, block_k, usage)


def test_norm_rope_activation_compile_with_pdl() -> None:
    from specserve.ops import triton_kernels as k

    for res in (False, True):
        _pdl_ptx(compile_sm90(k._rms_norm_kernel, dict(HAS_RES=res, BLOCK=4096, PDL=True)))
    rope = dict(HALF=64, BLOCK_D=64, BLOCK_HQ=32, BLOCK_HK=8, PDL=True)
    _pdl_ptx(compile_sm90(k._rope_kernel, rope))
    _pdl_ptx(compile_sm90(k._silu_and_mul_kernel, dict(BLOCK=1024, PDL=True)))
    _pdl_ptx(compile_sm90(k._argmax_chunks_kernel, dict(BLOCK=8192, PDL=True), num_warps=8))
    merge = dict(BLOCK_C=16, PDL=True)
    _pdl_ptx(compile_sm90(k._argmax_merge_kernel, merge, types={"out_ptr": "*i64"}))


# An fp8 cache's element type in a Triton signature, and its name in PTX's cvt instructions.
FP8_KV = {torch.float8_e4m3fn: ("*fp8e4nv", "e4m3"), torch.float8_e5m2: ("*fp8e5", "e5m2")}


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, *FP8_KV], ids=["bf16", "e4m3", "e5m2"])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("fuse_kv", [False, True])
def test_attention_kernels_compile_with_pdl(
    splits: int, fuse_kv: bool, kv_dtype: torch.dtype
) -> None:
    """Metadata loads before the wait, q and KV after it (ops/pdl.py); fuse_kv (tunables
    attn_fuse_rope_kv): RoPE + KV write inside the attention kernel. An fp8 cache
    (attention/kv_quant.py): every KV write quantizes with the hardware's saturating
    fp32 -> fp8 cvt and the key loop casts its tiles without an fp32 detour; the interpreter tests
    (tests/test_fp8_kv_kernels.py) cannot show that the bit tricks of kv_write.fp8_quantize
    compile."""
    from specserve.attention.kv_write import _reshape_and_cache_kernel
    from specserve.attention.paged_attention import _paged_attention_kernel
    from specserve.attention.rope_kv_write import _rope_and_cache_kernel
    from specserve.attention.split_merge import _combine_splits_kernel

    fp8 = FP8_KV.get(kv_dtype)
    types = {"q_eps": "fp32", "k_eps": "fp32"}
    if fp8 is not None:
        types.update(k_cache_ptr=fp8[0], v_cache_ptr=fp8[0])

    def quantizes(ptx: str) -> bool:
        return fp8 is not None and f"cvt.rn.satfinite.{fp8[1]}x2.f32" in ptx

    cache = dict(BLOCK_SIZE=16, HEAD_DIM=128, PDL=True, **kv_quant_args(kv_dtype))
    ptx = compile_sm90(_reshape_and_cache_kernel, dict(cache, BLOCK_H=8), types=types)
    _pdl_ptx(ptx)
    assert quantizes(ptx) == (fp8 is not None)
    rope = dict(cache, HALF=64, BLOCK_D=64, BLOCK_HQ=32, BLOCK_HK=8)
    attn = dict(
        GROUP=4,
        HEAD_DIM=128,
        BLOCK_SIZE=16,
        BLOCK_M=16,
        BLOCK_Q=4,
        BLOCK_N=64,
        USE_WINDOW=True,
        DOT_PRECISION="tf32",
        SPLITS=splits,
        PDL=True,
        FUSE_KV=fuse_kv,
        QK_NORM=fuse_kv,  # Qwen3's per-head q / k RMSNorm inside the fused RoPE tiles
        HAS_SINKS=False,
        **kv_quant_args(kv_dtype),
    )
    for kernel, consts in ((_rope_and_cache_kernel, rope), (_paged_attention_kernel, attn)):
        ptx = compile_sm90(kernel, consts, types=types)
        _pdl_ptx(ptx)
        assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait")
    assert "atom" not in ptx
    # The attention kernel writes the cache only when fused; it always reads it.
    assert quantizes(ptx) == (fp8 is not None and fuse_kv)
    if fp8 is not None:
        # The key loop casts its tiles to the dot dtype through the hardware's fp8 -> f16 cvt
        # and rescales no element (the scales join the scores and the output): a rescale of
        # each K and V element would add 128 fp32 multiplies a thread to the bf16 kernel's
        # (the fused quantizing write adds a few).
        assert f"cvt.rn.f16x2.{fp8[1]}x2" in ptx
        bf16 = dict(attn, **kv_quant_args(torch.bfloat16))
        plain = compile_sm90(
            _paged_attention_kernel, bf16, types={"q_eps": "fp32", "k_eps": "fp32"}
        )
        assert ptx.count("mul.f32") < plain.count("mul.f32") + 64
    if splits > 1:
        combine = dict(HEAD_DIM=128, SPLITS=splits, PDL=True)
        _pdl_ptx(compile_sm90(_combine_splits_kernel, combine))


@pytest.mark.parametrize(
    "splits,kv_dtype", [(1, torch.bfloat16), (4, torch.float8_e4m3fn)], ids=["bf16", "e4m3-split"]
)
def test_attention_tree_variant_compiles(splits: int, kv_dtype: torch.dtype) -> None:
    """The draft-tree variant (TREE) with a window and sinks at a verification tile (9 tokens x
    GQA 4): no spills, its tree metadata loads before the PDL wait with the rest, and only it
    tests ancestor bits (64-bit shifts)."""
    import re

    from specserve.attention.paged_attention import _PER_STEP_ARGS, _paged_attention_kernel

    from .test_moe_ops import _cuobjdump

    # As launched: q, the caches and strides aligned, the step's metadata not (_PER_STEP_ARGS).
    names = _paged_attention_kernel.arg_names
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride")]
    aligned = tuple(n for n in aligned if n not in _PER_STEP_ARGS)
    types = {"q_eps": "fp32", "k_eps": "fp32"}
    if kv_dtype != torch.bfloat16:
        types.update(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
    attn = dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_Q=16, BLOCK_N=64)
    attn.update(USE_WINDOW=True, DOT_PRECISION="tf32", SPLITS=splits, PDL=True)
    attn.update(FUSE_KV=False, QK_NORM=False, HAS_SINKS=True, **kv_quant_args(kv_dtype))
    out: list = []
    plain = compile_sm90(_paged_attention_kernel, attn, 4, 2, types, aligned)
    tree = compile_sm90(_paged_attention_kernel, dict(attn, TREE=True), 4, 2, types, aligned, out)
    _pdl_ptx(tree)
    wait = tree.index("griddepcontrol.wait")
    assert tree.count("ld.global.b64", 0, wait) > plain.count("ld.global.b64", 0, wait)
    shift64 = re.compile(r"shr\.[su]64")
    assert shift64.search(tree) and not shift64.search(plain)
    usage = _cuobjdump(out[-1], "--dump-resource-usage")
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage


def test_place_on_device_compiles() -> None:
    """It runs before the forward pass, without PDL unless tunables().pdl_step_kernels
    (tests/test_spec_kernels.py compiles that); compiled the same way: its loop has bounds
    loaded from memory, which the interpreter needs a workaround for."""
    from specserve.ops.spec_kernels_triton import _place_on_device_kernel

    i64 = {n: "*i64" for n in _place_on_device_kernel.arg_names if n.endswith("_ptr")}
    ptx = compile_sm90(_place_on_device_kernel, dict(BLOCK=256, PDL=False), types=i64)
    assert "griddepcontrol" not in ptx


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_attention_key_loop_pipeline_depth(stages: int) -> None:
    """What tunables attn_num_stages buys the decode attention's key loop (sm_90 compile): from
    3 stages the page ids of the next tile load an iteration ahead (an i32 shared buffer), from
    5 the K and V tiles are double-buffered."""
    import re

    from specserve.attention.paged_attention import _paged_attention_kernel

    attn = dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=4, BLOCK_N=64)
    attn.update(USE_WINDOW=False, DOT_PRECISION="tf32", SPLITS=1, PDL=True)
    attn.update(FUSE_KV=True, QK_NORM=False, HAS_SINKS=False)
    names = _paged_attention_kernel.arg_names
    aligned = tuple(n for n in names if n.endswith("_ptr") or n.startswith("stride"))
    out: list = []
    compile_sm90(
        _paged_attention_kernel,
        attn,
        4,
        stages,
        {"q_eps": "fp32", "k_eps": "fp32"},
        aligned,
        out,
    )
    bufs = re.findall(
        r"memdesc<(\d+)x(\d+x)?\d+x(i32|bf16), #shared\d?, #smem, mutable", out[0].asm["ttgir"]
    )
    depth = {kind: int(n) for n, _, kind in bufs}
    assert ("i32" in depth) == (stages >= 3)
    assert depth["bf16"] == (2 if stages >= 5 else 1)


def _loads_around_wait(attn: dict, load: str) -> tuple[int, int]:
    """(before, after) the PDL wait: PTX lines of `load` loads in the decode attention kernel
    compiled for sm_90 with the constexprs `attn` (a split launch, 4 warps, 2 stages)."""
    from specserve.attention.paged_attention import _paged_attention_kernel

    names = _paged_attention_kernel.arg_names
    aligned = tuple(n for n in names if n.endswith("_ptr") or n.startswith("stride"))
    types = {"q_eps": "fp32", "k_eps": "fp32"}
    ptx = compile_sm90(_paged_attention_kernel, attn, 4, 2, types, aligned)
    lines = ptx.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    hits = ["ld.global" in line and load in line for line in lines]
    return sum(hits[:wait]), sum(hits[wait:])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_first_key_tile_before_the_wait(head_dim: int) -> None:
    """EARLY_KV (pdl.early_kv): a split launch also requests its first key tile's keys and
    values (16-byte loads, K and V) before the PDL wait; the qkv projection feeding attention
    with heads of at most EARLY_KV_MAX_HEAD_DIM triggers at its start (DecodeLinear copies the
    flag), none with bigger heads."""
    from specserve.models.layers import Attention, RotaryEmbedding
    from specserve.ops import pdl
    from specserve.ops.gemv import DecodeLinear

    attn = dict(GROUP=8, HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=2, BLOCK_N=64)
    attn.update(USE_WINDOW=True, DOT_PRECISION="tf32", SPLITS=16, PDL=True)
    attn.update(FUSE_KV=True, QK_NORM=False, HAS_SINKS=True)
    before = [_loads_around_wait(dict(attn, EARLY_KV=e), "")[0] for e in (False, True)]
    assert before[1] - before[0] == 2 * 64 * head_dim * 2 // 16 // 128

    rope = RotaryEmbedding(head_dim, 64, 10000.0, None)
    small = Attention(512, 8, 1, head_dim, rope, 1e-6)
    assert small.qkv_proj.early_trigger == pdl.early_kv(head_dim) == (head_dim <= 64)
    assert DecodeLinear.sharing(small.qkv_proj).early_trigger == (head_dim <= 64)
    assert not getattr(small.o_proj, "early_trigger", False)


@pytest.mark.parametrize("model", ["qwen3", "gpt-oss"])
def test_attention_params_before_the_wait(model: str) -> None:
    """The layer's own parameters load before the PDL wait: Qwen3's fused q / k norm weights
    and their rotate-half partners (four 16-bit loads a thread), gpt-oss's sink logits (two);
    no other 16-bit load goes before it."""
    qwen3 = model == "qwen3"
    attn = dict(GROUP=8, HEAD_DIM=128 if qwen3 else 64, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=2)
    attn.update(BLOCK_N=64, USE_WINDOW=not qwen3, DOT_PRECISION="tf32", SPLITS=16, PDL=True)
    attn.update(FUSE_KV=True, QK_NORM=qwen3, HAS_SINKS=not qwen3)
    before, _ = _loads_around_wait(attn, "b16")
    assert before == (4 if qwen3 else 2)
