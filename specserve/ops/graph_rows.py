"""Rows as a captured CUDA graph runs them: the bound that host-side kernel choices read.

A uniform decode batch (B requests x q tokens) replays the graph of the smallest capture size
bg >= B (worker/cudagraph.py), so the graph's kernels were chosen for bg x q rows while the same
step run eagerly has B x q. Choices made from the row count itself (the decode matmul's plan
bucket and skinny row tile, the MoE decode/GEMM switch and tile config, the fused router's
switch) then differ whenever q is not a power of two (at q = 3 a batch of 5 has 15 rows, its
graph of 8 has 24: buckets 16 and 32), and the two round differently in 16-bit.

So choices read a bound the two share (also the attention split counts and MLA's fused
path, attention/triton_paged.py and mla_*.py, and every drafter forward).
The runner declares the forward's batch with `uniform_batch(num_reqs, padded_reqs)`: eagerly
(B, the capture size a graph engine would pad B to; also around eager drafting of that batch),
in the graph capture and the draft graphs' bodies (bg, bg);
`row_bound(rows)` is then ceil(rows / num_reqs) x padded_reqs: for a tensor of q rows per
request, bg x q either way, exactly the rows the captured graph ran (and row_bound(num_reqs)
is bg: the padded request count). Outside `uniform_batch`
(prefill, mixed batches, training, tests) rows are rows.

NOTE: a context variable, not an argument, because nn.Linear.forward(x) has no room for one;
it is set only around one forward and reset after it (also on error).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# (num_reqs, padded_reqs) of the uniform batch whose forward is running, or None.
_UNIFORM: ContextVar[tuple[int, int] | None] = ContextVar("uniform_batch", default=None)


@contextmanager
def uniform_batch(num_reqs: int, padded_reqs: int) -> Iterator[None]:
    """Within this block, `row_bound` counts rows as a graph of `padded_reqs` requests runs
    them, for a forward over `num_reqs` requests with the same rows each."""
    if not 1 <= num_reqs <= padded_reqs:
        raise ValueError(
            f"uniform_batch needs 1 <= num_reqs <= padded_reqs, got {num_reqs}, {padded_reqs}"
        )
    token = _UNIFORM.set((num_reqs, padded_reqs))
    try:
        yield
    finally:
        _UNIFORM.reset(token)


def row_bound(rows: int) -> int:
    """`rows` (>= 0) as kernel choices should see them: ceil(rows / num_reqs) x padded_reqs
    inside `uniform_batch`, else `rows`. Always >= rows; for a batch of B requests and its
    graph of bg >= B, both with q rows per request, bg x q."""
    batch = _UNIFORM.get()
    if batch is None:
        return rows
    num_reqs, padded = batch
    return -(-rows // num_reqs) * padded
