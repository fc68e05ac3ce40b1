"""The MXFP4 MoE decode kernels (ops/moe_mxfp4.py dispatches to them): a thread owns blocks.

A thread owning one 32-bit code word (8 codes) of a block per row spends ~42 sm_90 SASS
instructions a word, ~18 of them on decode and math, the rest on per-word addressing, scales
and activation conversion (issue-bound at ~55-60% of the copy bandwidth). Here a thread owns
(row, MXFP4 block) pairs whole:

  * the block's 16 code bytes are ONE 128-bit load, its scale byte one load;
  * one inline-PTX routine (`_E2M1_BLOCK_DOT_PTX`) decodes the 4 words with moe_mxfp4's
    11-op bit trick and accumulates all 32 products in f16x2 against the block's
    activations, then converts once to fp32 (~16 instructions a word);
  * the block's 32 activations become 16 fp16 pairs once per block (`_x_block_h2`, scaled so
    fp16 cannot overflow) and serve every row the thread holds: BLOCK_N rows in registers.

Layout: each K step's tensors are [BLOCK_N, NB] (gate_up) or [BLOCK_N, BLOCK_TOPK, NB]
(down; NB = BLOCK_K / 32 blocks a step) in Triton's default blocked layout, which puts lanes
along the last dim first and then warps, so with NB = 32 a warp's lanes own 32 consecutive
blocks (512 contiguous bytes a row), and warps beyond that split the experts (down) and the
rows. The loads are inline PTX: elementwise asm is computed in its consumer's layout, where
a tl.load takes the coalescer's (4 threads a block for the activations) and would be
converted through shared memory every step. One cross-thread reduction follows the K loop.

fp32 activations (tests, fp32 models) keep fp32 math (`_e2m1_words` + FMAs): fp16 would
round them to 11 bits. ASM=False is the same computation in plain Triton for the
interpreter (f16x2 arithmetic emulated in fp16).
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.ops import pdl
from specserve.ops.moe_mxfp4 import _dot_words, _fp16_codes, _half2_f32, _pack_half2
from specserve.ops.moe_triton import _down_program, _gate_up_store, _routing


def _block_dot_ptx() -> str:
    """PTX of `_dot_block_h2`: $1..$4 the block's code words, $5 + 4w + c the fp16 pair
    (x[8w + c], x[8w + c + 4]) of word w, $0 the fp32 sum. Per word `_E2M1_WORD_PTX`'s 11
    integer ops and 4 HFMA2, all into one f16x2 accumulator; one conversion a block."""
    lines = [".reg .b32 t, q, h, a;", ".reg .b16 l, u;"]
    for w in range(4):
        code, x = f"${1 + w}", [f"${5 + 4 * w + c}" for c in range(4)]
        first = f"mul.rn.f16x2 a, h, {x[2]};" if w == 0 else f"fma.rn.f16x2 a, h, {x[2]}, a;"
        lines += [
            f"shl.b32 t, {code}, 1;",
            f"shl.b32 q, {code}, 4;",
            "lop3.b32 q, t, q, 0x0E0E0E0E, 0xE4;",  # low nibbles -> bits 1-3, 7 of each byte
            "and.b32 h, q, 0x8E008E00;",  # columns (2, 6)
            first,
            "shl.b32 h, q, 8;",
            "and.b32 h, h, 0x8E008E00;",  # columns (0, 4)
            f"fma.rn.f16x2 a, h, {x[0]}, a;",
            f"shr.b32 t, {code}, 3;",
            f"lop3.b32 q, t, {code}, 0x0E0E0E0E, 0xE4;",  # high nibbles
            "and.b32 h, q, 0x8E008E00;",  # columns (3, 7)
            f"fma.rn.f16x2 a, h, {x[3]}, a;",
            "shl.b32 h, q, 8;",
            "and.b32 h, h, 0x8E008E00;",  # columns (1, 5)
            f"fma.rn.f16x2 a, h, {x[1]}, a;",
        ]
    # the two lanes added in fp16 (one more rounding, 2^-11 of the block's sum), then fp32
    lines += ["mov.b32 {l, u}, a;", "add.rn.f16 l, l, u;", "cvt.f32.f16 $0, l;"]
    return "{\n" + "\n".join(lines) + "\n}"


_E2M1_BLOCK_DOT_PTX = tl.constexpr(_block_dot_ptx())
_BLOCK_DOT_CONSTRAINTS = tl.constexpr("=r" + ",r" * 20)
# One 128-bit load of code words ($4: int32 pointer, 16-byte aligned). NOTE: unpredicated: the
# kernels clamp the addresses of blocks past K (and rows past N) into the tensor instead, and
# zero those blocks' activations. (A predicated load whose outputs are not zeroed first lets
# ptxas drop the predicate; zeroing costs 4 moves a block.)
_LD_CODES = "ld.global.nc{}.v4.b32 {{$0, $1, $2, $3}}, [$4]{};"
_LD_SCALE = "ld.global.nc{}.u8 $0, [$1]{};"


def _ld_ptx(load: str, evict_first: bool) -> tl.constexpr:
    """The PTX of `load` (a format string: cache-hint qualifier, then hint operand), plain or
    marked first to go from the L2 (ops/l2.py: weight streams leave the L2 to the KV cache and
    activations)."""
    if not evict_first:
        return tl.constexpr(load.format("", ""))
    hinted = load.format(".L2::cache_hint", ", pol")
    return tl.constexpr(
        f"{{ .reg .b64 pol; createpolicy.fractional.L2::evict_first.b64 pol, 1.0; {hinted} }}"
    )


_LD_CODES_PTX = _ld_ptx(_LD_CODES, False)
_LD_CODES_EF_PTX = _ld_ptx(_LD_CODES, True)
_LD_SCALE_PTX = _ld_ptx(_LD_SCALE, False)
_LD_SCALE_EF_PTX = _ld_ptx(_LD_SCALE, True)
# One 128-bit load of activations: not .nc (written by the previous kernel), unmasked (the
# callers clamp the address and zero the values instead).
_LD_X_PTX = tl.constexpr("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];")


@triton.jit
def _load_codes(ptrs, ASM: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
    """(w0, w1, w2, w3) int32 code words of the blocks at ptrs (int32 pointers)."""
    if ASM:
        ptx: tl.constexpr = _LD_CODES_EF_PTX if EVICT_FIRST else _LD_CODES_PTX
        return tl.inline_asm_elementwise(
            ptx, "=r,=r,=r,=r,l", [ptrs], (tl.int32,) * 4, is_pure=True, pack=1
        )
    return tl.load(ptrs), tl.load(ptrs + 1), tl.load(ptrs + 2), tl.load(ptrs + 3)


@triton.jit
def _load_scales(ptrs, ASM: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
    """fp32 2^(s - 127 + 14) of the E8M0 scale bytes at ptrs, as moe_mxfp4's `_scale_bits`;
    loaded by inline PTX in the consumer's layout (a tl.load would take the coalescer's and
    convert through shared memory every step), unpredicated."""
    if ASM:
        ptx: tl.constexpr = _LD_SCALE_EF_PTX if EVICT_FIRST else _LD_SCALE_PTX
        s = tl.inline_asm_elementwise(ptx, "=r,l", [ptrs], tl.int32, is_pure=True, pack=1)
    else:
        s = tl.load(ptrs).to(tl.int32)
    return ((s + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_x4(ptrs, ASM: tl.constexpr):
    """4 int32 words of activations at ptrs (int32 pointers, 16-byte aligned).

    NOTE: not pure: a pure asm may be hoisted above the PDL wait (`pdl.wait`), and these are
    the previous kernel's outputs."""
    if ASM:
        return tl.inline_asm_elementwise(
            _LD_X_PTX, "=r,=r,=r,=r,l", [ptrs], (tl.int32,) * 4, is_pure=False, pack=1
        )
    return tl.load(ptrs), tl.load(ptrs + 1), tl.load(ptrs + 2), tl.load(ptrs + 3)


