"""Verification (`rejection_sample`, strict and probabilistic) as Triton kernels over all requests
at once (CUDA; the kernels are in rejection_kernels.py, the torch reference is
`rejection_sample_ref` in rejection.py, which dispatches here).

`coupled_sample_triton` ("coupled", the default method) is two launches; it is described at
its definition. Speculative sampling ("strict" / "probabilistic"): four launches (two for
all-greedy batches), each split over the vocabulary so that one request
still spreads over the whole GPU; R = B * (K + 1) slot rows, S vocabulary splits of BLOCK_V:
  1. _slot_stats_kernel    grid (R, S): per split of every slot row, the argmax of the raw logits
                           and, for sampled batches, max and sum(exp(x - max)) of the processed
                           logits (temperature applied here when it is the only processing).
  2. _accept_kernel        grid (B,): combines the splits; greedy rows accept while the draft is
                           the argmax, sampled rows while u * q(d) < p(d); writes the accepted
                           drafts, the argmax as recovered / bonus token, -1 after, num_accepted.
  3. _final_sample_kernel  grid (B, S), sampled batches: Gumbel-max over each split of the final
                           slot: norm(max(p - q, 0)) after a rejection, p for the bonus token.
  4. _final_combine_kernel grid (B,): the sampled rows' final token from the splits.

NOTE on bit-identity with the reference. The random numbers are computed in the kernels with the
counter-based hash of sample/gumbel.py (`_hash_u32` and friends in rejection_kernels.py mirror it op
for op on int64), not precomputed with torch: the final slot's Gumbel key depends on the accept
count, so precomputing it would put the ~25 torch ops of `gumbel()` and their [B, V] int64
temporaries between kernels 2 and 3, the very launches this replaces. The uniforms are integer math
plus exact float ops, hence bit-identical; logs, exps and divisions go through libdevice's logf /
expf and round-to-nearest division on CUDA, the functions torch's CUDA kernels use, with no FMA
contraction and no flush-to-zero, so the Gumbel noise, the temperature scaling, every p(d) term and
the Gumbel-max arguments are computed exactly as the reference does. What cannot match to the bit
is a sum over the vocabulary (logsumexp, softmax normalizer), whose reduction order differs from
torch's by design: a decision can differ only where p(d) lies within an ulp of u * q(d), or where
two residual scores tie to an ulp. Greedy rows, and sampled rows drafted greedily (q one-hot, no
softmax), involve no such sum in the final token. Under the interpreter numpy's log stands in for
libdevice (it may differ from torch CPU's log in the last ulp).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from specserve.sample.rejection_kernels import (
    _accept_kernel,
    _coupled_accept_kernel,
    _coupled_slot_kernel,
    _final_combine_kernel,
    _final_sample_kernel,
    _slot_stats_kernel,
)

# Vocabulary entries per program; at most _MAX_SPLITS splits per row (BLOCK_S in kernels 2, 4).
_BLOCK_V = 2048
_MAX_SPLITS = 128


def _slot_rows(
    # [B, K + 1, V]
    target_logits: Tensor,
    block_v: int,
) -> tuple[Tensor, int, int]:
    """(logits as [B * (K + 1), V] rows with unit vocabulary stride, the vocabulary block, the
    number of splits): the layout both verification launchers hand their first kernel."""
    B, k1, V = target_logits.shape
    logits = target_logits.reshape(B * k1, V)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_v = max(block_v, triton.next_power_of_2(triton.cdiv(V, _MAX_SPLITS)))
    return logits, block_v, triton.cdiv(V, block_v)


def coupled_sample_triton(
    # [B, K + 1, V] raw target logits
    target_logits: Tensor,
    # [B, K] draft tokens (padding past num_draft may hold anything)
    draft_tokens: Tensor,
    # [B] int64
    num_draft: Tensor,
    # [B] float32, 0 = greedy
    temperature: Tensor,
    # [B] int64
    seeds: Tensor,
    # [B] int64 position of output slot 0
    positions: Tensor,
    all_greedy: bool,
    # [B * (K + 1), V] float32 `process_logits` output when top-k / top-p / min-p are in use
    processed_logits: Tensor | None = None,
    block_v: int = _BLOCK_V,
    synthetic_rate: float | None = None,
) -> tuple[Tensor, Tensor]:
    """ "coupled" verification in two launches: (1) per split of every slot row, the target's
    own draw (`sample`'s Gumbel-max, or the argmax for greedy rows); (2) per request, the
    splits combined and drafts accepted while equal to the draw. Returns (output tokens
    [B, K + 1] int64, -1 after the last valid; num_accepted [B] int64).
    `synthetic_rate` (benchmarks): "synthetic" verification instead, each draft accepted with
    that probability and the target's draw after the last accepted, in the same two launches
    (its torch reference took ~110 launches a step: gpt-oss-20b shape, batch 1, H100)."""
    B, k1, V = target_logits.shape
    K = k1 - 1
    dev = target_logits.device
    out_tokens = torch.empty(B, k1, dtype=torch.int64, device=dev)
    num_acc = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return out_tokens, num_acc
    logits, block_v, S = _slot_rows(target_logits, block_v)
    apply_temp = processed_logits is None
    proc = logits if apply_temp else processed_logits
    tok_val = torch.empty(B * k1, S, dtype=torch.float32, device=dev)
    tok_idx = torch.empty(B * k1, S, dtype=torch.int32, device=dev)
    opts = dict(enable_fp_fusion=False, enable_reflect_ftz=False)
    _coupled_slot_kernel[(B * k1, S)](
        logits,
        proc,
        temperature,
        seeds,
        positions,
        tok_val,
        tok_idx,
        V,
        S,
        logits.stride(0),
        proc.stride(0),
        temperature.stride(0),
        seeds.stride(0),
        K1=k1,
        SAMPLED=not all_greedy,
        APPLY_TEMP=apply_temp,
        PRECISE=dev.type == "cuda",
        BLOCK_V=block_v,
        num_warps=4,
        **opts,
    )
    _coupled_accept_kernel[(B,)](
        draft_tokens,
        num_draft,
        tok_val,
        tok_idx,
        out_tokens,
        num_acc,
        V,
        S,
        draft_tokens.stride(0),
        out_tokens.stride(0),
        seeds,
        positions,
        seeds.stride(0),
        0.0 if synthetic_rate is None else synthetic_rate,
        K=K,
        BLOCK_K=triton.next_power_of_2(k1),
        BLOCK_S=triton.next_power_of_2(S),
        SYNTHETIC=synthetic_rate is not None,
        num_warps=1,
    )
    return out_tokens, num_acc


def rejection_sample_triton(
    # [B, K + 1, V] raw target logits
    target_logits: Tensor,
    # [B, K] draft tokens (padding past num_draft may hold anything)
    draft_tokens: Tensor,
    # [B, K, V] draft probabilities over the target vocab, or None (q one-hot at the draft)
    draft_probs: Tensor | None,
    # [B] int64
    num_draft: Tensor,
    # [B] float32, 0 = greedy
    temperature: Tensor,
    # [B] int64
    seeds: Tensor,
    # [B] int64 position of output slot 0
    positions: Tensor,
    all_greedy: bool,
    # [B * (K + 1), V] float32 `process_logits` output when top-k / top-p / min-p are in use;
    # None: temperature is the only processing and is applied in the kernels
    processed_logits: Tensor | None = None,
    block_v: int = _BLOCK_V,
) -> tuple[Tensor, Tensor]:
    """-> (output tokens [B, K + 1] int64, -1 after the last valid; num_accepted [B] int64)."""
    B, k1, V = target_logits.shape
    K = k1 - 1
    dev = target_logits.device
    out_tokens = torch.empty(B, k1, dtype=torch.int64, device=dev)
    num_acc = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return out_tokens, num_acc
    logits, block_v, S = _slot_rows(target_logits, block_v)
    sampled = not all_greedy
    apply_temp = processed_logits is None
    proc = logits if apply_temp else processed_logits
    probs = draft_probs
    if probs is not None and probs.stride(2) != 1:
        probs = probs.contiguous()
    probs_arg = probs if probs is not None else logits
    probs_strides = (probs.stride(0), probs.stride(1)) if probs is not None else (0, 0)

    def f32(*shape: int) -> Tensor:
        return torch.empty(*shape, dtype=torch.float32, device=dev)

    def i32(*shape: int) -> Tensor:
        return torch.empty(*shape, dtype=torch.int32, device=dev)

    amax_val, amax_idx = f32(B * k1, S), i32(B * k1, S)
    pmax, psum = (f32(B * k1, S), f32(B * k1, S)) if sampled else (amax_val, amax_val)
    final_max, final_sum = f32(B), f32(B)
    precise = dev.type == "cuda"
    # Torch's arithmetic: no FMA contraction, libdevice without flush-to-zero (see the NOTE).
    opts = dict(enable_fp_fusion=False, enable_reflect_ftz=False)
    common = dict(SAMPLED=sampled, APPLY_TEMP=apply_temp, PRECISE=precise)
    _slot_stats_kernel[(B * k1, S)](
        logits,
        proc,
        temperature,
        amax_val,
        amax_idx,
        pmax,
        psum,
        V,
        S,
        logits.stride(0),
        proc.stride(0),
        temperature.stride(0),
        K1=k1,
        BLOCK_V=block_v,
        num_warps=4,
        **common,
        **opts,
    )
    _accept_kernel[(B,)](
        logits,
        proc,
        temperature,
        seeds,
        positions,
        draft_tokens,
        probs_arg,
        num_draft,
        amax_val,
        amax_idx,
        pmax,
        psum,
        out_tokens,
        num_acc,
        final_max,
        final_sum,
        V,
        S,
        logits.stride(0),
        proc.stride(0),
        draft_tokens.stride(0),
        *probs_strides,
        out_tokens.stride(0),
        temperature.stride(0),
        seeds.stride(0),
        K=K,
        HAS_PROBS=probs is not None,
        BLOCK_K=triton.next_power_of_2(k1),
        BLOCK_S=triton.next_power_of_2(S),
        num_warps=4,
        **common,
        **opts,
    )
    if not sampled:
        return out_tokens, num_acc
    main_val, main_idx, fb_val, fb_idx, has_main = (
        f32(B, S),
        i32(B, S),
        f32(B, S),
        i32(B, S),
        i32(B, S),
    )
    _final_sample_kernel[(B, S)](
        logits,
        proc,
        temperature,
        seeds,
        positions,
        draft_tokens,
        probs_arg,
        num_draft,
        num_acc,
        final_max,
        final_sum,
        main_val,
        main_idx,
        fb_val,
        fb_idx,
        has_main,
        V,
        S,
        logits.stride(0),
        proc.stride(0),
        draft_tokens.stride(0),
        *probs_strides,
        temperature.stride(0),
        seeds.stride(0),
        K=K,
        APPLY_TEMP=apply_temp,
        HAS_PROBS=probs is not None,
        PRECISE=precise,
        BLOCK_V=block_v,
        num_warps=4,
        **opts,
    )
    _final_combine_kernel[(B,)](
        temperature,
        num_acc,
        main_val,
        main_idx,
        fb_val,
        fb_idx,
        has_main,
        out_tokens,
        V,
        S,
        out_tokens.stride(0),
        temperature.stride(0),
        BLOCK_S=triton.next_power_of_2(S),
        num_warps=1,
    )
    return out_tokens, num_acc
