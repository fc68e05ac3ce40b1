"""Compiling decode_matmul=auto's Triton candidates while the plan times the ones compiled.

A cold start compiles every candidate: one after another before timing each, Llama-3-8B's
planning took 87 s on an H100 host. Here a thread pool compiles them (Triton's warmup: compile,
no launch, so nothing lands on the GPU between a timed graph's events) in the order the plan
times them, and the plan times each (shape, rows) as soon as its candidates are compiled.
Llama-3-8B on H100 hosts (benchmarks/RESULTS.md): 21.0-26.3 s (compiling first, then timing:
24.7 s; worker processes instead of threads compiled no faster: 16.5 vs 16.6 s for the same
162 compiles, CPU-bound either way).

One compile serves every weight shape with the same specialization (`job`): a launch
specializes on its constexprs and on whether each integer argument is 1 or a multiple of 16,
not on the shape itself.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from specserve.ops import skinny
from specserve.ops.gemv import DecodeLinear, PlanConfig
from specserve.ops.jit import compile_only

logger = logging.getLogger("specserve")


class Job(NamedTuple):
    """What a candidate's launch compiles to."""

    dtype: torch.dtype
    bias: bool
    norm_fed: bool
    rows: int
    silu_mul: bool
    cfg: PlanConfig  # a skinny config's split_k: 1, or 2 for any count above one (`job`)
    n_div16: bool  # N a multiple of 16
    k_div16: bool
    early_trigger: bool = False  # a gemv's DecodeLinear.early_trigger (a constexpr of it)


def job(layer: DecodeLinear, rows: int, silu_mul: bool, cfg: PlanConfig) -> Job:
    """The compiled kernel candidate `cfg` launches for `rows` rows over `layer`'s weight."""
    n, k = layer.weight.shape
    n = n // 2 if silu_mul else n
    if isinstance(cfg, skinny.SkinnyConfig):
        sms = skinny.num_sms(layer.weight.device) if layer.weight.is_cuda else 132
        one_split = skinny.resolve_split(cfg, n, k, sms)[0] == 1
        # The split count and K range are launch arguments (specialized only as 1 or not):
        # every count above one runs the same compiled kernel, compiled once at 2.
        cfg = cfg._replace(split_k=1 if one_split else 2)
    dtype, bias = layer.weight.dtype, layer.bias is not None
    early = layer.early_trigger and not isinstance(cfg, skinny.SkinnyConfig)
    return Job(dtype, bias, layer.norm_fed, rows, silu_mul, cfg, n % 16 == 0, k % 16 == 0, early)


class Compiles:
    """Compiles `jobs` (each with a model layer it compiles for) in a thread pool, in the given
    order; `wait` blocks until the given ones are done."""

    def __init__(self, jobs: dict[Job, DecodeLinear], device: torch.device) -> None:
        self.t0 = time.perf_counter()
        self.futures: dict[Job, Future] = {}
        if not jobs:
            return
        from specserve.ops.gemv_plan import _candidate

        def compile_one(run: Callable[[], None]) -> None:
            torch.cuda.set_device(device)
            with torch.inference_mode(), compile_only():
                run()

        # The inputs are made here, before any timing: a thread drawing random numbers while
        # the timing captures a graph breaks the capture (the generator's offset is captured).
        with torch.inference_mode():
            runs = {j: _candidate([layer], j.rows, j.silu_mul, j.cfg) for j, layer in jobs.items()}
        pool = ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1, 16))
        self.futures = {j: pool.submit(compile_one, run) for j, run in runs.items()}
        pool.shutdown(wait=False)  # its threads finish the queue and exit

    def wait(self, jobs: list[Job]) -> None:
        for j in jobs:
            if j in self.futures:
                self.futures[j].result()

    def close(self) -> None:
        """Wait for every compile and log the total."""
        self.wait(list(self.futures))
        if self.futures:
            logger.info(
                "decode_matmul=auto: %d candidates compiled in threads (%.1f s from the start)",
                len(self.futures),
                time.perf_counter() - self.t0,
            )