@triton.jit
def _bf16_pair_f32(w):
    """(low, high) bf16 halves of int32 words as fp32 (bf16 is fp32's top half: exact)."""
    h = w.to(tl.uint32, bitcast=True)
    return (h << 16).to(tl.float32, bitcast=True), (h & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _pair_f32(w, X_DTYPE: tl.constexpr):
    """(low, high) 16-bit halves of int32 words of X_DTYPE (bf16 or fp16) as fp32."""
    if X_DTYPE == tl.bfloat16:
        return _bf16_pair_f32(w)
    return _half2_f32(w.to(tl.uint32, bitcast=True))


@triton.jit
def _x_word(ptrs, q: tl.constexpr, X_DTYPE: tl.constexpr, ASM: tl.constexpr):
    """The 8 activations x[8q + c] (c = 0..7, fp32) of code word q of the blocks whose first
    activation is at ptrs (int32 pointers)."""
    if X_DTYPE == tl.float32:
        a0, a1, a2, a3 = _load_x4(ptrs + 8 * q, ASM)
        a4, a5, a6, a7 = _load_x4(ptrs + 8 * q + 4, ASM)
        f32 = tl.float32
        return (
            a0.to(f32, bitcast=True), a1.to(f32, bitcast=True), a2.to(f32, bitcast=True),
            a3.to(f32, bitcast=True), a4.to(f32, bitcast=True), a5.to(f32, bitcast=True),
            a6.to(f32, bitcast=True), a7.to(f32, bitcast=True),
        )  # fmt: skip
    w0, w1, w2, w3 = _load_x4(ptrs + 4 * q, ASM)
    x0, x1 = _pair_f32(w0, X_DTYPE)
    x2, x3 = _pair_f32(w1, X_DTYPE)
    x4, x5 = _pair_f32(w2, X_DTYPE)
    x6, x7 = _pair_f32(w3, X_DTYPE)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _absmax8(x):
    m = tl.maximum(tl.maximum(tl.abs(x[0]), tl.abs(x[1])), tl.maximum(tl.abs(x[2]), tl.abs(x[3])))
    m4 = tl.maximum(tl.maximum(tl.abs(x[4]), tl.abs(x[5])), tl.maximum(tl.abs(x[6]), tl.abs(x[7])))
    return tl.maximum(m, m4)


@triton.jit
def _pairs(x, up, ASM: tl.constexpr):
    """A word's 8 activations x times up, rounded to fp16: as int32 pairs (x_c, x_c+4), c =
    0..3, for the PTX; as the 8 fp16 values in column order for the Triton formulation (it
    would unpack the pairs again for every row)."""
    if ASM:
        return (
            _pack_half2(x[0] * up, x[4] * up, ASM),
            _pack_half2(x[1] * up, x[5] * up, ASM),
            _pack_half2(x[2] * up, x[6] * up, ASM),
            _pack_half2(x[3] * up, x[7] * up, ASM),
        )
    else:  # NOTE: else, not a fall-through: the compiler would type-check both returns
        f16 = tl.float16
        return (
            (x[0] * up).to(f16), (x[1] * up).to(f16), (x[2] * up).to(f16), (x[3] * up).to(f16),
            (x[4] * up).to(f16), (x[5] * up).to(f16), (x[6] * up).to(f16), (x[7] * up).to(f16),
        )  # fmt: skip


@triton.jit
def _x_block_h2(ptrs, ok, X_DTYPE: tl.constexpr, ASM: tl.constexpr):
    """(xs, undo): a block's 32 activations (16-bit X_DTYPE, first one at
    ptrs, int32 pointers) times 2^s in fp16 as `_dot_block_h2` takes them (`_pairs`), and
    2^-s (fp32); zero where not ok (the address must still be readable).

    NOTE: per block: s puts the block's largest |x| in [2^14,
    2^15), so products with codes (|value| <= 6, times 2^-14) stay below 12 and the 16-term
    lane sums below 192, far from fp16's 65504; activations down to ~2^-24 of that largest
    stay normal. Powers of two: exact. ok None: all ok."""
    x0 = _x_word(ptrs, 0, X_DTYPE, ASM)
    x1 = _x_word(ptrs, 1, X_DTYPE, ASM)
    x2 = _x_word(ptrs, 2, X_DTYPE, ASM)
    x3 = _x_word(ptrs, 3, X_DTYPE, ASM)
    m = tl.maximum(tl.maximum(_absmax8(x0), _absmax8(x1)), tl.maximum(_absmax8(x2), _absmax8(x3)))
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent
    s = tl.minimum(tl.maximum(141 - e, -100), 100)  # 2^14 <= max|x| * 2^s < 2^15
    up = ((127 + s) << 23).to(tl.float32, bitcast=True)
    if ok is not None:
        up = tl.where(ok, up, 0.0)
    undo = ((127 - s) << 23).to(tl.float32, bitcast=True)
    return _pairs(x0, up, ASM) + _pairs(x1, up, ASM) + _pairs(x2, up, ASM) + _pairs(
        x3, up, ASM
    ), undo


@triton.jit
def _x_block_f32(ptrs, ok, ASM: tl.constexpr):
    """A block's 32 fp32 activations (4 words' 8-tuples), zero where not ok (None: all ok)."""
    x0 = _x_word(ptrs, 0, tl.float32, ASM)
    x1 = _x_word(ptrs, 1, tl.float32, ASM)
    x2 = _x_word(ptrs, 2, tl.float32, ASM)
    x3 = _x_word(ptrs, 3, tl.float32, ASM)
    if ok is None:
        return x0, x1, x2, x3
    else:  # as in `_pairs`
        zero = tl.where(ok, 1.0, 0.0)
        return _scaled8(x0, zero), _scaled8(x1, zero), _scaled8(x2, zero), _scaled8(x3, zero)


@triton.jit
def _scaled8(x, f):
    return x[0] * f, x[1] * f, x[2] * f, x[3] * f, x[4] * f, x[5] * f, x[6] * f, x[7] * f


@triton.jit
def _dot_word_f16(w, xs, BASE: tl.constexpr, lo, hi, FIRST: tl.constexpr):
    """One word's 4 HFMA2 of `_E2M1_BLOCK_DOT_PTX` on (lo, hi) fp16 accumulators, its
    activations xs[BASE + c] (fp16, c = 0..7)."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _fp16_codes(w)
    if FIRST:
        lo = c2 * xs[BASE + 2]
        hi = c6 * xs[BASE + 6]
    else:
        lo = c2 * xs[BASE + 2] + lo
        hi = c6 * xs[BASE + 6] + hi
    lo = c0 * xs[BASE] + lo
    hi = c4 * xs[BASE + 4] + hi
    lo = c3 * xs[BASE + 3] + lo
    hi = c7 * xs[BASE + 7] + hi
    lo = c1 * xs[BASE + 1] + lo
    hi = c5 * xs[BASE + 5] + hi
    return lo, hi


@triton.jit
def _dot_block_h2(codes, xs, ASM: tl.constexpr):
    """Per block: sum_k value(code k) * x_k (x 2^-14 x 2^s), fp32; codes: its 4 words, xs:
    its activations from `_x_block_h2`.

    NOTE: products exact (2 significant bits times 8), 16-term sums a lane and the two lanes'
    sum rounded to fp16's 11 bits, then fp32: ~2^-11 of the block's partial sums, well
    below the bf16 rounding of the kernel's outputs. The Triton formulation rounds each product and sum (same values:
    the products are exact, so an fma rounds once as a multiply-add does)."""
    if ASM:
        return tl.inline_asm_elementwise(
            _E2M1_BLOCK_DOT_PTX, _BLOCK_DOT_CONSTRAINTS,
            [codes[0], codes[1], codes[2], codes[3], xs[0], xs[1], xs[2], xs[3], xs[4], xs[5],
             xs[6], xs[7], xs[8], xs[9], xs[10], xs[11], xs[12], xs[13], xs[14], xs[15]],
            tl.float32, is_pure=True, pack=1,
        )  # fmt: skip
    else:  # as in `_pairs`: xs is 32 fp16 values here
        lo, hi = _dot_word_f16(codes[0], xs, 0, 0, 0, True)
        lo, hi = _dot_word_f16(codes[1], xs, 8, lo, hi, False)
        lo, hi = _dot_word_f16(codes[2], xs, 16, lo, hi, False)
        lo, hi = _dot_word_f16(codes[3], xs, 24, lo, hi, False)
        return (lo + hi).to(tl.float32)


@triton.jit
def _dot_block_f32(codes, xs, ASM: tl.constexpr):
    """As `_dot_block_h2` in fp32 (x 2^-14): xs the 4 words' 8-tuples from `_x_block_f32`."""
    acc = _dot_word_f32(codes[0], xs[0], ASM)
    acc += _dot_word_f32(codes[1], xs[1], ASM)
    acc += _dot_word_f32(codes[2], xs[2], ASM)
    return acc + _dot_word_f32(codes[3], xs[3], ASM)


