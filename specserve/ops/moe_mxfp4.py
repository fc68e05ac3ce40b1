"""`fused_moe` over MXFP4 expert weights, dequantized in registers (decode and grouped GEMM).

gpt-oss ships its experts in MXFP4 (ops/mxfp4.py: 32 E2M1 codes a block, two a byte, low
nibble first, and one E8M0 exponent a block). Decode streams expert weights, so reading them at
4.25 bits instead of 16 cuts the step's dominant bytes ~3.8x. The kernels are
ops/moe_triton.py's with the weight tile replaced: 4-bit codes and their per-32 scales are
loaded and decoded in registers.

  ops/moe_mxfp4_decode.py      decode (`uses_mxfp4_decode`): a thread owns whole blocks (one
                               128-bit code load, one scale byte, one PTX decode + f16x2 dot
                               per (row, block)), BLOCK_N rows a thread sharing each block's
                               activation conversion.
  ops/moe_mxfp4_gemm.py        prefill / verification: the grouped GEMM over the same 4-bit
                               tiles.
This module holds the in-register dequantization helpers both build on, the decode launch
configs and the dispatch.

Weights in StackedExperts' row layout, quantized along the input dim (models/moe.py
Mxfp4Experts holds them):
  w13_blocks [E, 2I, H / 32, 16] uint8, w13_scales [E, 2I, H / 32] uint8 (gate rows, then up)
  w2_blocks  [E, H, I / 32, 16] uint8,  w2_scales  [E, H, I / 32] uint8
`fused_moe_mxfp4_triton` picks decode or GEMM by the token count (host-known, so a captured
graph holds one path; no host sync, buffers as the bf16 path allocates them);
`fused_moe_mxfp4_ref` (dequantize, then ops/moe.py's reference) is what the tests compare with.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specserve.ops import graph_rows, l2, pdl
from specserve.ops.moe import fused_moe_ref
from specserve.ops.moe_triton import (
    PLAIN,
    ConfigTable,
    DecodeConfig,
    Epilogue,
    table_configs,
)
from specserve.ops.mxfp4 import BLOCK, dequantize_mxfp4

# "auto" runs the decode kernels rather than the grouped GEMM while the batch's (token, expert)
# pairs are at most this many a expert on average: decode reads each chosen expert once a
# pair, the GEMM once a 16-pair tile but dequantizes it at ~25% of the copy bandwidth. H100,
# `python benchmarks/mxfp4.py --crossover 8,12,16,24,32,48,64`, us a layer decode / GEMM:
# gpt-oss-20b (32 experts, top-4) T = 16 351 / 541, 24 521 / 613, 32 693 / 639; gpt-oss-120b
# (128 experts) T = 16 357 / 929, 64 1383 / 2017: the crossover is near 3.5 pairs an expert
# (20b T = 28).
MXFP4_DECODE_MAX_PAIRS_PER_EXPERT = 3.0
# Decode launch configs (BLOCK_N, BLOCK_K, num_warps) of ops/moe_mxfp4_decode.py: lanes own
# blocks, so NB = BLOCK_K / 32 = 32 (one block a lane a step), and warps split the rows
# (gate_up) or the experts, then the rows (down): each thread holds BLOCK_N / (warps on that
# dim) rows of a block, sharing one activation conversion. At H = I = 2880 (90 blocks) a row is
# 3 steps, 6 of 96 blocks masked. From sm_90 compile evidence (gpt-oss-20b shape, SASS
# instructions a code word / registers): gate_up (8, 1024, 2) 4 rows a thread 24.1 / 104 (~19
# warps an SM), (8, 1024, 1) 8 rows 21.3 / 148 (13 warps), (4, 1024, 2) 2 rows 30 / 79. down
# (8, 1024, 4) 8 rows 24.4 / 111 (18 warps; one token fills ~11 an SM anyway), (4, 1024, 4)
# 29.8 / 88, (2, 1024, 4) 41 / 80. A thread owning one 32-bit code word of a block instead
# costs ~42 instructions a word: 31.1 / 97.0 / 182.3 us a layer at 1 / 4 / 8 tokens against
# these tables' 28.0 / 78.5 / 130.2 (H100, gpt-oss-20b, the whole op, `python
# benchmarks/mxfp4.py`). gate_up (16, 1024, 2) is 1.5 us faster at one token and 3 / 8 us slower at 4 / 8
# (MXFP4_GATE_UP_ONE_TOKEN, for batches of one token).
MXFP4_GATE_UP_TABLE: ConfigTable = ((float("inf"), float("inf"), (8, 1024, 2)),)
MXFP4_DOWN_TABLE: ConfigTable = ((float("inf"), float("inf"), (8, 1024, 4)),)
MXFP4_GATE_UP_ONE_TOKEN: DecodeConfig = (16, 1024, 2)
# What `python benchmarks/mxfp4.py` sweeps.
MXFP4_GATE_UP_CONFIGS: tuple[DecodeConfig, ...] = (
    (8, 1024, 2),
    (8, 1024, 1),
    (4, 1024, 1),
    (16, 1024, 2),
)
MXFP4_DOWN_CONFIGS: tuple[DecodeConfig, ...] = (
    (8, 1024, 4),
    (4, 1024, 4),
    (16, 1024, 8),
    (8, 1024, 8),
)


def mxfp4_decode_configs(
    hidden: int, inter: int, top_k: int, tokens: int = 0
) -> tuple[DecodeConfig, DecodeConfig]:
    """(gate_up, down) launch configs of the decode kernels for this shape; `tokens`: the
    batch's rows as a captured graph runs them (graph_rows.row_bound; 0: any)."""
    configs = table_configs(MXFP4_GATE_UP_TABLE, MXFP4_DOWN_TABLE, hidden, inter, top_k)
    return (MXFP4_GATE_UP_ONE_TOKEN, configs[1]) if tokens == 1 else configs


