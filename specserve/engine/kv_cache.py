"""Paged KV cache bookkeeping: a pool of fixed-size blocks and per-request block lists."""

from __future__ import annotations

from collections import deque

from specserve.request import Request


class BlockPool:
    """Free list of KV blocks. Block `num_blocks` (the last one) is the null block: padded
    tokens write there and unused block-table entries point there, so it is never handed out."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.null_block = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.max_blocks_per_req = (max_model_len + block_size - 1) // block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return min((num_tokens + self.block_size - 1) // self.block_size, self.max_blocks_per_req)

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Make `req` hold blocks for its first `num_tokens` positions. False if the pool is dry."""
        need = self.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        req.block_ids.extend(new)
        return True

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []

    def usage(self) -> float:
        return self.pool.usage()
