"""Block keys of automatic prefix caching: a chained hash per full block.

A block's key says everything its KV depends on, so two blocks with the same key hold the same
KV in every layer, the drafter's included:

    key_b = sha256(key_{b-1} + tokens of block b + the `lookahead` tokens after it)
    key_-1 = sha256(the engine's salt: target, drafter, KV dtype, block size)

`lookahead` is the drafter's (`Speculator.kv_lookahead`): how many tokens after position p its
KV at p reads. An EAGLE-style drafter's KV at p is computed from the target's hidden state at p
and the token at p + 1, so the last position of a block is only valid when the token after the
block matches; the key includes that token, and a hit reuses target and drafter KV exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from specserve.request import Request


def root_key(*salt: object) -> bytes:
    """The chain's root: whatever changes the KV of every block (model, drafter, dtype)."""
    return hashlib.sha256(repr(salt).encode()).digest()


def block_key(parent: bytes, tokens: Sequence[int], lookahead: Sequence[int]) -> bytes:
    """The key of one full block (`tokens`: block_size ids) and the tokens that follow it."""
    h = hashlib.sha256(parent)
    # Fixed lengths (block_size, then lookahead), so the concatenation is unambiguous.
    h.update(np.asarray(tokens, np.int64).tobytes())
    h.update(np.asarray(lookahead, np.int64).tobytes())
    return h.digest()


def request_tokens(req: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of the request's prompt + output, without concatenating the two."""
    p = req.prompt_token_ids
    if end <= len(p):
        return p[start:end]
    o = req.output_token_ids
    if start >= len(p):
        return o[start - len(p) : end - len(p)]
    return p[start:] + o[: end - len(p)]


def extend_block_keys(
    req: Request, root: bytes, block_size: int, lookahead: int, num_blocks: int
) -> list[bytes]:
    """The request's keys of blocks 0 .. num_blocks - 1 (computed once, kept on the request:
    its tokens only ever grow). Only blocks whose tokens and lookahead the request holds."""
    keys = req.block_hashes
    n = min(num_blocks, (req.num_tokens - lookahead) // block_size)
    while len(keys) < n:
        b = len(keys)
        end = (b + 1) * block_size
        keys.append(
            block_key(
                keys[-1] if keys else root,
                request_tokens(req, end - block_size, end),
                request_tokens(req, end, end + lookahead),
            )
        )
    return keys[:n] if len(keys) > n else keys
