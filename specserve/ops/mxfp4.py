"""The MXFP4 weight format (OCP microscaling FP4) as the published gpt-oss checkpoints store it.

A weight W [..., rows, cols] is stored as
  `<name>_blocks` [..., rows, cols / 32, 16] uint8: 32 FP4 (E2M1) codes per block, two per
                  byte, the low nibble first (element 2j) and the high nibble second (2j + 1)
  `<name>_scales` [..., rows, cols / 32] uint8: one E8M0 exponent per block, bias 127
so W[r, 32 g + i] = FP4_VALUES[code] * 2 ** (scale[r, g] - 127) (transformers'
integrations/mxfp4.py). For gpt-oss experts the rows are the output features
(gate_up_proj: 2I interleaved gate/up rows, down_proj: H rows) and the columns the inputs.

`dequantize_mxfp4` is the torch reference of the 4-bit kernels (ops/moe_mxfp4.py) and the
loading fallback (models/mxfp4.py); `quantize_mxfp4` writes the same layout (tests).
"""

from __future__ import annotations

import torch

# E2M1 code -> value (code 8..15: the negatives of 0..7).
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
BLOCK = 32
SCALE_BIAS = 127


def dequantize_mxfp4(
    # [..., rows, cols / 32, 16] uint8
    blocks: torch.Tensor,
    # [..., rows, cols / 32] uint8
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """-> [..., rows, cols] in `dtype`. Exact in bf16 and fp32 (3 significant bits times a power
    of two); one leading index at a time so a 120b expert stack needs no fp32 temporary."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
            f"expected blocks [..., G, {BLOCK // 2}] and scales [..., G]"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    *lead, groups, _ = blocks.shape
    out = torch.empty(*lead, groups * BLOCK, dtype=dtype, device=blocks.device)
    flat_b = blocks.reshape(-1, *blocks.shape[-3:]) if lead else blocks[None]
    flat_s = scales.reshape(-1, *scales.shape[-2:]) if lead else scales[None]
    flat_o = out.view(-1, *out.shape[-2:]) if lead else out[None]
    for i in range(flat_b.shape[0]):
        b = flat_b[i].long()
        # [rows, G, 16, 2]: low nibble, then high nibble
        vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)
        exp = flat_s[i].to(torch.int32) - SCALE_BIAS
        flat_o[i] = torch.ldexp(vals, exp[..., None]).flatten(-2).to(dtype)
    return out


def quantize_mxfp4(
    # [..., rows, cols], cols a multiple of 32
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (blocks, scales) in the checkpoint layout: per block of 32, the smallest power-of-two
    scale that puts max |w| within FP4's range (6.0), each value rounded to the nearest code."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {BLOCK}, got {w.shape}")
    x = w.float().reshape(*w.shape[:-1], -1, BLOCK)
    amax = x.abs().amax(dim=-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = x / torch.exp2(exp)[..., None]
    # The nearest magnitude (a tie rounds down): the midpoints between FP4's magnitudes as
    # bucket bounds, on w's device and without a [..., 8] temporary (GPU tests quantize
    # gpt-oss-20b-sized expert stacks).
    mags = FP4_VALUES[:8]
    mids = torch.tensor([(a + b) / 2 for a, b in zip(mags, mags[1:])], device=w.device)
    mag = torch.bucketize(scaled.abs().contiguous(), mids)
    codes = (mag + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + SCALE_BIAS).to(torch.uint8)
