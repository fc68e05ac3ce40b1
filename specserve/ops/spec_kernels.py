"""Input preparation and per-step updates of the speculative hot path: one Triton kernel each on
CUDA (`spec_kernels_triton.py`), the torch code they replaced (`*_ref`) everywhere else.

At batch 1 a step takes a few milliseconds and every small torch op is a launch of a few
microseconds; preparing one target step, one draft prefill or one draft decode step took 5 to 15
of them. Each op below is one launch instead. All are CUDA-graph safe: no host sync, grids from
host-side sizes only, outputs allocated with torch.empty (graph-pool memory under capture) or
written in place. The CPU path runs the references, which the tests compare the kernels with
(tests/test_spec_kernels.py, under TRITON_INTERPRET=1 and on CUDA). Verification's kernels sit
with their reference in `sample/` (rejection_triton.py, dispatched from rejection.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def _use_triton(x: Tensor) -> bool:
    # Integer index arithmetic only, so unlike ops/fused.py there is no autograd case.
    return x.is_cuda


# ---- target step inputs -----------------------------------------------------------------------
def prepare_target_inputs_ref(
    # [rows, width] int64 persistent token buffer
    token_ids: Tensor,
    # [rows, max_blocks] int32
    block_table: Tensor,
    # [B] int64 persistent row of each batch row
    idx_mapping: Tensor,
    # [T] int64 batch row of each token
    token_req: Tensor,
    # [T] int64
    positions: Tensor,
    block_size: int,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
    # (seq_lens [B] int64, positions out [T], seq_lens out [B] any int dtype): also copy the
    # step's positions and seq_lens there (a graph's metadata inputs)
    meta: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    rows = idx_mapping[token_req]
    input_ids = token_ids[rows, positions]
    blk = block_table[rows, positions // block_size].long()
    slot = blk * block_size + positions % block_size
    res = (input_ids, slot, block_table[idx_mapping])
    if meta is not None:
        meta[1].copy_(positions)
        meta[2].copy_(meta[0])
    if out is None:
        return res
    for o, r in zip(out, res):
        o.copy_(r)
    return out


def prepare_target_inputs(
    token_ids: Tensor,
    block_table: Tensor,
    idx_mapping: Tensor,
    token_req: Tensor,
    positions: Tensor,
    block_size: int,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
    meta: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gather a target step's inputs from the persistent state ->
    (input_ids [T] int64, slot_mapping [T] int64, block_table [B, max_blocks] int32), written
    into `out` when given (a CUDA graph's input buffers: no copies before the replay).
    `meta` = (seq_lens, positions out, seq_lens out): positions and seq_lens copied into the
    graph's metadata buffers too (in the same launch, not two copies more in the step)."""
    impl = prepare_target_inputs_ref
    if _use_triton(positions):
        from specserve.ops.spec_kernels_triton import prepare_target_inputs_triton as impl
    return impl(token_ids, block_table, idx_mapping, token_req, positions, block_size, out, meta)


def write_verified_tokens_ref_(
    # [rows, width] int64 persistent token buffer, written in place
    token_ids: Tensor,
    # [B] int64
    idx_mapping: Tensor,
    # [B] int64 position of output slot 0
    out_pos0: Tensor,
    # [B, K + 1] int64 verified tokens (-1 after the last valid one)
    out_tokens: Tensor,
    # [B] int64, or None: nothing was drafted (0 accepted everywhere)
    num_accepted: Tensor | None,
    # [B] int64, 0 for rows that produce no token (mid-prompt chunks)
    samples: Tensor,
    # [rows] int64 or None: also set num_computed[idx_mapping] = seq_lens - num_draft + accepted
    num_computed: Tensor | None = None,
    # [B] int64 each (with num_computed)
    seq_lens: Tensor | None = None,
    num_draft: Tensor | None = None,
) -> None:
    k1 = out_tokens.shape[1]
    j = torch.arange(k1, device=out_tokens.device)
    pos = out_pos0[:, None] + j
    acc = num_accepted if num_accepted is not None else torch.zeros_like(out_pos0)
    valid = (j[None, :] <= acc[:, None]) & (samples[:, None] > 0)
    pos = torch.where(valid, pos, token_ids.shape[1] - 1)
    token_ids[idx_mapping[:, None], pos] = out_tokens
    if num_computed is not None:
        num_computed[idx_mapping] = seq_lens - num_draft + acc


