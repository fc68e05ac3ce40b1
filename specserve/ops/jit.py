"""`jit_any_shape`: triton.jit for the small per-step kernels (input preparation, verification,
sampling bookkeeping) that must compile once, at start-up, whatever the batch.

Triton compiles a kernel per specialization of its runtime arguments: an integer equal to 1 or
divisible by 16, a pointer 16-byte aligned or not. The per-step kernels take the batch size, the
token count and views at offsets of one upload buffer, so a batch shape first seen while serving
compiled a new variant on the serving path (a one-time inter-token stall). These kernels move a
few hundred bytes: one variant for every shape costs nothing measurable, and the warm-up
(worker/warmup.py) then covers them all.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

try:
    import triton
except ImportError:  # CPU-only installs: `launcher` is only reached on CUDA
    triton = None


def jit_any_shape(fn: Callable[..., Any]) -> Any:
    """triton.jit(fn) with no value or alignment specialization of any runtime argument."""
    names = [
        name
        for name, p in inspect.signature(fn).parameters.items()
        if "constexpr" not in str(p.annotation)
    ]
    return triton.jit(do_not_specialize=names, do_not_specialize_on_alignment=names)(fn)


# Set (per thread) while decode_matmul=auto compiles its candidates ahead of timing them.
_COMPILE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("compile_only", default=False)


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """Kernels launched through `launcher` in this block (this thread) compile, never run: the
    plan compiles in threads while it times on the GPU, and a compile must not put kernels on
    the device between a timed graph's events."""
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


def launcher(kernel: Any, grid: tuple[int, ...]) -> Callable[..., Any]:
    """kernel[grid], or inside `compile_only` its compile alone (Triton's warmup)."""
    return functools.partial(kernel.warmup, grid=grid) if _COMPILE_ONLY.get() else kernel[grid]
