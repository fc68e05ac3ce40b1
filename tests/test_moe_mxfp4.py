"""The MXFP4 MoE kernels (ops/moe_mxfp4.py: decode and grouped GEMM) against
dequantize-then-reference, under the Triton interpreter (TRITON_INTERPRET=1 pytest -m interpret)
at tiny shapes."""

from __future__ import annotations

import itertools

import pytest
import torch

from specserve.ops.mxfp4 import quantize_mxfp4
from specserve.tunables import override

from .test_moe_ops import _check, make_moe, make_oai_kw, needs_interpreter
from .test_triton_attention import interpreter  # noqa: F401  (fixture)


def _quantized(
    T: int, dtype: torch.dtype, seed: int, H: int = 64, inter: int = 64, routing: str = "random"
) -> tuple:
    x, w13, w2, tw, ids = make_moe(
        T, E=8, H=H, inter=inter, top_k=2, dtype=torch.float32, seed=seed, routing=routing
    )
    # Scaled so the blocks use a spread of E8M0 exponents (not only 2^-1 .. 2^0).
    w13 = w13 * torch.logspace(-3, 2, H, base=2)[None, None, :]
    (b13, s13), (b2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    return x.to(dtype), b13, s13, b2, s2, tw, ids


# K steps of one MXFP4 block (two steps at K = 64), many rows a program: the interpreter spends
# its time per program and per op, and the decode kernels' ops are many small ones.
SMALL_CONFIGS = ((32, 32, 1), (32, 32, 2))
# The odd-size test's K steps of 2 blocks, rows overhanging N (2 and 3 steps, the last partial;
# 64 rows a program as above).
ODD_CONFIGS = ((64, 64, 2), (64, 64, 2))


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("T", [1, 5])
def test_mxfp4_decode_matches_dequantized_reference(
    T: int, gpt_oss: bool, dtype: torch.dtype
) -> None:
    from specserve.ops.moe_mxfp4 import fused_moe_mxfp4_decode, fused_moe_mxfp4_ref
    from specserve.ops.moe_triton import PLAIN, Epilogue

    args = _quantized(T, dtype, seed=T)
    epi = Epilogue(**make_oai_kw(8, 64, 64, dtype, seed=T)) if gpt_oss else PLAIN
    ref = fused_moe_mxfp4_ref(*args, epilogue=epi)
    # NOTE: the table config (32 blocks a step) at T = 5 runs T = 1's paths, ~6 s interpreted
    if T == 1:
        _check(fused_moe_mxfp4_decode(*args, epilogue=epi), ref)
    if T > 1:  # K tiles of one MXFP4 block (16 bytes): the loop over K, the per-block scales
        _check(fused_moe_mxfp4_decode(*args, epilogue=epi, configs=SMALL_CONFIGS), ref)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.usefixtures("interpreter")
def test_mxfp4_decode_odd_sizes_and_validation() -> None:
    """H and I not powers of two (96, 160: tiles overhang), K steps of 2 blocks (a 2-step
    unrolled gate_up, a 3-step down with a masked tail); layouts that do not pair and bad
    configs fail with one clear line."""
    from specserve.ops.moe_mxfp4 import fused_moe_mxfp4_decode, fused_moe_mxfp4_ref
    from specserve.ops.moe_triton import Epilogue

    args = _quantized(3, torch.float32, seed=9, H=96, inter=160)
    ref = fused_moe_mxfp4_ref(*args)
    _check(fused_moe_mxfp4_decode(*args), ref)
    _check(fused_moe_mxfp4_decode(*args, configs=ODD_CONFIGS), ref)
    # the f16x2 path at these sizes, with gpt-oss's epilogue
    bf16 = _quantized(3, torch.bfloat16, seed=9, H=96, inter=160)
    epi = Epilogue(**make_oai_kw(8, 96, 160, torch.bfloat16, seed=9))
    bf16_ref = fused_moe_mxfp4_ref(*bf16, epilogue=epi)
    _check(fused_moe_mxfp4_decode(*bf16, epilogue=epi, configs=ODD_CONFIGS), bf16_ref)
    x, b13, s13, b2, s2, tw, ids = args
    with pytest.raises(ValueError, match="MXFP4 experts"):
        fused_moe_mxfp4_decode(x, b13, s13[:, :, :1], b2, s2, tw, ids)
    with pytest.raises(ValueError, match="MXFP4 decode config"):
        fused_moe_mxfp4_decode(*args, configs=((4, 48, 4), (4, 64, 4)))


def _f16(bits: int) -> float:
    import numpy as np

    return float(np.array([bits], np.uint16).view(np.float16)[0])


def _f16_bits(value: float) -> int:
    import numpy as np

    return int(np.array([value], np.float16).view(np.uint16)[0])


def _run_ptx(ptx: str, inputs: dict[str, int], memory: bytes = b"") -> dict[str, float | int]:
    """The few PTX instructions of moe_mxfp4's (and moe_mxfp4_decode's) inline asm, run in Python
    on 32-bit inputs ({"$8": word}; addresses index `memory`): the float outputs and the
    integer registers, by name. f16x2 math rounds once (numpy's float64 result to float16:
    products of these operands are exact)."""
    regs: dict[str, int] = dict(inputs)
    out: dict[str, float] = {}

    def val(tok: str) -> int:
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    def f16x2(bits: int) -> tuple[float, float]:
        return _f16(bits & 0xFFFF), _f16(bits >> 16)

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op.startswith("ld.global"):  # {d0, ..}, [addr] or d, [addr]: little-endian
            dests, addr = rest.rsplit(",", 1)
            at = regs[addr.strip(" []")]
            size = 1 if op.endswith(".u8") else 4
            for i, d in enumerate(t.strip(" {}") for t in dests.split(",")):
                regs[d] = int.from_bytes(memory[at + size * i : at + size * (i + 1)], "little")
            continue
        if op == "mov.b32":  # {lo, hi}, src: unpack the halves
            lo, hi, src = (t.strip(" {}") for t in rest.replace("},", ",").split(","))
            regs[lo], regs[hi] = regs[src] & 0xFFFF, regs[src] >> 16
            continue
        d, *args = (t.strip() for t in rest.split(","))
        if op == "cvt.f32.f16":
            out[d] = _f16(regs[args[0]])
            continue
        if op == "add.f32":
            out[d] = out[args[0]] + out[args[1]]
            continue
        if op == "add.rn.f16":  # on 16-bit registers
            regs[d] = _f16_bits(_f16(regs[args[0]]) + _f16(regs[args[1]]))
            continue
        a = [val(t) for t in args]
        if op in ("mul.rn.f16x2", "fma.rn.f16x2"):
            pairs = zip(*(f16x2(v) for v in a))
            lanes = [p[0] * p[1] + (p[2] if len(p) > 2 else 0.0) for p in pairs]
            r = _f16_bits(lanes[0]) | _f16_bits(lanes[1]) << 16
        elif op == "shl.b32":
            r = a[0] << a[1]
        elif op == "shr.b32":
            r = a[0] >> a[1]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "lop3.b32":  # bit i of the result: lut bit (a_i << 2 | b_i << 1 | c_i)
            r = 0
            for i in range(32):
                sel = (a[0] >> i & 1) << 2 | (a[1] >> i & 1) << 1 | (a[2] >> i & 1)
                r |= (a[3] >> sel & 1) << i
        else:
            raise AssertionError(f"unexpected PTX op {op}")
        regs[d] = r & 0xFFFFFFFF
    return {**regs, **out}


def _ptx_words() -> list[int]:
    """Every code at every nibble position, and random words."""
    g = torch.Generator().manual_seed(0)
    words = [c * 0x11111111 for c in range(16)]  # every nibble the same code
    words += [c << (4 * p) | (15 - c) << (4 * ((p + 3) % 8)) for c in range(16) for p in range(8)]
    return words + torch.randint(0, 1 << 32, (300,), generator=g, dtype=torch.int64).tolist()


def test_e2m1_word_ptx_decodes_every_code() -> None:
    """The inline PTX the compiled kernels decode code words with (`_e2m1_words`, the decode kernels' fp32
    path; the interpreter runs the Triton formulation instead) gives each nibble's E2M1 value times 2^-14, in column
    order: every code at every nibble position, and random words."""
    from specserve.ops.moe_mxfp4 import _E2M1_WORD_PTX
    from specserve.ops.mxfp4 import FP4_VALUES

    for w in _ptx_words():
        want = [FP4_VALUES[w >> (4 * c) & 15] * 2.0**-14 for c in range(8)]
        out = _run_ptx(_E2M1_WORD_PTX.value, {"$8": w})
        assert [out[f"${c}"] for c in range(8)] == want, hex(w)


def test_e2m1_block_dot_ptx_matches_the_dot_product() -> None:
    """The decode kernels' inline PTX (`_E2M1_BLOCK_DOT_PTX`: decode a block's 4 code words and accumulate
    all 32 products in one f16x2 register, pairs (8w + c, 8w + c + 4)) gives sum_k value_k *
    x_k * 2^-14 within fp16 rounding of the lanes' 16-term sums and of their sum, with the
    block's activations scaled as `_x_block_h2` scales them."""
    from specserve.ops.moe_mxfp4_decode import _E2M1_BLOCK_DOT_PTX
    from specserve.ops.mxfp4 import FP4_VALUES

    g = torch.Generator().manual_seed(2)
    words = _ptx_words()
    for i in range(0, len(words) - 3, 3):
        block = words[i : i + 4]
        x = torch.randn(32, generator=g, dtype=torch.float64)
        x = x * 2.0 ** (14.5 - x.abs().max().log2().ceil())  # max |x| in [2^13.5, 2^14.5)
        x = x.half().double() if i % 2 else x.bfloat16().half().double()
        regs = {f"${1 + w}": block[w] for w in range(4)}
        for w, c in itertools.product(range(4), range(4)):
            lo, hi = x[8 * w + c].item(), x[8 * w + c + 4].item()
            regs[f"${5 + 4 * w + c}"] = _f16_bits(lo) | _f16_bits(hi) << 16
        got = _run_ptx(_E2M1_BLOCK_DOT_PTX.value, regs)["$0"]
        codes = [block[k // 8] >> (4 * (k % 8)) & 15 for k in range(32)]
        terms = [FP4_VALUES[c] * 2.0**-14 * x[k].item() for k, c in enumerate(codes)]
        # 17 fp16 roundings on the way to each lane's and the block's sum
        bound = 17 * 2.0**-11 * sum(abs(t) for t in terms) + 1e-12
        assert abs(got - sum(terms)) <= bound, ([hex(w) for w in block], got, sum(terms))


def test_decode_load_ptx_reads_little_endian_words() -> None:
    """The decode kernels' code and activation loads (one 128-bit load: 4 words) and its scale byte load."""
    from specserve.ops.moe_mxfp4_decode import _LD_CODES_PTX, _LD_SCALE_PTX, _LD_X_PTX

    memory = bytes(range(48))
    for ptx in (_LD_CODES_PTX.value, _LD_X_PTX.value):
        regs = _run_ptx(ptx, {"$4": 16}, memory)
        assert [regs[f"${w}"] for w in range(4)] == [
            int.from_bytes(memory[16 + 4 * w : 20 + 4 * w], "little") for w in range(4)
        ]
    assert _run_ptx(_LD_SCALE_PTX.value, {"$1": 37}, memory)["$0"] == 37


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize(
    "T, routing, dtype, gpt_oss",
    [
        (37, "random", torch.float32, True),
        (37, "idle", torch.float32, False),  # experts with no tokens: no blocks, no writes
        (20, "random", torch.bfloat16, True),
        (3, "random", torch.float32, True),  # the GEMM forced on a decode-sized batch
    ],
)
def test_mxfp4_gemm_matches_dequantized_reference(
    T: int, routing: str, dtype: torch.dtype, gpt_oss: bool
) -> None:
    """The grouped GEMM (prefill / verification) with 4-bit experts, and "auto" choosing it
    above MXFP4_DECODE_MAX_PAIRS_PER_EXPERT pairs an expert (T = 37, top-2 of 8 experts)."""
    from specserve.ops.moe_mxfp4 import fused_moe_mxfp4_ref, fused_moe_mxfp4_triton
    from specserve.ops.moe_mxfp4_gemm import fused_moe_mxfp4_gemm
    from specserve.ops.moe_triton import PLAIN, Epilogue

    args = _quantized(T, dtype, seed=T, routing=routing)
    epi = Epilogue(**make_oai_kw(8, 64, 64, dtype, seed=T)) if gpt_oss else PLAIN
    ref = fused_moe_mxfp4_ref(*args, epilogue=epi)
    _check(fused_moe_mxfp4_triton(*args, path="gemm", epilogue=epi), ref)
    if T > 8 and dtype == torch.float32:  # "auto" -> GEMM; a K loop of 2 steps at BLOCK_K 32
        _check(fused_moe_mxfp4_triton(*args, epilogue=epi), ref)
        small = (16, 32, 32, 2, 4, 1)
        _check(fused_moe_mxfp4_gemm(*args, epilogue=epi, config=small), ref)


def test_mxfp4_auto_path_by_pairs_per_expert() -> None:
    """ "auto" keeps the decode kernels up to 3 (token, expert) pairs an expert on average (the
    H100 crossover, benchmarks/mxfp4.py --crossover): gpt-oss-20b (32 experts, top-4) to 24
    tokens, gpt-oss-120b (128 experts) to 96; judged on a captured graph's padded rows."""
    from specserve.ops import graph_rows
    from specserve.ops.moe_mxfp4 import uses_mxfp4_decode

    assert uses_mxfp4_decode(24, 4, 32) and not uses_mxfp4_decode(25, 4, 32)
    assert uses_mxfp4_decode(96, 4, 128) and not uses_mxfp4_decode(97, 4, 128)
    with graph_rows.uniform_batch(5, 8):  # 5 requests of 4 rows padded to a graph of 8
        assert not uses_mxfp4_decode(20, 4, 32)  # 8 x 4 rows = 32 tokens: the GEMM
        assert uses_mxfp4_decode(20, 4, 128)


def test_mxfp4_kernels_compile_for_sm90() -> None:
    """Both kernels compile for sm_90 at their launch configs (plain and gpt-oss epilogue)
    without spilling (the interpreter accepts code the compiler rejects)."""
    pytest.importorskip("triton")
    from specserve.ops import moe_mxfp4 as mx
    from specserve.ops import moe_mxfp4_gemm as mxg
    from specserve.ops.moe_triton import PLAIN, Epilogue

    from .test_moe_ops import _compile

    u8 = {"wb_ptr": "*u8", "ws_ptr": "*u8"}
    _compile_decode(mx, u8)
    # The grouped GEMM in bf16 at every config (gpt-oss-20b: 32 experts), gate_up with the gpt-oss epilogue and down: fits the H100's shared memory
    # and runs on tensor cores.
    oai = Epilogue(activation="swiglu_oai").consts()
    for per_expert in (1, 8, 32, 64, 1000):  # every table entry
        bm, bn, bk, group, warps, stages = mxg.mxfp4_gemm_config(
            per_expert * 32, 32, torch.bfloat16
        )
        for gate_up in (True, False):
            consts = dict(GATE_UP=gate_up, MUL_WEIGHT=not gate_up, HAS_BIAS=True)
            consts.update(oai if gate_up else PLAIN.consts())
            consts.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group)
            consts.update(DOT_PRECISION="tf32")
            types = {**u8, **{name: "*bf16" for name in ("a_ptr", "b_ptr", "c_ptr")}}
            out: list = []
            ptx = _compile(mxg._moe_mxfp4_gemm_kernel, consts, warps, stages, types, out)
            assert out[0].metadata.shared <= 227 * 1024, (consts, out[0].metadata.shared)
            assert ("wgmma" if bm >= 64 else "mma.sync") in ptx


def _compile_decode(mx, u8: dict) -> None:
    """The decode kernels at gpt-oss's H = I = 2880, top-4, every candidate config (gpt-oss epilogue, PDL,
    down preloading) and the table configs plain, without PDL and on fp32 activations: no
    spills; each thread holds its rows of a block: one 128-bit code load a (row, block) it
    owns and a step (the layout `_LD_CODES_PTX` relies on), the f16x2 block dot; nothing
    converted through shared memory (no local_alloc, only the final reduction's barriers);
    only down's preload loads before the PDL wait."""
    from specserve.ops import moe_mxfp4_decode as mxd
    from specserve.ops.moe_triton import PLAIN, Epilogue

    from .test_moe_ops import _compile

    oai = Epilogue(activation="swiglu_oai").consts()
    steps = lambda bk: -(-90 // (bk // 32))  # noqa: E731
    table_gate_up, table_down = mx.mxfp4_decode_configs(2880, 2880, 4)
    fp32 = {**u8, "x_ptr": "*fp32", "inter_ptr": "*fp32", "out_ptr": "*fp32"}
    gate_up_cases = [(c, True, u8) for c in mx.MXFP4_GATE_UP_CONFIGS]
    gate_up_cases += [(table_gate_up, False, u8), (table_gate_up, True, fp32)]
    for (bn, bk, warps), pdl, types in gate_up_cases:
        consts = dict(K=2880, HAS_BIAS=pdl, **(oai if pdl else PLAIN.consts()))
        consts.update(BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, ASM=True)
        consts.update(EVICT_FIRST=False)
        out: list = []
        ptx = _compile(mxd._moe_mxfp4_gate_up_kernel, consts, warps, types=types, compiled_out=out)
        assert ("griddepcontrol.wait" in ptx) == pdl
        if pdl:
            assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
        # lanes along the 32 blocks of a step, warps splitting the rows
        rows = bn // max(1, warps // (bk // 1024))
        assert ptx.count("ld.global.nc.v4.b32") == 2 * rows * steps(bk), (bn, bk, warps)
        assert ("fma.rn.f16x2" in ptx) == (types is u8)
        assert "local_alloc" not in out[0].asm["ttgir"]
        assert ptx.count("bar.sync") <= 4, ptx.count("bar.sync")
    # ops/l2.py's evict-first weight loads: every code and scale load carries the hint.
    for kernel, config, consts in (
        (mxd._moe_mxfp4_gate_up_kernel, table_gate_up, dict(**oai)),
        (mxd._moe_mxfp4_down_kernel, table_down, dict(BLOCK_TOPK=4, PRELOAD=True)),
    ):
        bn, bk, warps = config
        consts.update(K=2880, HAS_BIAS=True, BLOCK_N=bn, BLOCK_K=bk, PDL=True, ASM=True)
        ptx = _compile(kernel, {**consts, "EVICT_FIRST": True}, warps, types=u8)
        assert "ld.global.nc.v4.b32" not in ptx and "ld.global.nc.u8" not in ptx
        assert ptx.count("ld.global.nc.L2::cache_hint.v4.b32") > 0
        assert ptx.count("ld.global.nc.L2::cache_hint.u8") > 0
    down_cases = [(c, True, True, u8) for c in mx.MXFP4_DOWN_CONFIGS]
    down_cases += [(table_down, False, False, u8), (table_down, True, False, u8)]
    down_cases += [(table_down, True, True, fp32)]
    for (bn, bk, warps), pdl, preload, types in down_cases:
        consts = dict(K=2880, HAS_BIAS=pdl, BLOCK_TOPK=4, BLOCK_N=bn, BLOCK_K=bk)
        consts.update(PDL=pdl, PRELOAD=preload, ASM=True, EVICT_FIRST=False)
        out = []
        ptx = _compile(mxd._moe_mxfp4_down_kernel, consts, warps, types=types, compiled_out=out)
        assert ("griddepcontrol.launch_dependents" in ptx) == pdl
        if pdl:
            assert (ptx.index("ld.global") < ptx.index("griddepcontrol.wait")) == preload
        # lanes along the blocks, warps along the 4 experts, then the rows
        experts, rows = 4 // min(warps, 4), bn // max(1, warps // 4)
        assert ptx.count("ld.global.nc.v4.b32") == experts * rows * steps(bk), (bn, bk, warps)
        assert ("fma.rn.f16x2" in ptx) == (types is u8)
        assert "local_alloc" not in out[0].asm["ttgir"]
        assert ptx.count("bar.sync") <= 4, ptx.count("bar.sync")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 4, 8, 9, 64, 512, 1024])
def test_mxfp4_decode_gpu_gpt_oss_20b_shape(T: int) -> None:
    """bf16 activations, 4-bit experts at gpt-oss-20b's shape (H = I = 2880, 32 experts, top-4)
    with biases and swiglu_oai, against dequantize-then-reference: the decode kernels up to 8
    tokens, the grouped GEMM above (sparse to dense: 1 to 128 pairs an expert)."""
    from specserve.ops import moe_mxfp4 as mx
    from specserve.ops.moe_triton import Epilogue

    x, w13, w2, tw, ids = make_moe(T, 32, 2880, 2880, 4, torch.float32, device="cuda", seed=T)
    (b13, s13), (b2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    epi = Epilogue(**make_oai_kw(32, 2880, 2880, torch.bfloat16, "cuda", seed=T, limit=2.0))
    args = (x.bfloat16(), b13, s13, b2, s2, tw, ids)
    with torch.inference_mode():
        ref = mx.fused_moe_mxfp4_ref(*args, epi)
        _check(mx.fused_moe_mxfp4_triton(*args, epilogue=epi), ref)
        if T <= 8:  # the decode kernels at every candidate config
            gate_up, down = mx.mxfp4_decode_configs(2880, 2880, 4)
            pairs = [(g, down) for g in mx.MXFP4_GATE_UP_CONFIGS]
            pairs += [(gate_up, d) for d in mx.MXFP4_DOWN_CONFIGS]
            for configs in pairs:
                _check(mx.fused_moe_mxfp4_decode(*args, epilogue=epi, configs=configs), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 4])
def test_mxfp4_weights_evict_first_gpu_bit_equal(T: int) -> None:
    """ops/l2.py's evict-first weight loads are a hint: at gpt-oss-20b's shape the decode output
    is bit for bit the same with them as without."""
    from specserve.ops import moe_mxfp4 as mx
    from specserve.ops.moe_triton import Epilogue

    x, w13, w2, tw, ids = make_moe(T, 32, 2880, 2880, 4, torch.float32, device="cuda", seed=T)
    (b13, s13), (b2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    epi = Epilogue(**make_oai_kw(32, 2880, 2880, torch.bfloat16, "cuda", seed=T, limit=2.0))
    args = (x.bfloat16(), b13, s13, b2, s2, tw, ids)
    with torch.inference_mode():
        with override(weight_eviction=""):
            base = mx.fused_moe_mxfp4_decode(*args, epilogue=epi)
        with override(weight_eviction="evict_first"):
            assert torch.equal(mx.fused_moe_mxfp4_decode(*args, epilogue=epi), base)
