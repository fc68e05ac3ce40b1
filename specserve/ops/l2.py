"""The L2 policy of the decode kernels' weight streams: evict first.

A batch-1 step streams every weight once (2-5 GB against the H100's 50 MB L2), so by the time
a layer's attention reads its KV cache, the weights streamed since the last step have evicted
it, and those small, latency-bound reads wait in the HBM queues behind the next projection's
weight stream (RESULTS.md session 15: gpt-oss-20b's attention slowed 8.35 -> 10.50 us when the o
projection preloaded more). With WEIGHT_EVICTION = "evict_first", the weight loads of the
decode kernels (the gemv, the skinny matmul, the MoE decode kernels, bf16 and MXFP4) carry an
L2 evict-first hint, so the KV cache, activations and routing stay in the L2 across layers and
steps while the weights pass through it.

Measured (H100, batch 1, `benchmarks/timeline_sweep.py --step-ms --variants
"base;specserve.ops.l2.WEIGHT_EVICTION='evict_first'"`, RESULTS.md session 16), device-busy us
a step without / with: gpt-oss-20b 1797, 1789 / 1714, 1717 (attention 8.3 -> 6.3 us a layer);
Qwen3-30B-A3B 2923 / 2892; GLM-4.7-Flash 3651 / 3574; Llama-3-8B 5392 / 5382 (its attention
slower, 7.5 -> 9.5 us, its MLP's down gemv faster). So evict-first is the default.

Read at each launch (a constexpr of the kernels): `--variants "base;specserve.ops.l2.
WEIGHT_EVICTION=''"` A/B's it.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no prefetch
    triton = None

WEIGHT_EVICTION = "evict_first"  # or "" (Triton's default, evict-normal)
_POLICIES = ("", "evict_first")


def weight_eviction() -> str:
    """The eviction policy string the kernels pass to tl.load for weight tiles."""
    if WEIGHT_EVICTION not in _POLICIES:
        raise ValueError(f"l2.WEIGHT_EVICTION {WEIGHT_EVICTION!r}: expected one of {_POLICIES}")
    return WEIGHT_EVICTION


def weights_evict_first() -> bool:
    return weight_eviction() == "evict_first"


# ---- next-layer prefetch (experiment, off) ----------------------------------------------------
# A batch-1 MoE step's attention, split merge, o projection and routing (~15 us a layer at
# Qwen3-30B-A3B) are chains of dependent round trips: HBM idles there while the next weights
# to stream, the next layer's qkv projection (21 MB at Qwen3-30B-A3B), are known. With
# PREFETCH_NEXT_QKV the decoder layer, once its own qkv matmul is queued, has a side stream
# bulk-prefetch the next layer's qkv weight into the L2 (a few programs issue
# `cp.async.bulk.prefetch.L2` and exit: no data comes back, nothing waits), so that matmul reads
# L2 instead of HBM. The weight streams in between (the experts, evict-first) leave the L2
# before the prefetched lines (evict-normal, or evict-last with PREFETCH_EVICT_LAST).
# Earlier prefetches that lost (pdl.py, moe_router.py): a kernel's own weights just before it
# runs, o_proj's during attention on Llama-3-8B (whose attention is short), the experts' first
# rows from the router. Session 19 measures this one.
PREFETCH_NEXT_QKV = False
PREFETCH_EVICT_LAST = False
# Where in the layer the prefetch is queued: "qkv" (after the qkv matmul: during attention) or
# "attention" (after the attention kernel: during the merge, o_proj and routing).
PREFETCH_AFTER = "qkv"
# Programs that issue it (0: one a 512 KB): fewer programs issue fewer bulk prefetches at once.
PREFETCH_PROGRAMS = 0
PREFETCH_CAP_BYTES = 0  # prefetch only the weight's first bytes (0: all of it)
PREFETCH_MAX_BYTES = 32 << 20  # a weight larger than this is not prefetched (the L2 is 50 MB)
PREFETCH_MAX_TOKENS = 8  # decode batches only: prefill reads its weights at compute speed
_CHUNK = 4096  # bytes a bulk prefetch (a thread issues one) with PREFETCH_PROGRAMS = 0
_LANES = 128  # threads a program (4 warps, one chunk each)


def prefetch_wanted(x: torch.Tensor) -> bool:
    """Whether a forward with input rows `x` [num_tokens, ...] prefetches (CUDA decode, on)."""
    return (
        PREFETCH_NEXT_QKV and triton is not None and x.is_cuda and x.shape[0] <= PREFETCH_MAX_TOKENS
    )


def prefetch_on_side(weight: torch.Tensor) -> bool:
    """Queue a bulk L2 prefetch of `weight` (contiguous CUDA) on the device's side stream,
    after the current stream's work so far. Returns whether it did (the caller then ends its
    forward with `join`, as graph capture needs every forked stream joined)."""
    nbytes = weight.numel() * weight.element_size()
    if not weight.is_contiguous() or nbytes > PREFETCH_MAX_BYTES:
        return False
    nbytes = (min(nbytes, PREFETCH_CAP_BYTES) if PREFETCH_CAP_BYTES else nbytes) // 16 * 16
    if nbytes == 0:
        return False
    programs = PREFETCH_PROGRAMS or triton.cdiv(nbytes, _CHUNK * _LANES)
    chunk = triton.cdiv(triton.cdiv(nbytes, programs * _LANES), 16) * 16
    main = torch.cuda.current_stream(weight.device)
    side = _side_stream(main.device_index)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        _prefetch_kernel[(programs,)](
            weight.view(-1).view(torch.uint8),
            nbytes,
            chunk,
            LANES=_LANES,
            EVICT_LAST=PREFETCH_EVICT_LAST,
            num_warps=_LANES // 32,
        )
    return True


def join(device: torch.device) -> None:
    """The current stream waits for the prefetches queued so far (cheap: they finish early)."""
    main = torch.cuda.current_stream(device)
    main.wait_stream(_side_stream(main.device_index))


@functools.cache
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)


if triton is not None:

    @triton.jit
    def _prefetch_kernel(
        ptr,  # the weight's bytes (uint8)
        nbytes,  # a multiple of 16
        chunk,  # bytes a thread, a multiple of 16
        LANES: tl.constexpr,
        EVICT_LAST: tl.constexpr,
    ):
        """Each thread one bulk L2 prefetch of `chunk` bytes (fewer at the end; none past it)."""
        i = tl.program_id(0) * LANES + tl.arange(0, LANES)
        off = i.to(tl.int64) * chunk
        size = tl.minimum(tl.maximum(nbytes - off, 0), chunk).to(tl.int32)
        # Not pure: a hint with no result must not be dropped as unused.
        if EVICT_LAST:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $1, 0; "
                "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$2], $1, pol; "
                "mov.b32 $0, 0; }",
                "=r,r,l",
                [size, ptr + off],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $1, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$2], $1; mov.b32 $0, 0; }",
                "=r,r,l",
                [size, ptr + off],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
