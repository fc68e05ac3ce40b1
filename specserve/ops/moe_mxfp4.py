"""`fused_moe` over MXFP4 expert weights, dequantized in registers (decode and grouped GEMM).

gpt-oss ships its experts in MXFP4 (models/mxfp4.py: 32 E2M1 codes a block, two a byte, low
nibble first, and one E8M0 exponent a block). Decode streams expert weights, so reading them at
4.25 bits instead of 16 is the ~3.8x of the step's dominant bytes that issue 22 asks for. The
kernels are ops/moe_triton.py's with the weight tile replaced: each K step loads
[BLOCK_N, BLOCK_K / 2] code bytes and the per-32 scales they use, decodes both nibbles in
registers and multiplies them with the even and the odd activation columns.

  `_moe_mxfp4_gate_up_kernel`  decode: program (pair, column block) -> inter[pair] = act(g, u)
  `_moe_mxfp4_down_kernel`     decode: program (token, column block), the top_k sum fused
  ops/moe_mxfp4_gemm.py        prefill / verification (> DECODE_MAX_TOKENS tokens): the grouped
                               GEMM over the same 4-bit tiles (the in-register dequantization
                               helpers below are shared).

Weights in StackedExperts' row layout, quantized along the input dim (models/moe.py
Mxfp4Experts holds them):
  w13_blocks [E, 2I, H / 32, 16] uint8, w13_scales [E, 2I, H / 32] uint8 (gate rows, then up)
  w2_blocks  [E, H, I / 32, 16] uint8,  w2_scales  [E, H, I / 32] uint8
`fused_moe_mxfp4_triton` picks decode or GEMM by the token count (host-known, so a captured
graph holds one path; no host sync, buffers as the bf16 path allocates them);
`fused_moe_mxfp4_ref` (dequantize, then ops/moe.py's reference) is what the tests compare with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.models.mxfp4 import BLOCK, dequantize_mxfp4
from specserve.ops.moe import fused_moe_ref
from specserve.ops.moe_triton import (
    PLAIN,
    Epilogue,
    _act,
    uses_decode_path,
)

# (BLOCK_N, BLOCK_K, num_warps): BLOCK_K weights a row per step = BLOCK_K / 2 bytes.
MXFP4_GATE_UP_CONFIG = (8, 512, 4)
MXFP4_DOWN_CONFIG = (4, 256, 4)


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
def _scale(scale_ptrs, ok):
    """fp32 2^(scale - 127) of E8M0 scales, times 2^14 to undo _e2m1's 2^-14 (exact)."""
    return tl.exp2(tl.load(scale_ptrs, mask=ok, other=0).to(tl.float32) - 113.0)


@triton.jit
def _mxfp4_tile(byte_ptrs, scale_ptrs, ok):
    """(even, odd) fp32 weights of a tile of code bytes: the low nibbles are the even columns,
    the high nibbles the odd ones, both times their block's scale (GEMM operands)."""
    lo, hi = _e2m1(tl.load(byte_ptrs, mask=ok, other=0))
    scale = _scale(scale_ptrs, ok)
    return lo * scale, hi * scale