def write_verified_tokens_(
    token_ids: Tensor,
    idx_mapping: Tensor,
    out_pos0: Tensor,
    out_tokens: Tensor,
    num_accepted: Tensor | None,
    samples: Tensor,
    num_computed: Tensor | None = None,
    seq_lens: Tensor | None = None,
    num_draft: Tensor | None = None,
) -> None:
    """Store verified tokens in the token buffer (drafts already there are overwritten with
    identical values); with `num_computed`, also record what the step leaves computed (async
    scheduling places the next step from it). The reference sends masked-off slots to the
    scratch (last) column, the kernel skips them: the scratch column's content is undefined
    either way."""
    impl = write_verified_tokens_ref_
    if _use_triton(out_tokens):
        from specserve.ops.spec_kernels_triton import write_verified_tokens_triton_ as impl
    impl(token_ids, idx_mapping, out_pos0, out_tokens, num_accepted, samples, num_computed,
         seq_lens, num_draft)  # fmt: skip


# ---- async scheduling: starts the host could not know ------------------------------------------
def place_on_device_ref_(
    # [rows] int64 tokens each persistent row has computed (written by the previous step)
    num_computed: Tensor,
    # [B] int64
    idx_mapping: Tensor,
    # [B] int64, 1 where the host's start is an upper bound
    start_on_device: Tensor,
    # [B + 1] int64
    query_start_loc: Tensor,
    # [T] int64, shifted in place
    positions: Tensor,
    # [B] int64 each, shifted in place
    seq_lens: Tensor,
    out_pos0: Tensor,
) -> None:
    true_start = num_computed[idx_mapping]
    delta = torch.where(start_on_device > 0, true_start - (out_pos0 - 1), 0)
    lens = query_start_loc[1:] - query_start_loc[:-1]
    positions += torch.repeat_interleave(delta, lens, output_size=positions.shape[0])
    seq_lens += delta
    out_pos0 += delta


def place_on_device_(
    num_computed: Tensor,
    idx_mapping: Tensor,
    start_on_device: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    seq_lens: Tensor,
    out_pos0: Tensor,
) -> None:
    """Rows scheduled behind a step whose accept counts the host has not read: their host start
    is an upper bound; shift positions, seq_lens and out_pos0 by the true start (the previous
    step's num_computed) minus it. Such rows decode (out_pos0 = start + 1). One launch on CUDA
    (the torch code took nine)."""
    impl = place_on_device_ref_
    if _use_triton(positions):
        from specserve.ops.spec_kernels_triton import place_on_device_triton_ as impl
    impl(num_computed, idx_mapping, start_on_device, query_start_loc, positions, seq_lens, out_pos0)


