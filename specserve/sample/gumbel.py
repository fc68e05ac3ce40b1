"""Counter-based random numbers: every value is a pure function of (seed, position, salt, column).

There is no torch.Generator state, so a request draws the same numbers whether it runs alone or
in any batch, and replays (preemption, recompute) reproduce their tokens exactly. Uniforms are
bit-identical on CPU and CUDA; Gumbel values may differ in the last ulp (each device's log), so
sampled tokens agree across devices except on near-exact ties. All integer math is done in int64
tensors holding values in [0, 2^32), so no op ever overflows.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Distinct salts give independent streams for the different random decisions made at one
# position; losslessness of verification relies on these being independent of each other.
SALT_SAMPLE = 0
SALT_ACCEPT = 1
SALT_DRAFT = 2
SALT_SYNTHETIC = 3

_MASK32 = 0xFFFFFFFF
# "triple32" multipliers (hash-prospector) with bit 31 cleared: odd and < 2^31, so that a
# product with a value < 2^32 stays below 2^63 and never overflows int64.
_MUL1 = 0x6D5AD4BB
_MUL2 = 0x2C4C1B51
_MUL3 = 0x31848BAB
# Breaks hash(0) == 0, so an all-zero key (seed 0, position 0, salt 0) is not a fixed point.
_KEY0 = 0x2545F491
# Derives the per-row column multiplier from the row key.
_KEY1 = 0x68E31DA4
_INV_2_24 = 1.0 / (1 << 24)
# Largest float32 below 1: rounding (k + 0.5) in float32 can otherwise reach exactly 1.0.
_U_MAX = 1.0 - 2.0**-24


def hash_u32(
    # [...] int64 with values in [0, 2^32)
    x: Tensor,
) -> Tensor:
    """Three xor-shift-multiply rounds of a 32-bit integer mixing hash (same shape, int64)."""
    x = x ^ (x >> 17)  # fresh tensor: the caller's input is never modified
    x.mul_(_MUL1).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 11)
    x.mul_(_MUL2).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL3).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 14)
    return x


def _row_key(seeds: Tensor, positions: Tensor, salt: int) -> Tensor:
    """Hash chain over (seed low half, seed high half, position, salt) -> [N] int64 in [0, 2^32)."""
    seeds = seeds.long()
    h = hash_u32((seeds & _MASK32) ^ _KEY0)
    h = hash_u32(h ^ ((seeds >> 32) & _MASK32))
    h = hash_u32(h ^ (positions.long() & _MASK32))
    return hash_u32(h ^ (salt & _MASK32))


def _to_unit(h: Tensor) -> Tensor:
    """24 high bits of a 32-bit hash -> float32 strictly inside (0, 1)."""
    u = ((h >> 8).to(torch.float32) + 0.5) * _INV_2_24
    return u.clamp_(max=_U_MAX)


def uniform(
    # [N] int64
    seeds: Tensor,
    # [N] int64
    positions: Tensor,
    salt: int,
    vocab_size: int | None = None,
    # [C] int64 vocab indices to draw at (default: arange(vocab_size))
    cols: Tensor | None = None,
) -> Tensor:
    """Uniforms in (0, 1): [N] float32, or [N, vocab_size] with one value per vocab index
    ([N, C] at the indices `cols`: the same values those columns get in the full row)."""
    h = _row_key(seeds, positions, salt)
    if vocab_size is None and cols is None:
        return _to_unit(h)
    col = cols.long() if cols is not None else torch.arange(vocab_size, device=h.device)
    # Column enters as h + col * m with a per-row odd multiplier m < 2^31 (no int64 overflow).
    # A plain h ^ col would make two rows whose keys differ by a xor below vocab_size produce
    # column-permuted copies of each other's values; with distinct multipliers two rows share
    # only ~vocab^2 / 2^32 values by coincidence, as truly random rows would.
    m = (hash_u32(h ^ _KEY1) & 0x7FFFFFFF) | 1
    x = col[None, :] * m[:, None]
    x.add_(h[:, None]).bitwise_and_(_MASK32)
    return _to_unit(hash_u32(x))


def gumbel(
    # [N] int64
    seeds: Tensor,
    # [N] int64
    positions: Tensor,
    salt: int,
    vocab_size: int,
    # [C] int64: noise of these vocab indices only, [N, C] (e.g. a drafter's reduced
    # vocabulary drawing the target vocabulary's noise of the same tokens)
    cols: Tensor | None = None,
) -> Tensor:
    """Standard Gumbel noise [N, vocab_size] float32: argmax(log p + g) samples from p."""
    u = uniform(seeds, positions, salt, vocab_size, cols)
    return u.log_().neg_().log_().neg_()
