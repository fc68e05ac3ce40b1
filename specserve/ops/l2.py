"""The L2 policy of the decode kernels' weight streams: evict first.

A batch-1 step streams every weight once (2-5 GB against the H100's 50 MB L2), so by the time
a layer's attention reads its KV cache, the weights streamed since the last step have evicted
it, and those small, latency-bound reads wait in the HBM queues behind the next projection's
weight stream (gpt-oss-20b's attention slowed 8.35 -> 10.50 us on an H100 when the o
projection preloaded more). With `tunables().weight_eviction` "evict_first" (the default), the
weight loads of the decode kernels (the gemv, the skinny matmul, the MoE decode kernels, bf16
and MXFP4) carry an L2 evict-first hint, so the KV cache, activations and routing stay in the
L2 across layers and steps while the weights pass through it.

Measured (H100, batch 1, `python benchmarks/timeline_sweep.py --step-ms`, benchmarks/RESULTS.md),
device-busy us a step without / with: gpt-oss-20b 1797, 1789 / 1714, 1717 (attention 8.3 ->
6.3 us a layer); Qwen3-30B-A3B 2923 / 2892; GLM-4.7-Flash 3651 / 3574; Llama-3-8B 5392 / 5382
(its attention slower, 7.5 -> 9.5 us, its MLP's down gemv faster).

Tried and dropped (H100, benchmarks/RESULTS.md): a side stream in the captured graph
bulk-prefetching (`cp.async.bulk.prefetch.L2`) the next layer's qkv weight while a layer's
attention, merge, o projection and routing run. The next qkv gemv got faster (Qwen3-30B-A3B
8.4 -> 4.7-6.7 us), but the 21-30 MB took HBM time from the kernels beside it: every variant's
step was slower (Qwen3-30B-A3B 2919-3290 vs 2859-2868 us, gpt-oss-20b 1813-1840 vs 1722).
Also the lm_head's first 16 or 32 MiB loaded evict-last, to stay in the L2 from one step to
the next while the rest streams evict-first: Qwen3-30B-A3B's lm_head gemv took 195.9 / 197.9
us against 196.3-197.0 without, step 2727 / 2725 vs 2725-2727 us: the rows do not survive a
step's ~6 GB stream, or cost what they save.

Read at each launch (a constexpr of the kernels); "" (Triton's default, evict-normal) is what
the GPU tests compare the hinted kernels with, bit for bit.
"""

from __future__ import annotations

from specserve.tunables import tunables

_POLICIES = ("", "evict_first")


def weight_eviction() -> str:
    """The eviction policy string the kernels pass to tl.load for weight tiles."""
    policy = tunables().weight_eviction
    if policy not in _POLICIES:
        raise ValueError(f"tunables weight_eviction {policy!r}: expected one of {_POLICIES}")
    return policy


def weights_evict_first() -> bool:
    return weight_eviction() == "evict_first"
