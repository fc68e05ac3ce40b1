"""Persistent per-request device state, one row per running request, reached via idx_mapping."""

from __future__ import annotations

import numpy as np
import torch

from specserve.request import Request
from specserve.sample.sampler import SamplingTensors


class RequestStates:
    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        null_block: int,
        num_spec_tokens: int,
        device: torch.device,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        # One extra scratch row, never handed out: padded rows of captured graphs point at it,
        # so their (discarded) writes can never land in a real request's state.
        self.num_rows = max_num_seqs + 1
        self.scratch_row = max_num_seqs
        self.device = device
        # [rows, max_model_len + K + 2]: all tokens, then the draft tail; the last column is a
        # scratch column that masked-off writes are sent to.
        self.width = max_model_len + num_spec_tokens + 2
        self.token_ids = torch.zeros(self.num_rows, self.width, dtype=torch.int64, device=device)
        # [rows] tokens whose KV is computed, as of the last launched step (async scheduling
        # reads it to place a step launched before the host knows the accept counts).
        self.num_computed = torch.zeros(self.num_rows, dtype=torch.int64, device=device)
        # [rows] the request's prefix-cache hit: positions below it are read-only (shared).
        self.kv_floor = torch.zeros(self.num_rows, dtype=torch.int64, device=device)
        # Host mirror of the block table; rows that changed are uploaded before the next step.
        self.block_table_cpu = np.full((self.num_rows, max_blocks_per_req), null_block, np.int32)
        self.block_table = torch.from_numpy(self.block_table_cpu.copy()).to(device)
        self._dirty_rows: set[int] = set()
        self._num_blocks_in_row = np.zeros(self.num_rows, np.int64)
        self.null_block = null_block
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        # Per-row sampling parameters: written once when a request joins, on the host (for the
        # step's greedy/top-k/... flags) and on the device (gathered through idx_mapping).
        self.temperature = np.zeros(self.num_rows, np.float32)
        self.top_k = np.zeros(self.num_rows, np.int64)
        self.top_p = np.ones(self.num_rows, np.float32)
        self.min_p = np.zeros(self.num_rows, np.float32)
        self.seed = np.zeros(self.num_rows, np.int64)
        # [rows, 3] float32 (temperature, top_p, min_p); [rows, 2] int64 (top_k, seed)
        self.float_params = torch.zeros(self.num_rows, 3, dtype=torch.float32, device=device)
        self.int_params = torch.zeros(self.num_rows, 2, dtype=torch.int64, device=device)

    def add(self, req: Request) -> None:
        """Give `req` a row and upload its tokens (new or resumed after preemption)."""
        row = self.free_rows.pop()
        req.row = row
        toks = torch.tensor(req.all_token_ids, dtype=torch.int64)
        self.token_ids[row, : len(toks)].copy_(self._pinned(toks), non_blocking=True)
        sp = req.sampling_params
        self.temperature[row] = 0.0 if sp.greedy else sp.temperature
        self.top_k[row] = sp.top_k
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        self.seed[row] = req.seed
        fp = [self.temperature[row], self.top_p[row], self.min_p[row]]
        fp = self._pinned(torch.tensor(fp, dtype=torch.float32))
        self.float_params[row].copy_(fp, non_blocking=True)
        ip = self._pinned(torch.tensor([sp.top_k, req.seed], dtype=torch.int64))
        self.int_params[row].copy_(ip, non_blocking=True)
        self.kv_floor[row].fill_(req.cache_hit_tokens)
        self._num_blocks_in_row[row] = 0
        self.block_table_cpu[row] = self.null_block
        self.sync_blocks(req)

    def remove(self, req: Request) -> None:
        if req.row < 0:
            return
        self.block_table_cpu[req.row] = self.null_block
        self._num_blocks_in_row[req.row] = 0
        self._dirty_rows.add(req.row)
        self.free_rows.append(req.row)
        req.row = -1

    def sync_blocks(self, req: Request) -> None:
        n_old, n_new = self._num_blocks_in_row[req.row], len(req.block_ids)
        if n_new != n_old:
            self.block_table_cpu[req.row, :n_new] = req.block_ids
            self.block_table_cpu[req.row, n_new:] = self.null_block
            self._num_blocks_in_row[req.row] = n_new
            self._dirty_rows.add(req.row)

    def upload_block_table(self) -> None:
        """Copy the rows that changed since the last upload to the device table."""
        if not self._dirty_rows:
            return
        rows = np.fromiter(sorted(self._dirty_rows), np.int64, len(self._dirty_rows))
        self._dirty_rows.clear()
        src = self._pinned(torch.from_numpy(self.block_table_cpu[rows]))
        idx = self._pinned(torch.from_numpy(rows))
        self.block_table.index_copy_(
            0, idx.to(self.device, non_blocking=True), src.to(self.device, non_blocking=True)
        )

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in pinned memory on CUDA. NOTE: a copy from pageable memory makes the host wait
        until the stream has run everything queued so far (the GPU then idles while the host
        launches the rest of the step: ~1 ms every 16 batch-1 decode steps on the H200);
        from pinned memory it is queued like a kernel. The caching host allocator keeps the
        buffer until the copy has run."""
        return t.pin_memory() if self.device.type == "cuda" else t

    def all_greedy(self, rows: np.ndarray) -> bool:
        return bool((self.temperature[rows] == 0).all())

    def sampling_tensors(
        self,
        rows: np.ndarray,
        # [B] device copy of `rows`
        idx_mapping: torch.Tensor,
    ) -> SamplingTensors:
        """The step's sampling parameters: a device gather, flags from the host mirror."""
        fp, ip = self.float_params[idx_mapping], self.int_params[idx_mapping]
        return SamplingTensors(
            temperature=fp[:, 0],
            top_k=ip[:, 0],
            top_p=fp[:, 1],
            min_p=fp[:, 2],
            seeds=ip[:, 1],
            all_greedy=self.all_greedy(rows),
            any_top_k=bool((self.top_k[rows] > 0).any()),
            any_top_p=bool((self.top_p[rows] < 1).any()),
            any_min_p=bool((self.min_p[rows] > 0).any()),
        )
