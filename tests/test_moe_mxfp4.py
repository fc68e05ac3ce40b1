"""The MXFP4 MoE kernels (ops/moe_mxfp4.py: decode and grouped GEMM) against
dequantize-then-reference, under the Triton interpreter (TRITON_INTERPRET=1 pytest -m interpret)
at tiny shapes."""

from __future__ import annotations

import pytest
import torch

from specserve.models.mxfp4 import quantize_mxfp4

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
    _check(fused_moe_mxfp4_decode(*args, epilogue=epi), ref)
    if T > 1:  # K tiles of one MXFP4 block (16 bytes): the loop over K, the per-block scales
        configs = ((4, 32, 4), (2, 32, 4))
        _check(fused_moe_mxfp4_decode(*args, epilogue=epi, configs=configs), ref)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.usefixtures("interpreter")
def test_mxfp4_decode_odd_sizes_and_validation() -> None:
    """H and I not powers of two (96, 160: tiles overhang), and layouts that do not pair fail
    with one clear line."""
    from specserve.ops.moe_mxfp4 import fused_moe_mxfp4_decode, fused_moe_mxfp4_ref

    args = _quantized(3, torch.float32, seed=9, H=96, inter=160)
    _check(fused_moe_mxfp4_decode(*args), fused_moe_mxfp4_ref(*args))
    x, b13, s13, b2, s2, tw, ids = args
    with pytest.raises(ValueError, match="MXFP4 experts"):
        fused_moe_mxfp4_decode(x, b13, s13[:, :, :1], b2, s2, tw, ids)


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
    above DECODE_MAX_TOKENS tokens."""
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


def test_mxfp4_kernels_compile_for_sm90() -> None:
    """Both kernels compile for sm_90 at their launch configs (plain and gpt-oss epilogue)
    without spilling (the interpreter accepts code the compiler rejects)."""
    pytest.importorskip("triton")
    from specserve.ops import moe_mxfp4 as mx
    from specserve.ops import moe_mxfp4_gemm as mxg
    from specserve.ops.moe_triton import PLAIN, Epilogue

    from .test_moe_ops import _compile

    u8 = {"wb_ptr": "*u8", "ws_ptr": "*u8"}
    gn, gk, gw = mx.MXFP4_GATE_UP_CONFIG
    dn, dk, dw = mx.MXFP4_DOWN_CONFIG
    for bias, epi in ((False, PLAIN), (True, Epilogue(activation="swiglu_oai"))):
        consts = dict(HAS_BIAS=bias, **epi.consts(), BLOCK_N=gn, BLOCK_K=gk)
        _compile(mx._moe_mxfp4_gate_up_kernel, consts, gw, types=u8)
        consts = dict(HAS_BIAS=bias, BLOCK_TOPK=4, BLOCK_N=dn, BLOCK_K=dk)
        _compile(mx._moe_mxfp4_down_kernel, consts, dw, types=u8)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 4, 8, 9, 64, 512, 1024])
def test_mxfp4_decode_gpu_gpt_oss_20b_shape(T: int) -> None:
    """bf16 activations, 4-bit experts at gpt-oss-20b's shape (H = I = 2880, 32 experts, top-4)
    with biases and swiglu_oai, against dequantize-then-reference: the decode kernels up to 8
    tokens, the grouped GEMM above (sparse to dense: 1 to 128 pairs an expert)."""
    from specserve.ops.moe_mxfp4 import fused_moe_mxfp4_ref, fused_moe_mxfp4_triton
    from specserve.ops.moe_triton import Epilogue

    x, w13, w2, tw, ids = make_moe(T, 32, 2880, 2880, 4, torch.float32, device="cuda", seed=T)
    (b13, s13), (b2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    epi = Epilogue(**make_oai_kw(32, 2880, 2880, torch.bfloat16, "cuda", seed=T, limit=2.0))
    args = (x.bfloat16(), b13, s13, b2, s2, tw, ids)
    with torch.inference_mode():
        _check(fused_moe_mxfp4_triton(*args, epilogue=epi), fused_moe_mxfp4_ref(*args, epi))
