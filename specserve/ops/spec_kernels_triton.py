"""Triton kernels behind specserve.ops.spec_kernels (CUDA; references in spec_kernels.py).

Every grid depends only on host-side sizes (token and request counts, block-table width), every
output is allocated here with torch.empty or written in place, and nothing reads back to the host,
so each wrapper can run inside a captured CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specserve.ops import pdl
from specserve.ops.jit import jit_any_shape
from specserve.ops.spec_kernels import DraftDecodeInputs
from specserve.tunables import tunables


def _step_pdl(device: torch.device) -> dict[str, bool]:
    """Launch arguments of the step's bookkeeping kernels (every kernel of this file: the
    verified-token write, the next step's and the drafter's input preparation, async
    scheduling's start correction, the draft loop's metadata advance): with
    `tunables().pdl_step_kernels` each lets the next launch at its start and waits for the
    previous before reading anything, so the ~1 us gap a launch waits on its predecessor's
    completion goes (two such gaps a plain batch-1 step in an H100 trace; more in a speculative
    one). Off until timed on a GPU."""
    return pdl.launch_kwargs(device) if tunables().pdl_step_kernels else {"PDL": False}


# Tokens per program of the per-token kernels; block-table columns copied per inner iteration.
_BLOCK = 256
_MAX_BLOCK_COLS = 1024


def _col_blocks(max_blocks: int) -> tuple[int, int]:
    """(BLOCK_COLS, NUM_COL_BLOCKS) to copy a block-table row of `max_blocks` entries."""
    block = min(triton.next_power_of_2(max(max_blocks, 1)), _MAX_BLOCK_COLS)
    return block, triton.cdiv(max_blocks, block)


@triton.jit
def _copy_row(src_ptr, dst_ptr, n, BLOCK_COLS: tl.constexpr, NUM_COL_BLOCKS: tl.constexpr):
    for i in range(NUM_COL_BLOCKS):
        cols = i * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        m = cols < n
        tl.store(dst_ptr + cols, tl.load(src_ptr + cols, mask=m), mask=m)


# ---- async scheduling -------------------------------------------------------------------------
@jit_any_shape
def _place_on_device_kernel(
    num_computed_ptr,
    idx_mapping_ptr,
    start_on_device_ptr,
    query_start_loc_ptr,
    positions_ptr,
    seq_lens_ptr,
    out_pos0_ptr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    # One program per request: its shift, then its own tokens' positions (no other program
    # reads what it writes).
    b = tl.program_id(0)
    if tl.load(start_on_device_ptr + b) > 0:
        row = tl.load(idx_mapping_ptr + b)
        o = tl.load(out_pos0_ptr + b)
        delta = tl.load(num_computed_ptr + row) - (o - 1)
        tl.store(out_pos0_ptr + b, o + delta)
        tl.store(seq_lens_ptr + b, tl.load(seq_lens_ptr + b) + delta)
        t0 = tl.load(query_start_loc_ptr + b)
        t1 = tl.load(query_start_loc_ptr + b + 1)
        for start in range(t0, t1, BLOCK):
            t = start + tl.arange(0, BLOCK)
            m = t < t1
            tl.store(positions_ptr + t, tl.load(positions_ptr + t, mask=m) + delta, mask=m)


def place_on_device_triton_(
    num_computed: Tensor,
    idx_mapping: Tensor,
    start_on_device: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    seq_lens: Tensor,
    out_pos0: Tensor,
) -> None:
    B = idx_mapping.shape[0]
    if B == 0:
        return
    _place_on_device_kernel[(B,)](
        num_computed,
        idx_mapping,
        start_on_device,
        query_start_loc,
        positions,
        seq_lens,
        out_pos0,
        BLOCK=_BLOCK,
        **_step_pdl(num_computed.device),
    )


# ---- target step inputs -----------------------------------------------------------------------
@jit_any_shape
def _prepare_target_inputs_kernel(
    token_ids_ptr,
    block_table_ptr,
    idx_mapping_ptr,
    token_req_ptr,
    positions_ptr,
    out_ids_ptr,
    out_slot_ptr,
    out_bt_ptr,
    seq_lens_ptr,
    out_pos_ptr,
    out_seq_ptr,
    num_tokens,
    max_blocks,
    token_stride,
    bt_stride,
    out_bt_stride,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_COL_BLOCKS: tl.constexpr,
    META: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    # grid = (cdiv(T, BLOCK) + B,): the first programs fill BLOCK tokens each, the last B copy
    # one block-table row each. META: the token programs also copy positions to out_pos, the
    # row programs seq_lens to out_seq (in its dtype): a graph's metadata inputs.
    pid = tl.program_id(0)
    num_token_programs = tl.cdiv(num_tokens, BLOCK)
    if pid < num_token_programs:
        t = pid * BLOCK + tl.arange(0, BLOCK)
        m = t < num_tokens
        req = tl.load(token_req_ptr + t, mask=m, other=0)
        row = tl.load(idx_mapping_ptr + req, mask=m, other=0).to(tl.int64)
        pos = tl.load(positions_ptr + t, mask=m, other=0).to(tl.int64)
        ids = tl.load(token_ids_ptr + row * token_stride + pos, mask=m, other=0)
        blk = tl.load(block_table_ptr + row * bt_stride + pos // KV_BLOCK_SIZE, mask=m, other=0)
        slot = blk.to(tl.int64) * KV_BLOCK_SIZE + pos % KV_BLOCK_SIZE
        tl.store(out_ids_ptr + t, ids, mask=m)
        tl.store(out_slot_ptr + t, slot, mask=m)
        if META:
            tl.store(out_pos_ptr + t, pos, mask=m)
    else:
        b = pid - num_token_programs
        b_row = tl.load(idx_mapping_ptr + b).to(tl.int64)
        if META:
            seq = tl.load(seq_lens_ptr + b)
            tl.store(out_seq_ptr + b, seq.to(out_seq_ptr.dtype.element_ty))
        _copy_row(
            block_table_ptr + b_row * bt_stride,
            out_bt_ptr + b.to(tl.int64) * out_bt_stride,
            max_blocks,
            BLOCK_COLS,
            NUM_COL_BLOCKS,
        )


def prepare_target_inputs_triton(
    token_ids: Tensor,
    block_table: Tensor,
    idx_mapping: Tensor,
    token_req: Tensor,
    positions: Tensor,
    block_size: int,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
    meta: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    T, B = positions.shape[0], idx_mapping.shape[0]
    max_blocks = block_table.shape[1]
    dev = positions.device
    if out is not None:
        input_ids, slot, bt = out
    else:
        input_ids = torch.empty(T, dtype=token_ids.dtype, device=dev)
        slot = torch.empty(T, dtype=torch.int64, device=dev)
        bt = torch.empty(B, max_blocks, dtype=block_table.dtype, device=dev)
    if T + B == 0:
        return input_ids, slot, bt
    cols, n_cols = _col_blocks(max_blocks)
    _prepare_target_inputs_kernel[(triton.cdiv(T, _BLOCK) + B,)](
        token_ids,
        block_table,
        idx_mapping,
        token_req,
        positions,
        input_ids,
        slot,
        bt,
        *(meta if meta is not None else (positions,) * 3),  # unused without META
        T,
        max_blocks,
        token_ids.stride(0),
        block_table.stride(0),
        bt.stride(0),
        KV_BLOCK_SIZE=block_size,
        BLOCK=_BLOCK,
        BLOCK_COLS=cols,
        NUM_COL_BLOCKS=n_cols,
        META=meta is not None,
        **_step_pdl(dev),
    )
    return input_ids, slot, bt


@jit_any_shape
def _write_verified_tokens_kernel(
    token_ids_ptr,
    idx_mapping_ptr,
    out_pos0_ptr,
    out_tokens_ptr,
    num_acc_ptr,
    samples_ptr,
    num_computed_ptr,
    seq_lens_ptr,
    num_draft_ptr,
    token_stride,
    out_stride,
    num_slots,
    BLOCK_K: tl.constexpr,
    HAS_ACC: tl.constexpr,
    HAS_COMPUTED: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    n = tl.load(num_acc_ptr + b) if HAS_ACC else 0
    if HAS_COMPUTED:
        done = tl.load(seq_lens_ptr + b) - tl.load(num_draft_ptr + b) + n
        tl.store(num_computed_ptr + row, done)
    produces = tl.load(samples_ptr + b) > 0
    pos0 = tl.load(out_pos0_ptr + b).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    # Masked-off slots are skipped rather than sent to the scratch column.
    valid = (j < num_slots) & (j <= n) & produces
    tok = tl.load(out_tokens_ptr + b.to(tl.int64) * out_stride + j, mask=valid)
    tl.store(token_ids_ptr + row * token_stride + pos0 + j, tok, mask=valid)


def write_verified_tokens_triton_(
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
    B, k1 = out_tokens.shape
    if B == 0:
        return
    _write_verified_tokens_kernel[(B,)](
        token_ids,
        idx_mapping,
        out_pos0,
        out_tokens,
        num_accepted if num_accepted is not None else samples,
        samples,
        num_computed if num_computed is not None else samples,
        seq_lens if num_computed is not None else samples,
        num_draft if num_computed is not None else samples,
        token_ids.stride(0),
        out_tokens.stride(0),
        k1,
        BLOCK_K=triton.next_power_of_2(k1),
        HAS_ACC=num_accepted is not None,
        HAS_COMPUTED=num_computed is not None,
        **_step_pdl(token_ids.device),
    )


# ---- draft prefill inputs ---------------------------------------------------------------------
@jit_any_shape
def _prepare_draft_prefill_inputs_kernel(
    token_ids_ptr,
    idx_mapping_ptr,
    token_req_ptr,
    positions_ptr,
    qsl_ptr,
    num_draft_ptr,
    num_acc_ptr,
    out_ids_ptr,
    out_last_ptr,
    out_pos1_ptr,
    out_pos2_ptr,
    num_tokens,
    num_reqs,
    token_stride,
    SHIFT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    # grid = (cdiv(T, BLOCK) + cdiv(B, BLOCK),): token programs, then request programs.
    pid = tl.program_id(0)
    num_token_programs = tl.cdiv(num_tokens, BLOCK)
    if pid < num_token_programs:
        t = pid * BLOCK + tl.arange(0, BLOCK)
        m = t < num_tokens
        req = tl.load(token_req_ptr + t, mask=m, other=0)
        row = tl.load(idx_mapping_ptr + req, mask=m, other=0).to(tl.int64)
        pos = tl.load(positions_ptr + t, mask=m, other=0).to(tl.int64)
        ids = tl.load(token_ids_ptr + row * token_stride + pos + SHIFT, mask=m, other=0)
        tl.store(out_ids_ptr + t, ids, mask=m)
    else:
        b = (pid - num_token_programs) * BLOCK + tl.arange(0, BLOCK)
        bm = b < num_reqs
        end = tl.load(qsl_ptr + b + 1, mask=bm, other=1).to(tl.int64)
        nd = tl.load(num_draft_ptr + b, mask=bm, other=0).to(tl.int64)
        na = tl.load(num_acc_ptr + b, mask=bm, other=0).to(tl.int64)
        # Last valid (verified) token of each request: rejected drafts after it are padding.
        last = end - 1 - nd + na
        P = tl.load(positions_ptr + last, mask=bm, other=0).to(tl.int64)
        tl.store(out_last_ptr + b, last, mask=bm)
        tl.store(out_pos1_ptr + b, P + 1, mask=bm)
        tl.store(out_pos2_ptr + b, P + 2, mask=bm)


def prepare_draft_prefill_inputs_triton(
    token_ids: Tensor,
    idx_mapping: Tensor,
    token_req: Tensor,
    positions: Tensor,
    query_start_loc: Tensor,
    num_draft: Tensor,
    num_accepted: Tensor,
    shift: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    T, B = positions.shape[0], idx_mapping.shape[0]
    dev = positions.device
    ids = torch.empty(T, dtype=token_ids.dtype, device=dev)
    last, pos1, pos2 = (torch.empty(B, dtype=torch.int64, device=dev) for _ in range(3))
    if T + B == 0:
        return ids, last, pos1, pos2
    _prepare_draft_prefill_inputs_kernel[(triton.cdiv(T, _BLOCK) + triton.cdiv(B, _BLOCK),)](
        token_ids,
        idx_mapping,
        token_req,
        positions,
        query_start_loc,
        num_draft,
        num_accepted,
        ids,
        last,
        pos1,
        pos2,
        T,
        B,
        token_ids.stride(0),
        SHIFT=shift,
        BLOCK=_BLOCK,
        **_step_pdl(token_ids.device),
    )
    return ids, last, pos1, pos2


# ---- draft decode inputs ----------------------------------------------------------------------
@jit_any_shape
def _prepare_draft_decode_inputs_kernel(
    token_ids_ptr,
    block_table_ptr,
    rows_ptr,
    positions_ptr,
    out_ids_ptr,
    out_write_pos_ptr,
    out_bt_ptr,
    out_slot_ptr,
    out_seq_lens_ptr,
    out_qsl_ptr,
    out_token_req_ptr,
    max_model_len,
    max_blocks,
    token_stride,
    bt_stride,
    out_bt_stride,
    SHIFT: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    WITH_IDS: tl.constexpr,
    WITH_METADATA: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_COL_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    # grid = (B,): one request per program.
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    pos = tl.load(positions_ptr + b).to(tl.int64)
    if WITH_IDS:
        tl.store(out_ids_ptr + b, tl.load(token_ids_ptr + row * token_stride + pos + SHIFT))
        tl.store(out_write_pos_ptr + b, pos + SHIFT + 1)
    if WITH_METADATA:
        bt_row = block_table_ptr + row * bt_stride
        safe = tl.minimum(pos, max_model_len - 1)
        blk = tl.load(bt_row + safe // KV_BLOCK_SIZE).to(tl.int64)
        # NOTE: drafts never write KV past max_model_len: such positions get the null slot.
        slot = tl.where(pos < max_model_len, blk * KV_BLOCK_SIZE + safe % KV_BLOCK_SIZE, -1)
        tl.store(out_slot_ptr + b, slot)
        tl.store(out_seq_lens_ptr + b, (safe + 1).to(tl.int32))
        tl.store(out_token_req_ptr + b, b.to(tl.int64))
        tl.store(out_qsl_ptr + b + 1, b + 1)
        tl.store(out_qsl_ptr + b, 0, mask=b == 0)
        dst = out_bt_ptr + b.to(tl.int64) * out_bt_stride
        _copy_row(bt_row, dst, max_blocks, BLOCK_COLS, NUM_COL_BLOCKS)


def prepare_draft_decode_inputs_triton(
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
    B = positions.shape[0]
    max_blocks = block_table.shape[1]
    dev = positions.device
    out = DraftDecodeInputs(None, None, None, None, None, None, None)
    if with_ids:
        out.input_ids = torch.empty(B, dtype=token_ids.dtype, device=dev)
        out.write_pos = torch.empty(B, dtype=torch.int64, device=dev)
    if with_metadata:
        out.block_table = torch.empty(B, max_blocks, dtype=block_table.dtype, device=dev)
        out.slot_mapping = torch.empty(B, dtype=torch.int64, device=dev)
        out.seq_lens = torch.empty(B, dtype=torch.int32, device=dev)
        out.query_start_loc = torch.empty(B + 1, dtype=torch.int32, device=dev)
        out.token_req = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0 or not (with_ids or with_metadata):
        if out.query_start_loc is not None:
            out.query_start_loc.zero_()
        return out
    # Outputs not asked for are never touched: pass any tensor in their place.
    dummy = positions
    cols, n_cols = _col_blocks(max_blocks)
    _prepare_draft_decode_inputs_kernel[(B,)](
        token_ids,
        block_table,
        rows,
        positions,
        out.input_ids if with_ids else dummy,
        out.write_pos if with_ids else dummy,
        out.block_table if with_metadata else dummy,
        out.slot_mapping if with_metadata else dummy,
        out.seq_lens if with_metadata else dummy,
        out.query_start_loc if with_metadata else dummy,
        out.token_req if with_metadata else dummy,
        max_model_len,
        max_blocks,
        token_ids.stride(0),
        block_table.stride(0),
        out.block_table.stride(0) if with_metadata else 0,
        SHIFT=shift,
        KV_BLOCK_SIZE=block_size,
        WITH_IDS=with_ids,
        WITH_METADATA=with_metadata,
        BLOCK_COLS=cols,
        NUM_COL_BLOCKS=n_cols,
        **_step_pdl(token_ids.device),
    )
    return out


# ---- in-place decode advance ------------------------------------------------------------------
@jit_any_shape
def _advance_decode_metadata_kernel(
    positions_ptr,
    seq_lens_ptr,
    slot_ptr,
    block_table_ptr,
    token_req_ptr,
    num_tokens,
    num_reqs,
    max_blocks,
    bt_stride,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    # grid = (cdiv(max(T, R), BLOCK),): element i is token i and request i.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mr = i < num_reqs
    seq = tl.load(seq_lens_ptr + i, mask=mr, other=0)
    tl.store(seq_lens_ptr + i, seq + 1, mask=mr)
    mt = i < num_tokens
    pos = tl.load(positions_ptr + i, mask=mt, other=0) + 1
    tl.store(positions_ptr + i, pos, mask=mt)
    old = tl.load(slot_ptr + i, mask=mt, other=-1)
    req = tl.load(token_req_ptr + i, mask=mt, other=0).to(tl.int64)
    pos64 = pos.to(tl.int64)
    # Clamped so a position past the table (past max_model_len) cannot index out of bounds.
    col = tl.minimum(pos64 // KV_BLOCK_SIZE, max_blocks - 1)
    blk = tl.load(block_table_ptr + req * bt_stride + col, mask=mt, other=0).to(tl.int64)
    # NOTE: padded rows keep slot -1 so the captured graph still writes no KV for them, and a
    # position past the block table gets -1 too instead of a wrapped slot.
    live = (old >= 0) & (pos64 < max_blocks * KV_BLOCK_SIZE)
    slot = tl.where(live, blk * KV_BLOCK_SIZE + pos64 % KV_BLOCK_SIZE, -1)
    tl.store(slot_ptr + i, slot, mask=mt)


def advance_decode_metadata_triton_(
    positions: Tensor,
    seq_lens: Tensor,
    slot_mapping: Tensor,
    block_table: Tensor,
    token_req: Tensor,
    block_size: int,
) -> None:
    T, R = positions.shape[0], seq_lens.shape[0]
    if max(T, R) == 0:
        return
    _advance_decode_metadata_kernel[(triton.cdiv(max(T, R), _BLOCK),)](
        positions,
        seq_lens,
        slot_mapping,
        block_table,
        token_req,
        T,
        R,
        block_table.shape[1],
        block_table.stride(0),
        KV_BLOCK_SIZE=block_size,
        BLOCK=_BLOCK,
        **_step_pdl(positions.device),
    )
