"""How a paged-attention launch is shaped, from host-side sizes only (so a captured graph and
the eager step it stands for choose alike): the tile (`launch_config`), whether the kernel may
take this step's RoPE + KV write (`fuses_kv_write`), and the key splits (`split_count`).

Small decode batches over long contexts leave most SMs idle with one program per (q-block, KV
head), so the keys are then split over a third grid axis (flash-decoding): each split writes its
partial softmax state and split_merge.py merges them. The numbers are `tunables()` fields
(`attn_*`); tunables.py gives the measurements behind each.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from specserve.ops import graph_rows
from specserve.tunables import tunables


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # rows per program: BLOCK_Q query tokens x GROUP heads (padded to a power of 2)
    block_n: int  # key positions per KV tile
    num_warps: int
    num_stages: int  # the key loop's software pipeline depth when keys are not split

    def stages(self, num_splits: int) -> int:
        """The launch's pipeline depth: split programs walk a few key tiles each, where the
        deep pipeline only costs (Llama-3-8B batch 1, 16 splits, H100: 5417 -> 5439 us a step
        with 5 stages)."""
        return self.num_stages if num_splits == 1 else 2

    def split_block_n(self, num_splits: int, split_len: int, dtype: torch.dtype) -> int:
        """The key tile of a launch with `num_splits` splits over `split_len` keys: smaller
        (attn_split_block_n) where a split holds few keys at most, so more splits get work."""
        t = tunables()
        short = split_len // num_splits <= t.attn_split_small_tile_max_keys
        if num_splits > 1 and short and t.attn_split_block_n and dtype != torch.float32:
            return min(self.block_n, max(16, t.attn_split_block_n))
        return self.block_n


def launch_config(
    group: int, max_query_len: int, head_dim: int, dtype: torch.dtype, kv_fp8: bool = False
) -> LaunchConfig:
    """Tile sizes chosen so that sm_90 ptxas reports no register spills for head_dim <= 128.

    A tl.dot needs at least 16 rows. 16-bit inputs run on tensor cores: up to 128 rows (8 warps)
    for head_dim <= 128. fp32 uses exact (ieee) FMA dots, which need far more registers per row:
    at most 32 rows with 32-key tiles; fp32 is for tests and tiny models, not for speed.
    `dtype` is the dots' dtype; `kv_fp8`: the cache holds fp8, whose decode tiles take 128 keys,
    the bytes of a 16-bit 64-key tile (Llama-3-8B heads, batch 64, 4k context, H100: 275.6 ->
    241.0 us a layer, 1.95 -> 2.23 TB/s; 8 warps or shallower pipelines were slower).
    """
    if dtype == torch.float32:
        max_m, block_n = 32, 32
    elif head_dim > 128:
        max_m, block_n = 64, 32
    else:
        max_m, block_n = 128, 64
    rows = triton.next_power_of_2(group * max(max_query_len, 1))
    block_m = max(min(max(rows, 16), max_m), triton.next_power_of_2(group))
    num_warps = 8 if block_m >= 128 or dtype == torch.float32 else 4
    # Decode and verification tiles (<= 32 rows) walk a request's whole key range once the
    # batch fills the SMs (no key splits: batch 16+); prefill tiles keep the shallow pipeline
    # they were measured with.
    num_stages = tunables().attn_num_stages if block_m <= 32 else 2
    if kv_fp8 and block_m <= 32 and block_n == 64:
        block_n = 128
    return LaunchConfig(block_m, block_n, num_warps, num_stages)


def fuses_kv_write(
    num_heads: int, num_kv_heads: int, max_query_len: int, head_dim: int, dtype: torch.dtype
) -> bool:
    """Whether `paged_attention` may take this step's RoPE + KV write (`new_kv`): when
    attn_fuse_rope_kv is on and every request's new tokens fit one small q-block (decode and
    verification batches), so each new key is written and read by one program only."""
    group = num_heads // num_kv_heads
    block_m = launch_config(group, max_query_len, head_dim, dtype).block_m
    # At most 32 rows: the unrotated q, its partner and cos / sin tiles all live in registers.
    # The kernel walks the q-block's tokens with tl.arange(0, BLOCK_Q): a power of two only
    # (a GQA group of 3, as SmolLM2's 9 / 3 heads, gives BLOCK_Q = 16 // 3 = 5).
    block_q = block_m // group
    pow2 = block_q & (block_q - 1) == 0
    return tunables().attn_fuse_rope_kv and pow2 and max_query_len <= block_q and block_m <= 32


def split_count(
    num_tokens: int,
    num_reqs: int,
    block_q: int,
    num_kv_heads: int,
    split_len: int,
    device: torch.device,
) -> int:
    """The split count of a launch, from sizes that a captured graph and the eager step it
    stands for share, so both round the same way: the launch's q-blocks (num_tokens // block_q
    + num_reqs) bounded by `graph_rows.row_bound` (for a uniform batch of B requests padded to
    the capture size bg, eager or graph: bg x q tokens and bg requests) and `split_len`
    (max_model_len in the engine: the graph's bound, never the batch's own max_seq_len)."""
    q_blocks = graph_rows.row_bound(num_tokens) // block_q + graph_rows.row_bound(num_reqs)
    return _num_splits(q_blocks * num_kv_heads, split_len, device)


def _num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Key splits per (q-block, KV head): 1 unless the grid leaves most SMs idle (small decode
    batches: fewer programs than attn_programs_per_sm x SMs) and keys are many (at least
    attn_min_keys_per_split each); a power of two <= attn_max_splits.

    From host-side sizes only (a captured graph uses max_model_len for max_seq_len)."""
    t = tunables()
    sms = _num_sms(device.index) if device.type == "cuda" else 132
    room = t.attn_programs_per_sm * sms // max(num_programs, 1)
    want = min(t.attn_max_splits, max_seq_len // t.attn_min_keys_per_split, room)
    return 1 if want < 2 else 1 << (want.bit_length() - 1)


@functools.cache
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
