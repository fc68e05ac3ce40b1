"""The one typed home of the engine's kept switches and numeric tunables.

Kernels and runners read `tunables()` when they launch; tests and benchmarks change a field for a
block of code with `override(...)`, which restores the previous values on exit. Nothing else in
the package keeps a module-level knob.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class Tunables:
    """Fields are grouped by the package that reads them; each says what it trades."""

    # --- ops ---
    # Launch the forward pass's Triton kernels with programmatic dependent launch where the GPU
    # has it (sm_90+, ops/pdl.py). Off: plain launches, which tests compare with bit for bit.
    pdl: bool = True
    # The step's bookkeeping kernels (ops/spec_kernels_triton.py) launched with PDL too: each
    # lets the next launch at its start. Off until timed on a GPU; tests compare the two.
    pdl_step_kernels: bool = False
    # The L2 policy of the decode kernels' weight loads (ops/l2.py): "evict_first", or ""
    # (Triton's default, evict-normal), which the bit-equality tests compare against.
    weight_eviction: str = "evict_first"
    # A greedy step's tokens from the lm_head gemv's argmax epilogue (ops/greedy_head.py).
    # Off: lm_head, then ops.argmax (what skinny, cuBLAS and CPU steps always run).
    greedy_argmax_epilogue: bool = True
    # One-token MoE steps whose gate_up table config is a key here run the persistent gate_up
    # kernel at the value's (config, programs an SM) (ops/moe_triton.py says why).
    moe_gate_up_persistent: dict[tuple[int, int, int], tuple[tuple[int, int, int], int]] = (
        dataclasses.field(default_factory=lambda: {(4, 2048, 4): ((4, 2048, 8), 2)})
    )
    # The MoE router kernel takes the k best in one partial bitonic sort (ops/moe_router.py).
    # Off: k rounds of one max reduction each, its fallback for k beyond the experts' row.
    moe_route_topk_sort: bool = True
    # Renormalized softmax routers route as the k best logits softmaxed among themselves
    # (ops/moe_router.py). Off: the full softmax, then the k best renormalized.
    moe_route_softmax_topk: bool = True

    # --- attention ---
    # Paged attention takes this step's RoPE, qk-norm and KV write itself for decode and
    # verification batches (attention/launch_policy.py `fuses_kv_write`): batch-1 decode 5.817
    # -> 5.726 ms a step, H100. Off: the RoPE + KV write kernel first, as prefill always runs.
    attn_fuse_rope_kv: bool = True
    # Key splits (flash-decoding, attention/launch_policy.py) hold at least this many keys each:
    # batch-1 decode at max_model_len 400 (4 splits) 5.64 vs 5.76 ms a graph unsplit, H100.
    attn_min_keys_per_split: int = 64
    # At most this many key splits (a power of two): 8 took Qwen3-30B-A3B's batch-1 step from
    # 2808 to 2857 us (H100, `benchmarks/timeline_sweep.py --shape qwen3-30b-a3b --step-ms`).
    attn_max_splits: int = 16
    # Programs an SM is given before keys stop being split: 1 keeps a batch of 16 requests x 8
    # KV heads (the H100's 132 SMs filled once) unsplit. 4 (2 splits there) gained 0.4-1% a
    # step at short contexts and nothing at 1024-token ones; batches 2-8 unmeasured with it.
    attn_programs_per_sm: int = 1
    # The key loop's pipeline depth for decode / verification tiles walking whole key ranges:
    # 5 double-buffers the K and V tiles (Llama-3-8B batch 16 at 1024-token contexts, H100:
    # attention 41.9 -> 33.0 us a layer, step 7085 -> 6764 us; 3 stages: 7014 us).
    attn_num_stages: int = 5
    # Split launches take key tiles of at most this many keys (0: the launch's own tile, 64 at
    # head_dim <= 128), so short contexts spread over more splits (Qwen3-30B-A3B batch 1, H100:
    # attention 8.66 -> 8.07 us a layer, step 2862 -> 2836 us; 32-key tiles gained nothing)...
    attn_split_block_n: int = 16
    # ... where a split holds at most this many keys (max_model_len / splits); longer splits
    # keep the launch's tile (a 16-key tile there is 4x the key-loop iterations, unmeasured).
    attn_split_small_tile_max_keys: int = 64
    # MLA prefill through per-head K/V expanded from the latent (attention/mla_expanded.py) for
    # steps whose longest query has at least this many tokens (None: never). GLM-4.7-Flash
    # shape, H100, time to first token at 512 / 2048 / 8192 tokens: latent 39.5 / 80.1 / 817 ms,
    # expanded 54.6 / 56.2 / 254 ms (`benchmarks/mla_prefill.py`).
    mla_expand_prefill_min_query: int | None = 1024
    # ... unless the step's expanded keys and values (requests x longest context x heads x
    # (nope + rope + v) elements) exceed this.
    mla_expand_max_elements: int = 1 << 28
    # Steps of at most this many tokens (graph_rows.row_bound) run MLA as the three fused
    # kernels of attention/mla_fused.py (a batch-16 decode, a batch-4 K = 3 verification);
    # larger ones the torch glue and cuBLAS bmm's. 0: never fused.
    mla_fuse_max_tokens: int = 16
    # MLA attention requests its first key tile's older rows before the PDL wait (16-key tiles;
    # GLM-4.7-Flash batch 1, H200: attention 7.64 -> 6.08 us a layer, step 3021 -> 2938 us).
    # Off: every key after the wait, as 32-key tiles on a GPU always load them.
    mla_early_kv: bool = True
    # MLA key splits: at least this many keys each (below 32 a split is two 16-key tiles or
    # less: more programs than work), at most this many splits (8: GLM-4.7-Flash batch 1,
    # H100, attention 6.09 -> 8.98 us a layer, step 3336 -> 3459 us).
    mla_min_keys_per_split: int = 32
    mla_max_splits: int = 16

    # --- models ---
    # DeepSeek-V3 / GLM-4.x shared experts fused into the routed experts' kernels (models/moe.py).
    # Off: a separate MLP and add, as MXFP4 and gpt-oss-style experts always run.
    moe_fuse_shared_experts: bool = True


_current = Tunables()


def tunables() -> Tunables:
    """The values in force."""
    return _current


@contextmanager
def override(**changes: Any) -> Iterator[Tunables]:
    """Set fields of the tunables for the duration of a `with` block."""
    names = {f.name for f in dataclasses.fields(Tunables)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise AttributeError(f"unknown tunables {unknown}; known: {sorted(names)}")
    saved = {name: getattr(_current, name) for name in changes}
    for name, value in changes.items():
        setattr(_current, name, value)
    try:
        yield _current
    finally:
        for name, value in saved.items():
            setattr(_current, name, value)
