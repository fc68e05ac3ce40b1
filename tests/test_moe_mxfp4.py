"""The MXFP4 MoE decode kernels (ops/moe_mxfp4.py) against dequantize-then-reference, under the
Triton interpreter (TRITON_INTERPRET=1 pytest -m interpret) at tiny shapes."""

from __future__ import annotations

import pytest
import torch

from specserve.models.mxfp4 import quantize_mxfp4

from .test_moe_ops import _check, make_moe, make_oai_kw, needs_interpreter
from .test_triton_attention import interpreter  # noqa: F401  (fixture)


def _quantized(T: int, dtype: torch.dtype, seed: int, H: int = 64, inter: int = 64) -> tuple:
    x, w13, w2, tw, ids = make_moe(
        T, E=8, H=H, inter=inter, top_k=2, dtype=torch.float32, seed=seed
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


def test_mxfp4_kernels_compile_for_sm90() -> None:
    """Both kernels compile for sm_90 at their launch configs (plain and gpt-oss epilogue)
    without spilling (the interpreter accepts code the compiler rejects)."""
    pytest.importorskip("triton")
    from specserve.ops import moe_mxfp4 as mx
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 4, 8])
def test_mxfp4_decode_gpu_gpt_oss_20b_shape(T: int) -> None:
    """bf16 activations, 4-bit experts at gpt-oss-20b's shape (H = I = 2880, 32 experts, top-4)
    with biases and swiglu_oai, against dequantize-then-reference."""
    from specserve.ops.moe_mxfp4 import fused_moe_mxfp4_decode, fused_moe_mxfp4_ref
    from specserve.ops.moe_triton import Epilogue

    x, w13, w2, tw, ids = make_moe(T, 32, 2880, 2880, 4, torch.float32, device="cuda", seed=T)
    (b13, s13), (b2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    epi = Epilogue(**make_oai_kw(32, 2880, 2880, torch.bfloat16, "cuda", seed=T, limit=2.0))
    args = (x.bfloat16(), b13, s13, b2, s2, tw, ids)
    with torch.inference_mode():
        _check(fused_moe_mxfp4_decode(*args, epilogue=epi), fused_moe_mxfp4_ref(*args, epi))