@triton.jit
def _dot_word_f32(w, x, ASM: tl.constexpr):
    return _dot_words(w, x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], ASM)


@triton.jit
def _x_block(ptrs, ok, X_DTYPE: tl.constexpr, ASM: tl.constexpr):
    """(activations as the block dot takes them, undo): fp16 pairs and 2^-s for 16-bit
    X_DTYPE, fp32 8-tuples and 1 for fp32."""
    if X_DTYPE == tl.float32:
        return _x_block_f32(ptrs, ok, ASM), 1.0
    else:  # as in `_pairs`
        return _x_block_h2(ptrs, ok, X_DTYPE, ASM)


@triton.jit
def _block_sums(word_ptrs, scale_ptrs, xs, undo, X_DTYPE: tl.constexpr, ASM: tl.constexpr,
                EVICT_FIRST: tl.constexpr = False):  # fmt: skip
    """Scaled block dot products of the blocks at word_ptrs (int32) / scale_ptrs (u8): one
    128-bit code load, one scale byte, one block dot each."""
    codes = _load_codes(word_ptrs, ASM, EVICT_FIRST)
    scale = _load_scales(scale_ptrs, ASM, EVICT_FIRST)
    return _scaled_dot(codes, scale, xs, undo, X_DTYPE, ASM)