# ---- draft prefill inputs ---------------------------------------------------------------------
def prepare_draft_prefill_inputs_ref(
    # [rows, width] int64
    token_ids: Tensor,
    # [B] int64
    idx_mapping: Tensor,
    # [T] int64
    token_req: Tensor,
    # [T] int64 target positions
    positions: Tensor,
    # [B + 1] int32 or int64
    query_start_loc: Tensor,
    # [B] int64 each
    num_draft: Tensor,
    num_accepted: Tensor,
    shift: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    ids = token_ids[idx_mapping[token_req], positions + shift]
    # Last valid (verified) token of each request: rejected drafts after it are padding.
    last = query_start_loc[1:] - 1 - num_draft + num_accepted
    P = positions[last]
    return ids, last, P + 1, P + 2


def prepare_draft_prefill_inputs(
    token_ids: Tensor,
    idx_mapping: Tensor,
    token_req: Tensor,
    positions: Tensor,
    query_start_loc: Tensor,
    num_draft: Tensor,
    num_accepted: Tensor,
    shift: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Draft prefill inputs -> (input ids [T]: the target's tokens shifted by `shift`; index of
    each request's last verified token [B]; its position P plus 1 and plus 2 [B]), all int64."""
    impl = prepare_draft_prefill_inputs_ref
    if _use_triton(positions):
        from specserve.ops.spec_kernels_triton import prepare_draft_prefill_inputs_triton as impl
    return impl(
        token_ids,
        idx_mapping,
        token_req,
        positions,
        query_start_loc,
        num_draft,
        num_accepted,
        shift,
    )


# ---- draft decode inputs ----------------------------------------------------------------------
@dataclass
class DraftDecodeInputs:
    """One single-token draft step of B requests; fields not asked for are None."""

    # [B] int64 input ids: token_ids[rows, positions + shift]
    input_ids: Tensor | None
    # [B] int64 positions + shift + 1: where the step's draft is written
    write_pos: Tensor | None
    # [B, max_blocks] int32 block-table rows
    block_table: Tensor | None
    # [B] int64, -1 at or past max_model_len (drafts never write KV there)
    slot_mapping: Tensor | None
    # [B] int32 min(position, max_model_len - 1) + 1
    seq_lens: Tensor | None
    # [B + 1] int32 arange (one token per request)
    query_start_loc: Tensor | None
    # [B] int64 arange
    token_req: Tensor | None


def prepare_draft_decode_inputs_ref(
    # [rows, width] int64
    token_ids: Tensor,
    # [rows, max_blocks] int32
    block_table: Tensor,
    # [B] int64 persistent rows
    rows: Tensor,
    # [B] int64 position of the step's input
    positions: Tensor,
    shift: int,
    block_size: int,
    max_model_len: int,
    with_ids: bool = True,
    with_metadata: bool = True,
) -> DraftDecodeInputs:
    out = DraftDecodeInputs(None, None, None, None, None, None, None)
    if with_ids:
        out.input_ids = token_ids[rows, positions + shift]
        out.write_pos = positions + shift + 1
    if with_metadata:
        B = positions.shape[0]
        bt = block_table[rows]
        in_range = positions < max_model_len
        safe = positions.clamp_max(max_model_len - 1)
        blk = bt.gather(1, (safe // block_size)[:, None]).squeeze(1).long()
        out.slot_mapping = torch.where(
            in_range, blk * block_size + safe % block_size, torch.full_like(positions, -1)
        )
        ar = torch.arange(B + 1, device=positions.device)
        out.block_table = bt
        out.seq_lens = (safe + 1).to(torch.int32)
        out.query_start_loc = ar.to(torch.int32)
        out.token_req = ar[:B]
    return out


def prepare_draft_decode_inputs(
    token_ids: Tensor,
    block_table: Tensor,
    rows: Tensor,
    positions: Tensor,
    shift: int,
    block_size: int,
    max_model_len: int,
    with_ids: bool = True,
    with_metadata: bool = True,
) -> DraftDecodeInputs:
    """A draft decode step's input ids and/or attention metadata, in one launch.

    The two halves can be asked for separately because the fused draft loop builds the metadata
    once and advances it in place (`advance_decode_metadata_`), while the ids must be gathered
    every step, after the previous step wrote its draft."""
    impl = prepare_draft_decode_inputs_ref
    if _use_triton(positions):
        from specserve.ops.spec_kernels_triton import prepare_draft_decode_inputs_triton as impl
    return impl(
        token_ids,
        block_table,
        rows,
        positions,
        shift,
        block_size,
        max_model_len,
        with_ids,
        with_metadata,
    )


# ---- in-place decode advance ------------------------------------------------------------------
def advance_decode_metadata_ref_(
    # [T] int64
    positions: Tensor,
    # [R] int32
    seq_lens: Tensor,
    # [T] int64, -1 = padding
    slot_mapping: Tensor,
    # [R, max_blocks] int32
    block_table: Tensor,
    # [T] int64 batch row of each token
    token_req: Tensor,
    block_size: int,
) -> None:
    positions.add_(1)
    seq_lens.add_(1)
    bt = block_table
    # Clamped so a position past the table (past max_model_len) cannot index out of bounds.
    col = (positions // block_size).clamp_max(bt.shape[1] - 1)
    slot = bt[token_req, col].long() * block_size + positions % block_size
    # NOTE: padded rows keep slot -1 so the captured graph still writes no KV for them, and a
    # position past the block table gets -1 too instead of a wrapped slot.
    live = (slot_mapping >= 0) & (positions < bt.shape[1] * block_size)
    slot_mapping.copy_(torch.where(live, slot, torch.full_like(slot, -1)))


def advance_decode_metadata_(
    positions: Tensor,
    seq_lens: Tensor,
    slot_mapping: Tensor,
    block_table: Tensor,
    token_req: Tensor,
    block_size: int,
) -> None:
    """Every request advanced by one decode token, in place: positions and seq_lens + 1, slots
    from the block table (-1 kept for padding, set past the table)."""
    impl = advance_decode_metadata_ref_
    if _use_triton(positions):
        from specserve.ops.spec_kernels_triton import advance_decode_metadata_triton_ as impl
    impl(positions, seq_lens, slot_mapping, block_table, token_req, block_size)