@triton.jit
def _dot_rows(codes, x_even, x_odd, scale, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """[ROWS]: code-byte rows [ROWS, BLOCK_K / 2] (uint8) dotted with the activations' even and
    odd columns ([1, BLOCK_K / 2] fp32). Each 32-weight block is summed unscaled and its scale
    ([ROWS, BLOCK_K / 32] from _scale) applied once: one multiply a block, not a weight."""
    lo, hi = _e2m1(codes)
    prod = lo * x_even + hi * x_odd
    per_block = tl.sum(tl.reshape(prod, [ROWS, BLOCK_K // 32, 16]), axis=2)
    return tl.sum(per_block * scale, axis=1)


@triton.jit(do_not_specialize=["P"])
def _moe_mxfp4_gate_up_kernel(
    x_ptr,
    wb_ptr,
    ws_ptr,
    b_ptr,
    topk_ids_ptr,
    inter_ptr,
    N,
    K,
    P,
    top_k,
    stride_xm,
    stride_be,
    stride_im,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # As _moe_decode_gate_up_kernel; weight row r of expert e: K / 2 bytes at
    # wb + (e * 2N + r) * K / 2, K / 32 scales at ws + (e * 2N + r) * K / 32.
    pid = tl.program_id(0)
    pair = pid % P
    n = (pid // P) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xm
    KB = K // 2
    KS = K // 32
    gate_row = expert * 2 * N + n.to(tl.int64)
    up_row = gate_row + N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, KB, BLOCK_K // 2):
        j = k0 + tl.arange(0, BLOCK_K // 2)  # byte j holds columns 2j and 2j + 1
        j_ok = j < KB
        ok = n_ok[:, None] & j_ok[None, :]
        g = k0 // 16 + tl.arange(0, BLOCK_K // 32)  # the step's scale blocks
        g_ok = n_ok[:, None] & (g < KS)[None, :]
        x_even = tl.load(x_row + 2 * j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        x_odd = tl.load(x_row + 2 * j + 1, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        codes = tl.load(wb_ptr + gate_row[:, None] * KB + j[None, :], mask=ok, other=0)
        scale = _scale(ws_ptr + gate_row[:, None] * KS + g[None, :], g_ok)
        acc += _dot_rows(codes, x_even, x_odd, scale, BLOCK_N, BLOCK_K)
        codes = tl.load(wb_ptr + up_row[:, None] * KB + j[None, :], mask=ok, other=0)
        scale = _scale(ws_ptr + up_row[:, None] * KS + g[None, :], g_ok)
        acc_up += _dot_rows(codes, x_even, x_odd, scale, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        b_row = b_ptr + expert * stride_be + n
        acc += tl.load(b_row, mask=n_ok, other=0.0).to(tl.float32)
        acc_up += tl.load(b_row + N, mask=n_ok, other=0.0).to(tl.float32)
    y = _act(acc, acc_up, ACT, ALPHA, LIMIT)
    tl.store(inter_ptr + pair.to(tl.int64) * stride_im + n, y.to(inter_ptr.dtype.element_ty), n_ok)


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
    K,
    T,
    top_k,
    stride_im,
    stride_be,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # As _moe_decode_down_kernel: out[t, n] = sum_j w[t, j] * (W2[e_j, n] @ inter[t, j] + b).
    pid = tl.program_id(0)
    t = pid % T
    n = (pid // T) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    jj = tl.arange(0, BLOCK_TOPK)
    jj_ok = jj < top_k
    pair = t * top_k + jj
    expert = tl.load(topk_ids_ptr + pair, mask=jj_ok, other=0).to(tl.int64)
    route_w = tl.load(topk_w_ptr + pair, mask=jj_ok, other=0.0).to(tl.float32)
    KB = K // 2
    KS = K // 32
    # [BLOCK_TOPK, BLOCK_N, 1] weight rows
    row = (expert[:, None] * N + n.to(tl.int64)[None, :])[:, :, None]
    rows_ok = jj_ok[:, None, None] & n_ok[None, :, None]
    h_rows = inter_ptr + pair.to(tl.int64)[:, None] * stride_im
    acc = tl.zeros([BLOCK_TOPK, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, KB, BLOCK_K // 2):
        j = k0 + tl.arange(0, BLOCK_K // 2)
        j_ok = j < KB
        g = k0 // 16 + tl.arange(0, BLOCK_K // 32)
        h_ok = jj_ok[:, None] & j_ok[None, :]
        h_even = tl.load(h_rows + 2 * j[None, :], mask=h_ok, other=0.0).to(tl.float32)
        h_odd = tl.load(h_rows + 2 * j[None, :] + 1, mask=h_ok, other=0.0).to(tl.float32)
        codes = tl.load(
            wb_ptr + row * KB + j[None, None, :], mask=rows_ok & j_ok[None, None, :], other=0
        )
        scale = _scale(ws_ptr + row * KS + g[None, None, :], rows_ok & (g < KS)[None, None, :])
        # as _dot_rows, over [BLOCK_TOPK, BLOCK_N] rows
        lo, hi = _e2m1(codes)
        prod = lo * h_even[:, None, :] + hi * h_odd[:, None, :]
        per_block = tl.sum(tl.reshape(prod, [BLOCK_TOPK, BLOCK_N, BLOCK_K // 32, 16]), axis=3)
        acc += tl.sum(per_block * scale, axis=2)
    if HAS_BIAS:
        b = b_ptr + expert[:, None] * stride_be + n[None, :]
        acc += tl.load(b, mask=jj_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    y = tl.sum(acc * route_w[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + n, y.to(out_ptr.dtype.element_ty), n_ok)


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
    configs: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None,
) -> torch.Tensor:
    """[T, H] in x's dtype: `fused_moe`'s decode path with 4-bit experts (any T; meant for
    T <= moe_triton.DECODE_MAX_TOKENS)."""
    T, top_k = topk_ids.shape
    H = x.shape[1]
    two_i = w13_blocks.shape[1]
    inter_size = two_i // 2
    _check_pair(w13_blocks, w13_scales, two_i, H)
    _check_pair(w2_blocks, w2_scales, H, inter_size)
    if T == 0:
        return torch.empty_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    (gn, gk, gw), (dn, dk, dw) = configs or (MXFP4_GATE_UP_CONFIG, MXFP4_DOWN_CONFIG)
    b13, b2 = epilogue.w13_bias, epilogue.w2_bias
    P = T * top_k
    inter = torch.empty(P, inter_size, dtype=x.dtype, device=x.device)
    _moe_mxfp4_gate_up_kernel[(P * triton.cdiv(inter_size, gn),)](
        x, w13_blocks.contiguous(), w13_scales.contiguous(), x if b13 is None else b13,
        topk_ids, inter, inter_size, H, P, top_k,
        x.stride(0), 0 if b13 is None else b13.stride(0), inter.stride(0),
        HAS_BIAS=b13 is not None, **epilogue.consts(), BLOCK_N=gn, BLOCK_K=gk, num_warps=gw,
    )  # fmt: skip
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    _moe_mxfp4_down_kernel[(T * triton.cdiv(H, dn),)](
        inter, w2_blocks.contiguous(), w2_scales.contiguous(), x if b2 is None else b2,
        topk_ids, topk_weights, out, H, inter_size, T, top_k,
        inter.stride(0), 0 if b2 is None else b2.stride(0), out.stride(0),
        HAS_BIAS=b2 is not None, BLOCK_TOPK=triton.next_power_of_2(top_k),
        BLOCK_N=dn, BLOCK_K=dk, num_warps=dw,
    )  # fmt: skip
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
    DECODE_MAX_TOKENS tokens, the grouped GEMM above), "decode" or "gemm"."""
    E, two_i = w13_blocks.shape[:2]
    H = x.shape[1]
    b13, b2 = epilogue.w13_bias, epilogue.w2_bias
    if (b13 is not None and b13.shape != (E, two_i)) or (b2 is not None and b2.shape != (E, H)):
        raise ValueError(
            f"MXFP4 experts: biases {None if b13 is None else tuple(b13.shape)} / "
            f"{None if b2 is None else tuple(b2.shape)}, expected ({E}, {two_i}) / ({E}, {H})"
        )
    args = (x, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids)
    if path == "decode" or (path == "auto" and uses_decode_path(topk_ids.shape[0])):
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
