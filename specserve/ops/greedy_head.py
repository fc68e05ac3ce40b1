"""A greedy step's tokens from the lm_head gemv itself: no argmax launches after it.

A greedy decode step ends with the lm_head gemv, then `ops.argmax`: two launches (a chunked max
and its merge) that read the logits back, ~4.4 us plus a launch gap each at batch 1 on an H100
(benchmarks/RESULTS.md), where the whole step is ~2.7 ms (Qwen3-30B-A3B). Here the gemv folds
each program's best column into a per-row int64 key as it stores its logits (the ARGMAX
epilogue, `gemv.argmax_epilogue`), and one small kernel turns the keys into token ids and
resets them for the next step. The logits are still written: logprobs read them.

Only where the plan runs the M <= 8 gemv on the lm_head (batch-1-like decode); skinny, cuBLAS
and CPU steps take `ops.argmax` (`greedy_logits` returns None), as do all steps with
`tunables().greedy_argmax_epilogue` off. Measured (H100, benchmarks/RESULTS.md, Qwen3-30B-A3B
batch 1): device time outside the decode graph 209 -> 206-207 us. Tried and dropped: the lm_head
captured at the end of the decode graphs, with the token write taking the keys: the final
norm's gap to it closed, but every layer's kernels ran ~3% slower (step 2724 -> 2792 us;
benchmarks/experiments/lm-head-in-graph.patch at commit b3db210).
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.ops import pdl, skinny
from specserve.ops.gemv import KEY_COLUMNS, KEY_EMPTY, MAX_M, DecodeLinear, gemv
from specserve.tunables import tunables

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference only
    triton = None


def new_keys(rows: int, device: torch.device) -> torch.Tensor:
    """[rows] int64 greedy keys, empty (what the gemv's ARGMAX epilogue expects before it)."""
    return torch.full((rows,), KEY_EMPTY, dtype=torch.int64, device=device)


def take_tokens_ref_(
    # [M] int64 keys, reset to KEY_EMPTY in place
    keys: torch.Tensor,
) -> torch.Tensor:
    """[M] int64: the column each key holds."""
    tokens = KEY_COLUMNS - (keys & KEY_COLUMNS)
    keys.fill_(KEY_EMPTY)
    return tokens


if triton is not None:

    @triton.jit
    def _take_kernel(keys_ptr, out_ptr, M, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.start(PDL)
        r = tl.arange(0, BLOCK)
        ok = r < M
        key = tl.load(keys_ptr + r, mask=ok, other=0)
        tl.store(out_ptr + r, 2147483647 - (key & 2147483647), mask=ok)  # KEY_COLUMNS
        tl.store(keys_ptr + r, tl.full([BLOCK], -9223372036854775807 - 1, tl.int64), mask=ok)


def take_tokens_(
    # [M] int64 keys (M <= gemv.MAX_M), reset to KEY_EMPTY in place
    keys: torch.Tensor,
) -> torch.Tensor:
    """[M] int64 tokens from the keys a gemv's ARGMAX epilogue filled, in one launch (semantics:
    `take_tokens_ref_`); the keys are empty again after it, ready for the next step."""
    M = keys.shape[0]
    out = torch.empty(M, dtype=torch.int64, device=keys.device)
    if M == 0:
        return out
    BLOCK = triton.next_power_of_2(M)
    _take_kernel[(1,)](keys, out, M, BLOCK=BLOCK, num_warps=1, **pdl.launch_kwargs(keys.device))
    return out


def greedy_logits(
    lm_head: nn.Module,
    # [M, H]: the final hidden states of M rows
    hidden: torch.Tensor,
    # [>= M] int64 from `new_keys`, empty between calls
    keys: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits [M, V] = lm_head(hidden), tokens [M] int64 = their argmax, the first index on
    ties as torch.argmax, NaN as +inf as ops.argmax) from the lm_head's gemv with its argmax
    epilogue and one launch after it; None where the plan gives these rows to another kernel
    (the caller then runs lm_head and ops.argmax)."""
    if not tunables().greedy_argmax_epilogue or not isinstance(lm_head, DecodeLinear):
        return None
    if hidden.shape[0] > min(MAX_M, keys.shape[0]):
        return None
    cfg = lm_head.config(hidden)
    if cfg is None or isinstance(cfg, skinny.SkinnyConfig):
        return None
    w, b = lm_head.weight, lm_head.bias
    logits = gemv(hidden, w, b, cfg, early_trigger=lm_head.early_trigger, argmax_keys=keys)
    return logits, take_tokens_(keys[: hidden.shape[0]])
