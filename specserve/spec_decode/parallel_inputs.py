"""PTD input preparation: the enlarged drafter batch, its Triton kernel and torch reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl

    from specserve.ops.jit import jit_any_shape
except ImportError:  # CPU-only installs without triton use the torch reference
    triton = None


@dataclass
class ParallelDraftInputs:
    """The drafter's enlarged batch: N = num_tokens + num_reqs * E slots."""

    # [N] int64
    positions: torch.Tensor
    # [N] int64
    input_ids: torch.Tensor
    # [N] int64: row of the fused hidden input; num_tokens (one past the target's) = mask_hidden
    hidden_src: torch.Tensor
    # [N] int64, -1 = no KV write (rejected padding, past max_model_len, mid-prompt chunk)
    slot_mapping: torch.Tensor
    # [N] int64 batch row of each slot
    token_req: torch.Tensor
    # [B + 1] int64: query_start_loc + arange(B + 1) * E
    query_start_loc: torch.Tensor
    # [B] int64, capped at max_model_len
    seq_lens: torch.Tensor
    # [B, K] int64: slot whose output predicts draft j
    draft_index: torch.Tensor
    # [B, K] int64: token-buffer column draft j is written to (the scratch column if invalid)
    draft_col: torch.Tensor


def expand_regions(
    # [B + 1] int64
    query_start_loc: torch.Tensor,
    extra: int,
    num_slots: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's region grown by `extra` slots -> (batch row [N], offset in region [N])."""
    B = query_start_loc.shape[0] - 1
    ar = torch.arange(B, device=query_start_loc.device)
    sizes = query_start_loc[1:] - query_start_loc[:-1] + extra
    req = torch.repeat_interleave(ar, sizes, output_size=num_slots)
    first = query_start_loc[:-1] + ar * extra
    return req, torch.arange(num_slots, device=req.device) - first[req]


def prepare_parallel_inputs_ref(
    # [B + 1] int64
    query_start_loc: torch.Tensor,
    # [T] int64 target positions
    positions: torch.Tensor,
    # [B] int64 persistent-state row of each batch row
    idx_mapping: torch.Tensor,
    # [B] int64 each, samples: 1 where the step produces a token
    num_draft: torch.Tensor,
    num_accepted: torch.Tensor,
    samples: torch.Tensor,
    # [B] int64 target seq_lens
    seq_lens: torch.Tensor,
    # [rows, width] int64 persistent token buffer (last column = scratch)
    token_ids: torch.Tensor,
    # [rows, max_blocks] int32
    block_table: torch.Tensor,
    k: int,
    shift: int,
    mask_token_id: int,
    max_model_len: int,
    block_size: int,
) -> ParallelDraftInputs:
    """Torch reference of `prepare_parallel_inputs` (vectorized, any device)."""
    B, T = idx_mapping.shape[0], positions.shape[0]
    E = k - shift
    qsl = query_start_loc.long()
    n_req = qsl[1:] - qsl[:-1]
    # Offset of the last verified slot: rejected drafts after it are padding.
    v = n_req - 1 - num_draft + num_accepted
    P = positions[qsl[:-1] + v]
    first = qsl[:-1] + torch.arange(B, device=qsl.device) * E

    # ---- per slot -----------------------------------------------------------------------
    req, offs = expand_regions(qsl, E, T + B * E)
    row, n_sched = idx_mapping[req], n_req[req]
    is_sched = offs < n_sched
    j = offs - n_sched  # extra slot index
    src = qsl[:-1][req] + offs.clamp(max=n_sched - 1)
    pos = torch.where(is_sched, positions[src], P[req] + 1 + j)
    is_mask = ~is_sched & (j >= 1 - shift)
    tok_col = (pos + shift).clamp(max=token_ids.shape[1] - 1)
    ids = torch.where(is_mask, mask_token_id, token_ids[row, tok_col])
    writes = torch.where(is_sched, offs <= v[req], samples[req] > 0) & (pos < max_model_len)
    safe = pos.clamp(max=max_model_len - 1)
    blk = block_table[row, safe // block_size].long()

    # ---- per request: draft jj comes from the slot at position P + 1 - shift + jj ---------
    jj = torch.arange(k, device=positions.device)[None, :]
    idx = first[:, None] + n_req[:, None] + jj - shift
    if shift == 1:
        idx = torch.where(jj == 0, (first + v)[:, None], idx)
    ok = (P[:, None] + 1 - shift + jj < max_model_len) & (samples[:, None] > 0)
    return ParallelDraftInputs(
        positions=pos,
        input_ids=ids,
        hidden_src=torch.where(is_sched, src, T),
        slot_mapping=torch.where(writes, blk * block_size + safe % block_size, -1),
        token_req=req,
        query_start_loc=qsl + torch.arange(B + 1, device=qsl.device) * E,
        seq_lens=(seq_lens + E).clamp(max=max_model_len),
        draft_index=idx,
        draft_col=torch.where(ok, P[:, None] + 2 + jj, token_ids.shape[1] - 1),
    )


if triton is not None:

    @jit_any_shape
    def _prepare_parallel_inputs_kernel(
        qsl_ptr,
        positions_ptr,
        idx_mapping_ptr,
        num_draft_ptr,
        num_acc_ptr,
        samples_ptr,
        seq_lens_ptr,
        token_ids_ptr,
        block_table_ptr,
        out_pos_ptr,
        out_ids_ptr,
        out_hidden_src_ptr,
        out_slot_ptr,
        out_req_ptr,
        out_qsl_ptr,
        out_seq_lens_ptr,
        draft_index_ptr,
        draft_col_ptr,
        num_tokens,
        mask_token_id,
        max_model_len,
        token_stride,
        token_width,
        bt_stride,
        K: tl.constexpr,
        SHIFT: tl.constexpr,
        KV_BLOCK_SIZE: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # grid = (num_reqs, cdiv(max_query_len + E, BLOCK)): program (r, c) fills slots
        # [c * BLOCK, (c + 1) * BLOCK) of request r's region; chunk 0 also writes r's per-request
        # outputs. Chunks past the region store nothing (all masks false).
        r = tl.program_id(0)
        c = tl.program_id(1)
        E: tl.constexpr = K - SHIFT
        q0 = tl.load(qsl_ptr + r)
        n_sched = tl.load(qsl_ptr + r + 1) - q0
        row = tl.load(idx_mapping_ptr + r)
        smp = tl.load(samples_ptr + r)
        v = n_sched - 1 - tl.load(num_draft_ptr + r) + tl.load(num_acc_ptr + r)
        P = tl.load(positions_ptr + q0 + v)
        first = q0 + r * E

        offs = c * BLOCK + tl.arange(0, BLOCK)
        in_region = offs < n_sched + E
        is_sched = offs < n_sched
        j = offs - n_sched
        src = q0 + tl.minimum(offs, n_sched - 1)
        pos_sched = tl.load(positions_ptr + src, mask=in_region & is_sched, other=0)
        pos = tl.where(is_sched, pos_sched, P + 1 + j)
        if SHIFT == 1:
            is_mask = ~is_sched
        else:
            is_mask = ~is_sched & (j >= 1)
        tok_col = tl.minimum(pos + SHIFT, token_width - 1)
        tok = tl.load(
            token_ids_ptr + row * token_stride + tok_col, mask=in_region & ~is_mask, other=0
        )
        ids = tl.where(is_mask, mask_token_id, tok)
        hidden_src = tl.where(is_sched, src, num_tokens)
        writes = tl.where(is_sched, offs <= v, smp > 0) & (pos < max_model_len)
        safe = tl.minimum(pos, max_model_len - 1)
        blk = tl.load(
            block_table_ptr + row * bt_stride + safe // KV_BLOCK_SIZE, mask=in_region, other=0
        )
        slot = tl.where(writes, blk.to(tl.int64) * KV_BLOCK_SIZE + safe % KV_BLOCK_SIZE, -1)
        out = first + offs
        tl.store(out_pos_ptr + out, pos, mask=in_region)
        tl.store(out_ids_ptr + out, ids, mask=in_region)
        tl.store(out_hidden_src_ptr + out, hidden_src, mask=in_region)
        tl.store(out_slot_ptr + out, slot, mask=in_region)
        tl.store(out_req_ptr + out, tl.zeros([BLOCK], dtype=tl.int64) + r, mask=in_region)

        # Per-request outputs, from chunk 0 only.
        jj = tl.arange(0, BLOCK_K)
        kmask = (jj < K) & (c == 0)
        if SHIFT == 1:
            idx = tl.where(jj == 0, first + v, first + n_sched + jj - 1)
        else:
            idx = first + n_sched + jj
        ok = (P + 1 - SHIFT + jj < max_model_len) & (smp > 0)
        col = tl.where(ok, P + 2 + jj, token_width - 1)
        tl.store(draft_index_ptr + r * K + jj, idx, mask=kmask)
        tl.store(draft_col_ptr + r * K + jj, col, mask=kmask)
        seq = tl.minimum(tl.load(seq_lens_ptr + r) + E, max_model_len)
        tl.store(out_seq_lens_ptr + r, seq, mask=c == 0)
        tl.store(out_qsl_ptr + r + 1, q0 + n_sched + (r + 1) * E, mask=c == 0)
        tl.store(out_qsl_ptr, 0, mask=(c == 0) & (r == 0))


class ParallelDraftBuffers:
    """Persistent outputs of the preparation kernel, sized for the largest enlarged batch."""

    def __init__(self, max_slots: int, max_reqs: int, k: int, device: torch.device) -> None:
        def i64(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.positions, self.input_ids, self.hidden_src = (
            i64(max_slots),
            i64(max_slots),
            i64(max_slots),
        )
        self.slot_mapping, self.token_req = i64(max_slots), i64(max_slots)
        self.query_start_loc, self.seq_lens = i64(max_reqs + 1), i64(max_reqs)
        self.draft_index, self.draft_col = i64(max_reqs, k), i64(max_reqs, k)

    def view(self, num_slots: int, num_reqs: int) -> ParallelDraftInputs:
        n, b = num_slots, num_reqs
        return ParallelDraftInputs(
            positions=self.positions[:n],
            input_ids=self.input_ids[:n],
            hidden_src=self.hidden_src[:n],
            slot_mapping=self.slot_mapping[:n],
            token_req=self.token_req[:n],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            draft_index=self.draft_index[:b],
            draft_col=self.draft_col[:b],
        )


def prepare_parallel_inputs(
    bufs: ParallelDraftBuffers,
    # [B + 1] int64
    query_start_loc: torch.Tensor,
    # [T] int64
    positions: torch.Tensor,
    # [B] int64 each
    idx_mapping: torch.Tensor,
    num_draft: torch.Tensor,
    num_accepted: torch.Tensor,
    samples: torch.Tensor,
    seq_lens: torch.Tensor,
    # [rows, width] int64
    token_ids: torch.Tensor,
    # [rows, max_blocks] int32
    block_table: torch.Tensor,
    k: int,
    shift: int,
    mask_token_id: int,
    max_model_len: int,
    block_size: int,
    max_query_len: int,
    block: int = 128,
) -> ParallelDraftInputs:
    """One launch fills `bufs` (see `prepare_parallel_inputs_ref` for the semantics);
    `max_query_len` is the host-side bound of the target's query lengths."""
    B, T = idx_mapping.shape[0], positions.shape[0]
    E = k - shift
    # NOTE: a view past the buffers' end would silently be shorter and the kernel would write
    # out of bounds: check on the host (free) before launching.
    if T + B * E > bufs.positions.shape[0] or B > bufs.seq_lens.shape[0]:
        raise ValueError(
            f"PTD buffers hold {bufs.positions.shape[0]} slots / {bufs.seq_lens.shape[0]} "
            f"requests; this batch needs {T + B * E} / {B}"
        )
    out = bufs.view(T + B * E, B)
    grid = (B, triton.cdiv(max_query_len + E, block))
    _prepare_parallel_inputs_kernel[grid](
        query_start_loc,
        positions,
        idx_mapping,
        num_draft,
        num_accepted,
        samples,
        seq_lens,
        token_ids,
        block_table,
        out.positions,
        out.input_ids,
        out.hidden_src,
        out.slot_mapping,
        out.token_req,
        out.query_start_loc,
        out.seq_lens,
        out.draft_index,
        out.draft_col,
        T,
        mask_token_id,
        max_model_len,
        token_ids.stride(0),
        token_ids.shape[1],
        block_table.stride(0),
        K=k,
        SHIFT=shift,
        KV_BLOCK_SIZE=block_size,
        BLOCK=block,
        BLOCK_K=triton.next_power_of_2(k),
    )
    return out