@triton.jit
def _scaled_dot(codes, scale, xs, undo, X_DTYPE: tl.constexpr, ASM: tl.constexpr):
    if X_DTYPE == tl.float32:
        return _dot_block_f32(codes, xs, ASM) * scale
    else:  # as in `_pairs`
        return _dot_block_h2(codes, xs, ASM) * (scale * undo)


@triton.jit
def _step_x(x_blocks, x_ok, step: tl.constexpr, NB: tl.constexpr, KS: tl.constexpr, blk,
            X_WORDS: tl.constexpr, X_DTYPE: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """(g, xs, undo) of K step `step`, whose blocks are step * NB + blk (blk: the tile's
    block index; x_blocks: step 0's activation blocks, x_ok: rows of activations to use or
    None): g the blocks' offset from step 0's, xs and undo from `_x_block`. In the last,
    partial step the blocks past K re-read the row's last block (in bounds, no predicated
    loads) and get zero activations."""
    if (step + 1) * NB <= KS:
        g = step * NB
        ok = x_ok
    else:
        g = tl.minimum(step * NB + blk, KS - 1) - blk
        ok = step * NB + blk < KS
        if x_ok is not None:
            ok = ok & x_ok
    xs, undo = _x_block(x_blocks + g * X_WORDS, ok, X_DTYPE, ASM)
    return g, xs, undo


@triton.jit(do_not_specialize=["P"])
def _moe_mxfp4_gate_up_kernel(
    x_ptr,
    wb_ptr,
    ws_ptr,
    b_ptr,
    topk_ids_ptr,
    inter_ptr,
    N,
    P,
    top_k,
    stride_xm,
    stride_be,
    stride_im,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    ASM: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
):
    # As moe_mxfp4._moe_mxfp4_gate_up_kernel. A K step is [BLOCK_N, NB] blocks of the gate
    # rows and of the up rows; lane l of a warp owns block step * NB + l of its rows, whose
    # activations it converts once for its 2 x BLOCK_N (row, block) pairs. K (= H) is a
    # constexpr and the loop unrolled: the loads are the row starts plus constants, and only
    # the last step's blocks need clamping. Rows past N read row N - 1 (never stored).
    NB: tl.constexpr = BLOCK_K // 32
    KS: tl.constexpr = K // 32
    STEPS: tl.constexpr = (KS + NB - 1) // NB
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    X_WORDS: tl.constexpr = X_DTYPE.primitive_bitwidth  # 32-bit words of a block's activations
    pid = tl.program_id(0)
    pair = pid % P
    n = (pid // P) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    blk = tl.arange(0, NB)[None, :]  # [1, NB]
    wb = wb_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    # The expert id is the router's output (the previous kernel): nothing to preload.
    pdl.wait(PDL)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    # [1, NB] int32 pointers to the token's activation blocks (x rows are 16-byte aligned)
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xm
    x_blocks = x_row.to(tl.pointer_type(tl.int32), bitcast=True) + X_WORDS * blk
    # [BLOCK_N, NB] blocks: 4 * KS code words (16-byte aligned) and KS scale bytes a row
    row = (expert * 2 * N + tl.minimum(n, N - 1).to(tl.int64))[:, None]
    gate_words = wb + row * (4 * KS) + 4 * blk
    up_words = gate_words + N * (4 * KS)
    gate_scales = ws_ptr + row * KS + blk
    up_scales = gate_scales + N * KS
    acc = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
    for step in tl.static_range(STEPS):
        g, xs, undo = _step_x(x_blocks, None, step, NB, KS, blk, X_WORDS, X_DTYPE, ASM)
        acc += _block_sums(gate_words + 4 * g, gate_scales + g, xs, undo, X_DTYPE, ASM, EVICT_FIRST)
        acc_up += _block_sums(up_words + 4 * g, up_scales + g, xs, undo, X_DTYPE, ASM, EVICT_FIRST)
    # After the weight stream: the successor takes no SM slots from this kernel's later waves.
    pdl.trigger(PDL)
    gate_acc = tl.sum(acc, axis=1)
    up_acc = tl.sum(acc_up, axis=1)
    _gate_up_store(
        gate_acc, up_acc, b_ptr, expert, stride_be, n, n_ok, N, inter_ptr, pair, stride_im,
        HAS_BIAS, ACT, ALPHA, LIMIT,
    )  # fmt: skip


@triton.jit(do_not_specialize=["T"])
def _moe_mxfp4_down_kernel(
    inter_ptr,
    wb_ptr,
    ws_ptr,
    b_ptr,
    topk_ids_ptr,
    topk_w_ptr,
    out_ptr,
    N,
    T,
    top_k,
    stride_im,
    stride_be,
    stride_om,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    PRELOAD: tl.constexpr,
    ASM: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
):
    # As moe_mxfp4._moe_mxfp4_down_kernel: out[t, n] = sum_j w[t, j] * (W2[e_j, n] @ inter[t,
    # j] + b). A K step is [BLOCK_N, BLOCK_TOPK, NB] blocks: lanes along the blocks, warps
    # along the token's experts, then the rows; a thread's rows of one expert share that
    # expert's activation block. K (= I) constexpr and unrolled as in gate_up. PRELOAD (under
    # PDL): the routing and the first step's codes and scales load before waiting for gate_up
    # (the routing was written before gate_up started, weights never change); only inter
    # needs the wait.
    NB: tl.constexpr = BLOCK_K // 32
    KS: tl.constexpr = K // 32
    STEPS: tl.constexpr = (KS + NB - 1) // NB
    X_DTYPE: tl.constexpr = inter_ptr.dtype.element_ty
    X_WORDS: tl.constexpr = X_DTYPE.primitive_bitwidth
    t, n, n_ok, pair, jj_ok = _down_program(N, T, top_k, BLOCK_N, BLOCK_TOPK)
    blk = tl.arange(0, NB)[None, None, :]  # [1, 1, NB]
    wb = wb_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    if not PRELOAD:
        pdl.wait(PDL)
    expert, route_w = _routing(topk_ids_ptr, topk_w_ptr, pair, jj_ok)
    # [BLOCK_N, BLOCK_TOPK, NB] blocks (rows past N read row N - 1, never stored)
    row = expert[None, :, None] * N + tl.minimum(n, N - 1).to(tl.int64)[:, None, None]
    row_words = wb + row * (4 * KS) + 4 * blk
    row_scales = ws_ptr + row * KS + blk
    g0 = 0 if NB <= KS else tl.minimum(blk, KS - 1) - blk  # as _step_x
    codes = _load_codes(row_words + 4 * g0, ASM, EVICT_FIRST)
    scales = _load_scales(row_scales + g0, ASM, EVICT_FIRST)
    if PRELOAD:
        pdl.wait(PDL)
    # [1, BLOCK_TOPK, NB] int32 pointers to the inter rows' blocks (experts past top_k read
    # the last one's, zeroed)
    pair = tl.minimum(pair, t * top_k + top_k - 1)
    h_rows = inter_ptr + pair.to(tl.int64) * stride_im
    h_blocks = h_rows.to(tl.pointer_type(tl.int32), bitcast=True)[None, :, None] + X_WORDS * blk
    h_ok = jj_ok[None, :, None]
    acc = tl.zeros([BLOCK_N, BLOCK_TOPK, NB], dtype=tl.float32)
    for step in tl.static_range(STEPS):
        g, xs, undo = _step_x(h_blocks, h_ok, step, NB, KS, blk, X_WORDS, X_DTYPE, ASM)
        if step > 0:
            codes = _load_codes(row_words + 4 * g, ASM, EVICT_FIRST)
            scales = _load_scales(row_scales + g, ASM, EVICT_FIRST)
        acc += _scaled_dot(codes, scales, xs, undo, X_DTYPE, ASM)
    pdl.trigger(PDL)
    acc2 = tl.sum(acc, axis=2)  # [BLOCK_N, BLOCK_TOPK]
    if HAS_BIAS:
        b = b_ptr + expert[None, :] * stride_be + n[:, None]
        acc2 += tl.load(b, mask=jj_ok[None, :] & n_ok[:, None], other=0.0).to(tl.float32)
    y = tl.sum(acc2 * route_w[None, :], axis=1)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + n, y.to(out_ptr.dtype.element_ty), n_ok)
