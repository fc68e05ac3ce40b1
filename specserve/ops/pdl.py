"""Programmatic dependent launch (PDL, sm_90+) for the forward pass's Triton kernels.

A batch-1 decode step is ~250 kernels in a row, each waiting for the one before to drain, launch
and ramp up its memory pipeline: a few microseconds of idle HBM per kernel. With PDL a kernel may
be scheduled while its predecessor still runs (once every program of the predecessor has called
`gdc_launch_dependents`), so its launch and set-up overlap the predecessor's tail. Small kernels
(norm, RoPE + KV write, attention) trigger at their start; the decode matmul triggers after its
weight stream, so its successor does not take SM slots from its own later waves, and loads its
first weight tile before waiting (weights never depend on the previous kernel).

Measured (batch-1 decode, Llama-3-8B shape, H100; benchmarks/RESULTS.md): PDL took a step from
6.16 to 6.00 ms; the first-tile preload then the captured graph from 5.34 to 5.32 ms. Tried and
dropped: the matmul triggering its successor at its start (graph 5.38 ms; 5.56 with the
preload), the matmul prefetching all its weight rows into L2 (TMA bulk prefetch) before waiting
(6.37 ms a step; 6.32 with the early trigger), only o_proj's gemv prefetching its weight slice
to L2 while attention runs (graph 5.247 vs 5.221 ms), and the matmul triggering 1 or 2 K tiles
before its last (graph 5.234 / 5.372 ms).
Also dropped (H100, `benchmarks/timeline_sweep.py`): the attention kernel loading its first key
tile before waiting with this step's keys put into it from registers (Qwen3-30B-A3B step span
3246 / 3260 vs 3179 / 3169 us; attention 8.49 vs 7.31 us a layer); the K loops of the decode
gemv and of the MoE decode down kernel requesting their next weight tile before each tile's math
(software pipelining by hand; their sm_90 PTX has no cp.async): Llama-3-8B batch-1 span 5731 vs
5498 us with the gemv's, Qwen3-30B-A3B 3229 / 3202 vs 3162 us with the down kernel's; the MXFP4
decode kernels' gate_up triggering early and down loading all its K steps before waiting (busy
1812 vs 1795 us at gpt-oss-20b: gate_up's programs hold the SM's registers until they finish;
capping both kernels' registers with ptxas maxnreg to make room was far slower, 2195-2553 us);
gpt-oss-20b's o projection with whole 4096-deep rows (all its weights loaded before its wait):
o 6.71 -> 4.70 us a layer, but the attention it overlaps 8.35 -> 10.50 us (its dependent loads
queue behind o's weights): busy 1811 vs 1797 us.
Kept: the MoE gate_up decode kernel triggering right after its own wait, so the down kernel's
programs (the whole weight slab before their wait) launch early (Qwen3-30B-A3B span 3095 vs
~3178 us, GLM-4.7-Flash 3839 vs ~3896; ops/moe_triton.py); the attention kernel requesting its
first key tile's page ids before the wait with the other metadata (Qwen3-30B-A3B busy 2930 vs
2945 us, gpt-oss-20b 1788 vs 1781; attention/triton_paged.py).

The rule every kernel launched with `launch_kwargs` keeps: `start` comes before any memory
access other than weight loads, in every program, including programs that then exit early.
`gdc_wait` returns when the whole predecessor grid has finished and its writes are visible, so a
PDL kernel never reads data its predecessor is still writing, never overwrites data its
predecessor still reads, and finishes only after its predecessor did: ordering stays transitive
along the stream and results are bitwise those of plain launches. Launches from torch or cuBLAS
in between simply never trigger early.

Attention metadata is the rule's one relaxation: attention and RoPE + KV write load their
metadata (positions, seq_lens, query_start_loc, slots, cos/sin) before the wait (batch-1 decode
5.817 -> 5.773 ms a step on the H100). It is written before the forward pass (input
preparation, in-place metadata advance between draft steps): by kernels that are not PDL
launches, separated from the attention kernel by at least one kernel whose successor cannot
launch before it has waited (a decode gemv triggers after its wait; cuBLAS never triggers early;
a first PDL kernel after a plain launch starts after that launch completed). So when the
attention or RoPE kernel starts, the metadata's writers have finished and their writes are
visible; only q and the KV cache, written by the kernels right before, need the wait.

EARLY_KV (`early_kv`) relaxes it for the KV cache's older keys: an attention kernel with small
heads loads its first key tile's keys from before this step (positions < seq_len - q_len)
before the wait, and the qkv gemv before it triggers at its start. Those keys were written by
an earlier step's (or draft step's) attention kernel of the same layer, at least a layer of
kernels back, and every layer has a kernel that triggers only after its wait (the o
projection's gemv; the MoE down kernel; torch and cuBLAS launches), whose start means its
predecessor, and so everything before that, has finished: the writer is complete when the
attention kernel starts. Keys written this step (positions >= seq_len - q_len, by this kernel
or a KV-write kernel just before it) load after the wait, as before.

`tunables().pdl` turns PDL off (`benchmarks/decode.py --sweep "pdl=0;pdl=1"`; tests compare).
"""

from __future__ import annotations

import functools

import torch

from specserve.tunables import tunables

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# Attention over heads of at most this size (split launches: batch-1-like decode) also loads
# its first key tile's older keys and values before the wait (triton_paged EARLY_KV), and the
# qkv projection feeding it lets it launch at the projection's start (`early_kv`) so those
# loads run during the projection. H100: gpt-oss-120b (head_dim 64) batch 1 2.39 -> 2.35 ms a
# step; Qwen3-30B-A3B (head_dim 128, a tile twice the registers) was slower with it
# (device-busy 2875 -> 2984 us a step), so 64.
EARLY_KV_MAX_HEAD_DIM = 64


def early_kv(head_dim: int) -> bool:
    """Whether attention with `head_dim` preloads its first key tile (and its qkv projection
    triggers at its start): safe because the o projection's gemv triggers only after its wait
    (above)."""
    return head_dim <= EARLY_KV_MAX_HEAD_DIM


@functools.cache
def _supported(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def on(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now."""
    return tunables().pdl and device.type == "cuda" and _supported(device.index)


def launch_kwargs(device: torch.device) -> dict[str, bool]:
    """Extra launch arguments of a kernel with a `PDL: tl.constexpr` parameter."""
    return {"PDL": True, "launch_pdl": True} if on(device) else {"PDL": False}


if triton is not None:

    @triton.jit
    def trigger(PDL: tl.constexpr):
        """Let the next kernel launch (once every program of this one has called it)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def wait(WAIT: tl.constexpr):
        """Wait for the previous kernel to finish, its writes visible (WAIT: under PDL)."""
        if WAIT:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def start(PDL: tl.constexpr):
        """First statement of a PDL kernel: let the next kernel launch, then wait for the
        previous one (no-ops without PDL)."""
        trigger(PDL)
        wait(PDL)
