"""Paged KV cache bookkeeping: a pool of fixed-size blocks, per-request block lists, and
automatic prefix caching (shared, reference-counted full blocks found by their chained key).

A block is in one of three states:
  in use        held by one or more requests (ref_count > 0); never handed out
  cached-free   ref_count 0 but registered under its key: a later request may take it again
                (a hit); evicted least recently freed first when the pool runs dry
  free          ref_count 0, no key
"""

from __future__ import annotations

from collections import OrderedDict, deque

from specserve.engine.prefix_cache import extend_block_keys, root_key
from specserve.request import Request


class BlockPool:
    """KV blocks with reference counts. Block `num_blocks` (the last one) is the null block:
    padded tokens write there and unused block-table entries point there, so it is never
    handed out."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.null_block = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Cached-free blocks in eviction order (oldest first).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.ref_count = [0] * num_blocks
        self.block_key: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks a request may be given: free and cached-free ones."""
        return len(self._free) + len(self._evictable)

    def allocate(self, n: int) -> list[int] | None:
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:  # evict the least recently freed cached block
                b, _ = self._evictable.popitem(last=False)
                del self.cached[self.block_key[b]]  # type: ignore[index]
                self.block_key[b] = None
            self.ref_count[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for b in blocks:
            if self.ref_count[b] == 0:
                del self._evictable[b]
            self.ref_count[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference on each block; the last one makes it free or cached-free."""
        # NOTE: in reverse, so a request's tail blocks (the least likely to be shared) are
        # evicted before its head, as vLLM does.
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b] > 0:
                continue
            if self.block_key[b] is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def publish(self, block: int, key: bytes) -> bool:
        """Register an in-use block under `key`; False if another block holds that key already
        (the block stays private and is simply freed later)."""
        if key in self.cached or self.block_key[block] is not None:
            return False
        self.cached[key] = block
        self.block_key[block] = key
        return True

    def usage(self) -> float:
        """Blocks in use over all blocks: a shared block counts once, cached-free ones not."""
        return 1.0 - self.num_free / self.num_blocks

    def check_no_leaks(self) -> None:
        """With no request holding blocks: every reference count is zero and every block is free
        or cached-free exactly once. Raises AssertionError naming what is wrong (tests)."""
        held = [b for b, r in enumerate(self.ref_count) if r != 0]
        assert not held, f"blocks still referenced: {held[:16]} (ref counts {self.ref_count})"
        seen = list(self._free) + list(self._evictable)
        assert sorted(seen) == list(range(self.num_blocks)), "free lists lost or duplicated blocks"
        for b in self._evictable:
            key = self.block_key[b]
            assert key is not None and self.cached.get(key) == b, f"cached block {b} unindexed"
        assert all(self.block_key[b] is None for b in self._free), "a free block kept its key"
        assert len(self.cached) == len(self._evictable), "the key index holds unfreed blocks"


class KVCacheManager:
    """Blocks per request, and the prefix cache.

    `lookahead` (the drafter's `kv_lookahead`): tokens after position p that the drafter's KV
    at p reads. Block b (positions [bB, (b + 1)B)) is registered once every KV it holds is
    final, target and drafter: its key's tokens are known and computed positions reach
    (b + 1)B + max(lookahead - 1, 0) (see `cache_blocks`). A lookup takes the longest chain of
    registered blocks that leaves the prompt's last token (and the lookahead) to compute."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = False,
        lookahead: int = 0,
        salt: tuple[object, ...] = (),
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.max_blocks_per_req = (max_model_len + block_size - 1) // block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.lookahead = lookahead
        self.root = root_key(block_size, lookahead, *salt)
        # vLLM's prefix-cache counters, in tokens: looked up (a request's tokens when it is
        # admitted) and found.
        self.num_queries = 0
        self.num_hits = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return min((num_tokens + self.block_size - 1) // self.block_size, self.max_blocks_per_req)

    # ---- prefix cache ------------------------------------------------------------------
    def lookup(self, req: Request) -> list[int]:
        """The cached blocks that start `req` (no reference taken). Requests asking for prompt
        logprobs compute every prompt token (vLLM skips the cache for them too)."""
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return []
        # Leave the last token (its logits are needed) and the lookahead tokens to compute.
        n = (req.num_tokens - max(self.lookahead, 1)) // self.block_size
        hit = []
        for key in extend_block_keys(req, self.root, self.block_size, self.lookahead, n):
            b = self.pool.cached.get(key)
            if b is None:
                break
            hit.append(b)
        return hit

    def cache_blocks(self, req: Request) -> None:
        """Register the request's blocks whose KV became final: target KV computed for all
        their positions, drafter KV computed from their final inputs (`lookahead` tokens past
        the block, and no position a later step rewrites), and the key's tokens known.
        Called after the step's tokens are appended (`num_computed_tokens` exact)."""
        if not self.enable_prefix_caching:
            return
        B, L = self.block_size, self.lookahead
        # Tokens past the host's (drafts accepted after a stop) were computed but not kept.
        done = min(req.num_computed_tokens, req.num_tokens - 1) - max(L - 1, 0)
        n = min(done // B, len(req.block_ids))
        if n <= req.num_cached_blocks:
            return
        keys = extend_block_keys(req, self.root, B, L, n)
        for b in range(req.num_cached_blocks, len(keys)):
            self.pool.publish(req.block_ids[b], keys[b])
        req.num_cached_blocks = max(req.num_cached_blocks, len(keys))

    # ---- allocation --------------------------------------------------------------------
    def allocate(self, req: Request, num_tokens: int, cached: list[int] | None = None) -> bool:
        """Make `req` hold blocks for its first `num_tokens` positions, starting with `cached`
        (a lookup's hit, for a request holding no blocks). False if the pool is dry; then
        nothing changed."""
        if cached:
            assert not req.block_ids
            need = self.blocks_needed(num_tokens) - len(cached)
            # Taking a cached-free block removes it from the free blocks.
            taken = sum(1 for b in cached if self.pool.ref_count[b] == 0)
            if need > self.pool.num_free - taken:
                return False
            self.pool.touch(cached)
            req.block_ids = list(cached)
            req.num_cached_blocks = len(cached)
        need = self.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        req.block_ids.extend(new)
        return True

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.num_queries += num_tokens
            self.num_hits += num_hit_tokens

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0

    def usage(self) -> float:
        return self.pool.usage()

    def check_no_leaks(self) -> None:
        """Every block free or cached-free, every reference count zero (tests' teardown)."""
        self.pool.check_no_leaks()