@triton.jit
def _e2m1(codes):
    """Code bytes (any int type, 0..255) -> (low nibble, high nibble) values times 2^-14, fp32.

    NOTE: an E2M1 code's bits dropped into an fp16 (sign -> bit 15, exponent -> bits 10-11,
    mantissa -> bit 9) are its value times 2^-14, E2M1's subnormal 0.5 landing on fp16's
    subnormal. Both nibbles of a byte go into one 32-bit word at once (a multiply places two
    shifted copies of the byte without overlap: b << 9 | b << 21 and b << 12 | b << 24), then
    each half converts: ~3 integer ops a byte and one conversion a weight, where a table or
    exp2 per weight would leave decode bound by the SMs instead of the weight stream."""
    b = codes.to(tl.uint32)
    bits = ((b * 0x200200) & 0x0E000E00) | ((b * 0x1001000) & 0x80008000)
    lo = (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (bits >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _mxfp4_tile(byte_ptrs, scale_ptrs, ok):
    """(even, odd) fp32 weights of a tile of code bytes: the low nibbles are the even columns,
    the high nibbles the odd ones, both times their block's scale (GEMM operands)."""
    lo, hi = _e2m1(tl.load(byte_ptrs, mask=ok, other=0))
    scale = _scale_bits(scale_ptrs, ok)
    return lo * scale, hi * scale


# --- 32-bit code words: the E2M1 word decode and fp16 helpers moe_mxfp4_decode.py builds on -----


@triton.jit
def _half2_f32(h):
    """(low half, high half) of 32-bit words of two fp16 bit patterns, as fp32."""
    lo = (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


# PTX of `_e2m1_words` (one word in $8, its 8 fp32 values out in $0..$7): ptxas keeps the
# select of two shifted copies as one lop3 (0xE4: a where c, else b) and reads the fp16 halves
# in place (HADD2.F32 .H0/.H1); from the Triton expression, LLVM splits the selects and masks
# per 16-bit half (~25 integer ops a word instead of 11).
_E2M1_WORD_PTX = tl.constexpr("""{
.reg .b32 t, q, h;
.reg .b16 l, u;
shl.b32 t, $8, 1;
shl.b32 q, $8, 4;
lop3.b32 q, t, q, 0x0E0E0E0E, 0xE4;
and.b32 h, q, 0x8E008E00;
mov.b32 {l, u}, h;
cvt.f32.f16 $2, l;
cvt.f32.f16 $6, u;
shl.b32 h, q, 8;
and.b32 h, h, 0x8E008E00;
mov.b32 {l, u}, h;
cvt.f32.f16 $0, l;
cvt.f32.f16 $4, u;
shr.b32 t, $8, 3;
lop3.b32 q, t, $8, 0x0E0E0E0E, 0xE4;
and.b32 h, q, 0x8E008E00;
mov.b32 {l, u}, h;
cvt.f32.f16 $3, l;
cvt.f32.f16 $7, u;
shl.b32 h, q, 8;
and.b32 h, h, 0x8E008E00;
mov.b32 {l, u}, h;
cvt.f32.f16 $1, l;
cvt.f32.f16 $5, u;
}""")


@triton.jit
def _e2m1_words(words, ASM: tl.constexpr):
    """The 8 E2M1 codes of 32-bit code words (4 bytes, low nibble first: nibble c is column c of
    the word) as fp32 values times 2^-14, in column order.

    NOTE: as `_e2m1` (an E2M1 code's bits at fp16 bits 9-11 and 15 are its value times 2^-14),
    but a word at a time: `q` moves each byte's low (q_even) or high (q_odd) nibble to bits 1-3
    (magnitude) and 7 (sign) of its byte, one select of two shifted copies (junk elsewhere,
    masked later). Bytes 1 and 3 of `q` then already sit where fp16 halves want them (one
    mask), bytes 0 and 2 after a shift by 8: 11 integer ops a word (2.75 a byte, against ~5 a
    byte unpacking bytes one at a time) and one conversion a weight. ASM: the same as PTX
    (_E2M1_WORD_PTX; compiled kernels), else in Triton (the interpreter runs no inline PTX)."""
    if ASM:
        f32 = tl.float32
        return tl.inline_asm_elementwise(
            _E2M1_WORD_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], (f32,) * 8, is_pure=True, pack=1
        )
    w = words.to(tl.uint32, bitcast=True)
    q_even = ((w << 1) & 0x0E0E0E0E) | ((w << 4) & 0xF1F1F1F1)
    q_odd = ((w >> 3) & 0x0E0E0E0E) | (w & 0xF1F1F1F1)
    x0, x4 = _half2_f32((q_even << 8) & 0x8E008E00)
    x2, x6 = _half2_f32(q_even & 0x8E008E00)
    x1, x5 = _half2_f32((q_odd << 8) & 0x8E008E00)
    x3, x7 = _half2_f32(q_odd & 0x8E008E00)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _scale_bits(scale_ptrs, ok):
    """fp32 2^(s - 127) of E8M0 scales s, times 2^14 to undo _e2m1's 2^-14, built as fp32 bits
    in one integer op (exact; s <= 240). NOTE: not exp2: the grouped GEMM scales every weight
    it dequantizes, and MUFU.EX2 runs at a quarter of the integer rate."""
    s = tl.load(scale_ptrs, mask=ok, other=0).to(tl.int32)
    return ((s + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dot_words(words, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """Per code word: sum_c value(nibble c) * x_c, unscaled (x 2^-14), fp32."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_words(words, ASM)
    acc = c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3
    return acc + c4 * x4 + c5 * x5 + c6 * x6 + c7 * x7


@triton.jit
def _f16_halves(h):
    """(low half, high half) fp16 of 32-bit words of two fp16 bit patterns."""
    lo = (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _fp16_codes(w):
    """A code word's 8 codes as fp16 (value x 2^-14), paired as the PTX pairs them:
    (c2, c6), (c0, c4), (c3, c7), (c1, c5)."""
    w = w.to(tl.uint32, bitcast=True)
    q_even = ((w << 1) & 0x0E0E0E0E) | ((w << 4) & 0xF1F1F1F1)
    q_odd = ((w >> 3) & 0x0E0E0E0E) | (w & 0xF1F1F1F1)
    c2, c6 = _f16_halves(q_even & 0x8E008E00)
    c0, c4 = _f16_halves((q_even << 8) & 0x8E008E00)
    c3, c7 = _f16_halves(q_odd & 0x8E008E00)
    c1, c5 = _f16_halves((q_odd << 8) & 0x8E008E00)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _pack_half2(lo, hi, ASM: tl.constexpr):
    """int32 words of fp32 (lo, hi) rounded to fp16 (lo in the low half): one cvt a pair."""
    if ASM:
        return tl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], tl.int32, is_pure=True, pack=1
        )
    lo16 = lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    hi16 = hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    return (lo16 | (hi16 << 16)).to(tl.int32, bitcast=True)


def _check_pair(blocks: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> None:
    E = blocks.shape[0]
    want_b, want_s = (E, rows, cols // BLOCK, BLOCK // 2), (E, rows, cols // BLOCK)
    if cols % BLOCK or tuple(blocks.shape) != want_b or tuple(scales.shape) != want_s:
        raise ValueError(
            f"MXFP4 experts: blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)}, "
            f"expected {want_b} / {want_s} (uint8, contiguous)"
        )
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError("MXFP4 experts: blocks and scales must be uint8")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def uses_mxfp4_decode(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether "auto" takes the decode kernels: judged as moe_triton.uses_decode_path, on the
    rows a captured graph runs, against MXFP4_DECODE_MAX_PAIRS_PER_EXPERT."""
    pairs = graph_rows.row_bound(num_tokens) * top_k
    return pairs <= MXFP4_DECODE_MAX_PAIRS_PER_EXPERT * num_experts


def _check_config(config: DecodeConfig) -> None:
    block_n, block_k, warps = config
    if block_k < 32 or block_k & (block_k - 1) or block_n & (block_n - 1) or warps < 1:
        raise ValueError(
            f"MXFP4 decode config {config}: BLOCK_N a power of two, BLOCK_K a power of two >= 32"
        )


def _aligned16(t: torch.Tensor, name: str, copy: bool) -> torch.Tensor:
    """t with its rows 16-byte aligned, as the decode kernels' 128-bit loads need: a copy of activations
    (`copy`: T rows, cheap), an error for weights (copying them each call would cost more than
    the kernel)."""
    rows_ok = all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) and t.stride(-1) == 1
    if t.data_ptr() % 16 == 0 and rows_ok:
        return t
    if copy:
        return t.clone(memory_format=torch.contiguous_format)
    raise ValueError(f"MXFP4 decode: {name} must start 16-byte aligned (got a view?)")


# NOTE: the decode kernels below replaced byte-tile kernels with a reduction every K step (the
# simplest formulation, slower at every measured shape); those are in git history at b3db210.
def _gate_up(
    # [T, H]
    x: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    topk_ids: torch.Tensor,
    # [P, I]
    inter: torch.Tensor,
    epilogue: Epilogue,
    config: DecodeConfig,
) -> None:
    from specserve.ops.moe_mxfp4_decode import _moe_mxfp4_gate_up_kernel  # imports this

    P, inter_size = inter.shape
    H, top_k = x.shape[1], topk_ids.shape[1]
    bn, bk, warps = config
    b13 = epilogue.w13_bias
    x = _aligned16(x, "x", copy=True)
    _aligned16(w13_blocks, "w13_blocks", copy=False)
    kw = pdl.launch_kwargs(x.device)
    # K a constexpr (one compile a model shape): the unrolled steps' masks fold away.
    _moe_mxfp4_gate_up_kernel[(P * triton.cdiv(inter_size, bn),)](
        x, w13_blocks, w13_scales, x if b13 is None else b13, topk_ids, inter, inter_size, P,
        top_k, x.stride(0), 0 if b13 is None else b13.stride(0), inter.stride(0), K=H,
        HAS_BIAS=b13 is not None, **epilogue.consts(), BLOCK_N=bn, BLOCK_K=bk,
        ASM=not _interpreting(), EVICT_FIRST=l2.weights_evict_first(), num_warps=warps, **kw,
    )  # fmt: skip


def _down(
    # [P, I]
    inter: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    # [T, H]
    out: torch.Tensor,
    epilogue: Epilogue,
    config: DecodeConfig,
) -> None:
    from specserve.ops.moe_mxfp4_decode import _moe_mxfp4_down_kernel  # imports this

    T, top_k = topk_ids.shape
    H, inter_size = out.shape[1], inter.shape[1]
    bn, bk, warps = config
    b2 = epilogue.w2_bias
    kw = pdl.launch_kwargs(out.device)
    _aligned16(inter, "inter", copy=False)  # allocated by fused_moe_mxfp4_decode
    _aligned16(w2_blocks, "w2_blocks", copy=False)
    _moe_mxfp4_down_kernel[(T * triton.cdiv(H, bn),)](
        inter, w2_blocks, w2_scales, out if b2 is None else b2, topk_ids, topk_weights, out, H,
        T, top_k, inter.stride(0), 0 if b2 is None else b2.stride(0), out.stride(0),
        K=inter_size, HAS_BIAS=b2 is not None, BLOCK_TOPK=triton.next_power_of_2(top_k),
        BLOCK_N=bn, BLOCK_K=bk, PRELOAD=kw["PDL"], ASM=not _interpreting(),
        EVICT_FIRST=l2.weights_evict_first(), num_warps=warps, **kw,
    )  # fmt: skip


def fused_moe_mxfp4_decode(
    # [T, H]
    x: torch.Tensor,
    # [E, 2I, H / 32, 16], [E, 2I, H / 32] uint8
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    # [E, H, I / 32, 16], [E, H, I / 32] uint8
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    # [T, top_k] float32
    topk_weights: torch.Tensor,
    # [T, top_k]
    topk_ids: torch.Tensor,
    epilogue: Epilogue = PLAIN,
    configs: tuple[DecodeConfig, DecodeConfig] | None = None,
) -> torch.Tensor:
    """[T, H] in x's dtype: `fused_moe`'s decode path with 4-bit experts (any T; meant for
    small batches, `uses_mxfp4_decode`). `configs`: (gate_up, down) launch configs (default:
    the shape tables)."""
    T, top_k = topk_ids.shape
    H = x.shape[1]
    two_i = w13_blocks.shape[1]
    inter_size = two_i // 2
    _check_pair(w13_blocks, w13_scales, two_i, H)
    _check_pair(w2_blocks, w2_scales, H, inter_size)
    rows = graph_rows.row_bound(T)
    gate_up_config, down_config = configs or mxfp4_decode_configs(H, inter_size, top_k, rows)
    _check_config(gate_up_config)
    _check_config(down_config)
    if T == 0:
        return torch.empty_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    w13_blocks, w13_scales = w13_blocks.contiguous(), w13_scales.contiguous()
    w2_blocks, w2_scales = w2_blocks.contiguous(), w2_scales.contiguous()
    inter = torch.empty(T * top_k, inter_size, dtype=x.dtype, device=x.device)
    _gate_up(x, w13_blocks, w13_scales, topk_ids, inter, epilogue, gate_up_config)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    _down(inter, w2_blocks, w2_scales, topk_weights, topk_ids, out, epilogue, down_config)
    return out


def fused_moe_mxfp4_triton(
    # [T, H]
    x: torch.Tensor,
    # [E, 2I, H / 32, 16], [E, 2I, H / 32] uint8
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    # [E, H, I / 32, 16], [E, H, I / 32] uint8
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    # [T, top_k] float32
    topk_weights: torch.Tensor,
    # [T, top_k]
    topk_ids: torch.Tensor,
    path: str = "auto",
    epilogue: Epilogue = PLAIN,
) -> torch.Tensor:
    """`fused_moe`'s Triton paths with 4-bit experts: "auto" (the decode kernels up to
    MXFP4_DECODE_MAX_PAIRS_PER_EXPERT pairs an expert, the grouped GEMM above), "decode" or
    "gemm"."""
    E, two_i = w13_blocks.shape[:2]
    H = x.shape[1]
    b13, b2 = epilogue.w13_bias, epilogue.w2_bias
    if (b13 is not None and b13.shape != (E, two_i)) or (b2 is not None and b2.shape != (E, H)):
        raise ValueError(
            f"MXFP4 experts: biases {None if b13 is None else tuple(b13.shape)} / "
            f"{None if b2 is None else tuple(b2.shape)}, expected ({E}, {two_i}) / ({E}, {H})"
        )
    args = (x, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids)
    T, top_k = topk_ids.shape
    if path == "decode" or (path == "auto" and uses_mxfp4_decode(T, top_k, E)):
        return fused_moe_mxfp4_decode(*args, epilogue=epilogue)
    from specserve.ops.moe_mxfp4_gemm import fused_moe_mxfp4_gemm  # it imports this module

    return fused_moe_mxfp4_gemm(*args, epilogue=epilogue)


def fused_moe_mxfp4_ref(
    x: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    epilogue: Epilogue = PLAIN,
) -> torch.Tensor:
    """Dequantize (exact in x's dtype), then `fused_moe_ref`."""
    w13 = dequantize_mxfp4(w13_blocks, w13_scales, x.dtype)
    w2 = dequantize_mxfp4(w2_blocks, w2_scales, x.dtype)
    e = epilogue
    return fused_moe_ref(
        x, w13, w2, topk_weights, topk_ids,
        w13_bias=e.w13_bias, w2_bias=e.w2_bias, activation=e.activation, alpha=e.alpha,
        limit=e.limit,
    )  # fmt: skip
