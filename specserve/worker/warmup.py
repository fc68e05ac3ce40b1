"""Start-up warm-up: the work a batch shape costs the first time it appears, done before serving.

CUDA graphs are captured at start-up for every padded batch size (worker/cudagraph.py,
worker/draft_graphs.py), and the decode-matmul plan is timed per row bucket
(ops/gemv_plan.py), but much of a step runs outside those graphs at the step's exact sizes:
lm_head over the B x (K + 1) verified rows (the planned gemv / skinny kernel: Triton
specializes its integer arguments on == 1 and % 16 == 0, so rows = 52 compiles a kernel that
the plan's timing at rows = 64 did not), input preparation, sampling, verification, token
writes (their pointer arguments are views at offsets B, 2B + 1, ... of the step's one upload,
and Triton specializes on 16-byte alignment, which follows B's parity), async scheduling's
device-side placement, and every kernel of an eager (prefill or mixed) step, whose attention
launch constants follow the longest query and the split count. Each new specialization is a
Triton compile (0.2-1 s) on the serving path: the first time concurrency 16 was served, a
P99 ITL of 1150 ms.

`warm_up` runs the real step (`ModelRunner.launch` + `finish`) over dummy requests that own no
KV blocks (their KV writes land in the null block, as padded rows' do):
  - uniform decode batches of every size 1..max_num_seqs, for every query length the engine
    captures (1, and 1 + K for each K it may verify), greedy, with temperature, and with
    temperature + top-k / top-p / min-p; with async scheduling also rows whose start is
    corrected on the device;
  - eager steps: one prefill of 1, 2, 3 and each power of two (and one past it) up to the
    token budget, alone and beside 1, 2, 15 and max_num_seqs - 1 decoding requests (batch
    sizes 1, 2, 3, 16, max_num_seqs: Triton's int classes == 1, % 16, other, both parities),
    and 2, 3 and 16 requests prefilling 1, 2 or 17 tokens each, alone and beside one decode.
Rows, the token buffer's dummy tokens and the dummy KV are left as a finished request leaves
them; nothing reaches the engine's scheduler, stats or outputs.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specserve.request import Request
from specserve.sampling_params import SamplingParams
from specserve.scheduler_output import ScheduledRequest, SchedulerOutput
from specserve.worker.cudagraph import graph_query_lens
from specserve.worker.model_runner import ModelRunner

logger = logging.getLogger("specserve")

# Sampling flavors that take different kernels or constexpr branches: greedy (argmax, greedy
# verification), temperature only (Gumbel-max, SAMPLED), and the filtered path.
FLAVORS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01),
)
# Decoding requests beside an eager step's prefill (cut to max_num_seqs - 1).
MIXED_DECODES = (0, 1, 2, 15)
# Several requests prefilling in one step (chunked prefill under load), each with these many
# tokens, beside 0 or 1 decoding request: the eager step's request count and the offsets of its
# per-request metadata take the classes a single prefill never does.
MULTI_PREFILLS = (2, 3, 16)
MULTI_PREFILL_LENS = (1, 2, 17)


@dataclass
class WarmupReport:
    steps: int
    seconds: float
    # Triton kernels compiled (or loaded from the on-disk cache) during the warm-up
    compiled: int


def compiled_kernels() -> set[tuple[str, str]]:
    """(kernel name, specialization key) of every kernel held by the in-memory caches of every
    Triton JIT function of specserve (one entry per specialization compiled or loaded in this
    process): a test hook (a step that adds none compiled nothing; the ones it adds are named)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton (CPU-only installs)
        return set()
    seen: set[int] = set()
    out: set[tuple[str, str]] = set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("specserve.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            fn = obj
            while fn is not None and not isinstance(fn, JITFunction):
                fn = getattr(fn, "fn", None)  # autotuner / heuristics wrappers
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            for caches in fn.device_caches.values():
                out.update((fn.__name__, str(key)) for key in caches[0])
    return out


def compiled_kernel_count() -> int:
    """len(compiled_kernels()): the warm-up's log line."""
    return len(compiled_kernels())


def _step(
    runner: ModelRunner,
    sp: SamplingParams,
    decodes: int,
    q: int,
    prefill: int = 0,
    on_device: bool = False,
    prefills: int = 1,
) -> None:
    """One real step over dummy requests: `decodes` rows of q tokens (q - 1 drafts) and,
    with prefill > 0, `prefills` rows prefilling that many tokens each first."""
    k = runner.num_spec_tokens
    ctx = 2 * (k + 1)  # tokens before a decode row's step: room for the drafts' positions
    sched = SchedulerOutput()
    for j in range(prefills if prefill else 0):
        req = Request(f"warmup-prefill-{j}", [1] * prefill, sp)
        sched.scheduled.append(ScheduledRequest(req, prefill, 0, 0))
    for i in range(decodes):
        req = Request(f"warmup-{i}", [1] * ctx, sp, seed=i)
        sched.scheduled.append(ScheduledRequest(req, q, q - 1, ctx - 1, on_device))
    try:
        runner.finish(runner.launch(sched, []))
    finally:
        for s in sched.scheduled:
            runner.remove_request(s.req)


@torch.inference_mode()
def warm_up(runner: ModelRunner, max_num_batched_tokens: int) -> WarmupReport:
    """Run every step shape serving can produce once (see the module docstring)."""
    t0 = time.perf_counter()
    before = compiled_kernel_count()
    cfg = runner.config
    max_seqs = cfg.max_num_seqs
    qs = graph_query_lens(cfg.spec) if runner.num_spec_tokens else [1]
    # Positions of decode rows run to 2 (K + 1) + K: shorter models have no room for them.
    if runner.max_model_len < 3 * (runner.num_spec_tokens + 1) + 1:
        return WarmupReport(0, 0.0, 0)
    steps = 0
    for sp in FLAVORS:
        for q in qs:
            for b in range(1, max_seqs + 1):
                _step(runner, sp, b, q)
                steps += 1
                if cfg.async_scheduling and q > 1:
                    _step(runner, sp, b, q, on_device=True)
                    steps += 1
    budget = min(max_num_batched_tokens, runner.max_model_len - 1)
    lens = {1, 2, 3}
    p = 4
    while p <= budget:
        lens |= {p, min(p + 1, budget)}
        p *= 2
    for prefill in sorted(lens):
        for d in sorted({min(d, max_seqs - 1) for d in (*MIXED_DECODES, max_seqs - 1)}):
            if prefill + d * qs[-1] <= max_num_batched_tokens:
                _step(runner, FLAVORS[0], d, qs[-1], prefill=prefill)
                steps += 1
    for n in sorted({min(n, max_seqs) for n in MULTI_PREFILLS} - {1}):
        for prefill in MULTI_PREFILL_LENS:
            for d in (0, 1):
                if n + d <= max_seqs and n * prefill + d * qs[-1] <= budget:
                    _step(runner, FLAVORS[0], d, qs[-1], prefill=prefill, prefills=n)
                    steps += 1
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
        watch_late_compiles()
    report = WarmupReport(steps, time.perf_counter() - t0, compiled_kernel_count() - before)
    logger.info(
        "warm-up: %d steps (every batch size 1-%d, query lengths %s, prefills of 1-%d tokens) "
        "in %.1f s, %d Triton kernels compiled",
        report.steps,
        max_seqs,
        qs,
        max(lens),
        report.seconds,
        report.compiled,
    )
    return report


# What watch_late_compiles logged in this process (describe_compile's text), oldest first.
late_compiles: list[str] = []
# Engines being built in this process (engine_startup): their compiles are start-up work.
_starting = 0


@contextlib.contextmanager
def engine_startup() -> Iterator[None]:
    """Compiles inside are an engine's start-up (its plan timing, graph capture, warm-up), not
    serving stalls: a second engine built in a process whose first one already watches (a
    notebook's new LLM, a benchmark's next variant) logs none of its own."""
    global _starting
    _starting += 1
    try:
        yield
    finally:
        _starting -= 1


def describe_compile(kw: dict) -> str:
    """A specialization from Triton's post-compile hook keywords: the kernel, its constexprs
    (Triton makes an int argument equal to 1 one) and the arguments it took as multiples of 16
    (pointers: 16-byte aligned). Triton's own `repr` names no argument in 3.6."""
    fn, comp = kw["fn"], kw.get("compile") or {}
    params = getattr(getattr(fn, "jit_function", None), "params", None) or []
    names = [p.name for p in params]

    def name(path: object) -> str:
        i = path[0] if isinstance(path, tuple) and path else path
        return names[i] if isinstance(i, int) and i < len(names) else str(i)

    consts = ", ".join(f"{name(p)}={v!r}" for p, v in (comp.get("constants") or {}).items())
    attrs = (comp.get("configs") or [{}])[0] or {}
    div = ", ".join(name(p) for p, a in attrs.items() if "tt.divisibility" in str(a))
    opts = f"num_warps={comp.get('num_warps')}, num_stages={comp.get('num_stages')}"
    if not consts and not div:
        return str(kw.get("repr", getattr(fn, "name", "?")))
    return f"{getattr(fn, 'name', '?')}[{opts}]({consts}; 16-divisible: {div or 'none'})"


def watch_late_compiles() -> None:
    """From now on, log a warning for every specserve Triton kernel compiled (or loaded from
    the disk cache) in this process: after the warm-up, each one is a stall of 0.2-1 s on the
    serving path, and the warning names the kernel and its specialization (the shape the
    warm-up missed). Triton's process-wide post-compile hook; a hook set before is chained."""
    try:
        import triton
    except ImportError:  # CPU-only installs: nothing compiles
        return
    previous = triton.knobs.runtime.jit_post_compile_hook
    if getattr(previous, "specserve_late_compiles", False):
        return  # watching already

    def hook(**kw: object) -> object:
        fn = kw["fn"]
        ours = str(getattr(fn, "module", "")).startswith("specserve.")
        if ours and not kw["is_manual_warmup"] and not _starting:
            what = describe_compile(kw)
            late_compiles.append(what)
            logger.warning(
                "Triton compiled %s after the warm-up: a one-time stall on the serving path "
                "(a step shape the warm-up does not run)",
                what,
            )
        return previous(**kw) if previous is not None else None

    hook.specserve_late_compiles = True  # type: ignore[attr-defined]
    triton.knobs.runtime.jit_post_compile_hook = hook
