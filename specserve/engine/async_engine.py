"""AsyncLLMEngine: one background thread owns the LLMEngine; asyncio code talks to it.

The engine is not thread-safe and its steps are blocking torch work, so a single thread owns it:

    HTTP handlers (asyncio) --commands (add / abort)--> engine thread
    engine thread --token ids, via loop.call_soon_threadsafe--> the request group's event loop
    event loop: RequestState.process (text, stop strings) --> the group's asyncio queue

Structured-output grammars are compiled before a request reaches the engine thread, on a
worker thread of their own (RequestGroup.add): a schema that takes seconds to compile (or the
xgrammar tokenizer info built at the first one) never stalls the running streams.

The engine thread never touches the tokenizer: detokenization and stop strings run on the
request's event loop (output_processor.py, as vLLM's OutputProcessor). A stop string there ends
the request for the client at once and aborts it in the engine through the ordinary abort path;
outputs the engine made for it in the meantime are dropped.

Between two steps the thread drains the command queue: new requests join the running batch at
once (continuous batching) and aborted ones free their KV blocks before the next step. If a step
raises, the thread records the error, fails every open request and stops; `is_alive` turns false
(the server's /health answers 503 from then on).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.engine.output_processor import RequestState
from specserve.outputs import OutputTiming, RequestOutput
from specserve.sampling_params import SamplingParams

logger = logging.getLogger("specserve")

PromptType = str | dict[str, Any] | list[int]
# A prompt, or a function that makes one on the engine thread (where the tokenizer is used).
PromptSource = PromptType | Callable[[], PromptType]


# (stream, output, ttft, itl, seconds since arrival), timed when the engine thread hands it out.
_Delivery = tuple["_Stream", RequestOutput, float | None, float | None, float]


class EngineDeadError(RuntimeError):
    pass


class OutputObserver(Protocol):
    """Called for every output, with its text and final finish reason, on the request's event
    loop (Prometheus histograms live behind this): must be thread-safe."""

    def observe(self, output: RequestOutput, timing: OutputTiming) -> None: ...


@dataclass
class _Stream:
    group: RequestGroup
    index: int
    arrival: float
    last_output: float | None = None


@dataclass
class _Add:
    request_id: str
    prompt: PromptSource
    params: SamplingParams
    stream: _Stream
    done: asyncio.Future[None]
    # The compiled grammar of params.structured_outputs (None: unconstrained).
    grammar: Any | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _EndAll:
    """Abort every open request and fail its caller with `error` (shutdown timeout)."""

    error: BaseException


@dataclass
class _Wake:
    """Wakes an idle engine thread (shutdown)."""


# NOTE: an idle engine thread blocks on its command queue; this bounds only how late it
# notices a stop flag set without a _Wake.
IDLE_WAIT_S = 1.0


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, observers: Sequence[OutputObserver] = ()) -> None:
        self.engine = engine
        # Text and stop strings are the serving side's (RequestGroup), not the engine thread's.
        engine.detokenize = False
        self.observers = list(observers)
        self._commands: queue.Queue[_Add | _Abort | _EndAll | _Wake] = queue.Queue()
        # Touched only by the engine thread.
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # Grammar compilation, off the engine thread. One worker: xgrammar's compiler (and the
        # tokenizer info it builds at the first structured request) is driven by one thread.
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-grammar")
        # Engine counters, refreshed by the engine thread after every step; readers (/metrics)
        # get a consistent dict without touching the engine from another thread.
        self.snapshot: dict[str, Any] = engine.metrics_snapshot()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(_Wake())
        if self._thread is not None:
            self._thread.join(timeout)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running ({self.error!r})")

    # ---- requests (any thread) -----------------------------------------------------------
    def new_group(self) -> RequestGroup:
        return RequestGroup(self)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def end_all(self, error: BaseException) -> None:
        """Abort every open request; their callers get `error` (the engine keeps running)."""
        self._commands.put(_EndAll(error))

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                # Sleep on the command queue when there is nothing to run: no requests, or
                # none the last step could schedule (never spin a core doing nothing).
                idle = not eng.has_unfinished_requests() or eng.last_step_idle
                self._drain(block=idle)
                if eng.has_unfinished_requests():
                    self._dispatch(eng.step())
                self.snapshot = eng.metrics_snapshot()
        except BaseException as e:  # any failure kills the loop: report it to every caller
            logger.exception("engine loop died")
            self.error = e
            self._fail_all(EngineDeadError(f"the engine loop died: {e!r}"))
            return
        self.error = EngineDeadError("the engine was shut down")
        self._fail_all(self.error)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                self.engine.abort_request(cmd.request_id)
                self._streams.pop(cmd.request_id, None)
            elif isinstance(cmd, _EndAll):
                for request_id in list(self._streams):
                    self.engine.abort_request(request_id)
                self._fail_streams(cmd.error)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, cmd: _Add) -> None:
        loop = cmd.stream.group.loop
        try:
            prompt = cmd.prompt() if callable(cmd.prompt) else cmd.prompt
            self.engine.add_request(
                cmd.request_id, prompt, cmd.params, time.time(), grammar=cmd.grammar
            )
        except Exception as e:  # bad input: the caller answers 400, the loop goes on
            _call_soon(loop, _settle, cmd.done, e)
            return
        self._streams[cmd.request_id] = cmd.stream
        _call_soon(loop, _settle, cmd.done, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list[_Delivery]] = {}
        for out in outputs:
            s = self._streams.get(out.request_id)
            if s is None:
                continue  # aborted while the step ran
            ttft = now - s.arrival if s.last_output is None else None
            itl = now - s.last_output if s.last_output is not None else None
            s.last_output = now
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(s.group.loop, []).append((s, out, ttft, itl, now - s.arrival))
        # One wake-up per event loop per step, not one per request.
        for loop, items in batches.items():
            _call_soon(loop, _deliver, items)

    def _fail_streams(self, err: BaseException) -> None:
        for s in self._streams.values():
            _call_soon(s.group.loop, s.group.queue.put_nowait, (s.index, err))
        self._streams.clear()

    def _fail_all(self, err: BaseException) -> None:
        self._fail_streams(err)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                _call_soon(cmd.stream.group.loop, _settle, cmd.done, err)


class RequestGroup:
    """The outputs of several engine requests (the `n` choices of one HTTP request, or its
    several prompts) interleaved on one asyncio queue as (index, RequestOutput)."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self.request_ids: list[str] = []
        self._params: list[SamplingParams] = []
        # Per index, made at its first output (the prompt ids come with it).
        self._states: dict[int, RequestState] = {}
        self._unfinished: set[int] = set()

    async def add(self, requests: Sequence[tuple[str, PromptSource, SamplingParams]]) -> None:
        """Add all requests; if any is rejected, abort the others and raise its error."""
        self.engine.check_alive()
        grammars = await self._compile_grammars([params for _, _, params in requests])
        futures = []
        now = time.monotonic()
        for request_id, prompt, params in requests:
            index = len(self.request_ids)
            self.request_ids.append(request_id)
            self._params.append(params)
            self._unfinished.add(index)
            done: asyncio.Future[None] = self.loop.create_future()
            stream = _Stream(self, index, now)
            grammar = grammars.get(id(params.structured_outputs))
            self.engine._commands.put(_Add(request_id, prompt, params, stream, done, grammar))
            futures.append(done)
        if self.engine.error is not None:
            # The thread died after check_alive and may have drained the queue already.
            for f in futures:
                _settle(
                    f, EngineDeadError(f"the engine loop is not running: {self.engine.error!r}")
                )
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:
            self.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.abort()
            raise errors[0]

    async def _compile_grammars(self, params: Sequence[SamplingParams]) -> dict[int, Any]:
        """{id(structured_outputs): compiled grammar}, compiled on the grammar thread (the `n`
        choices of one request share one constraint object: it compiles once)."""
        todo = {
            id(p.structured_outputs): p.structured_outputs
            for p in params
            if p.structured_outputs is not None
        }
        compiler = self.engine.engine.structured
        pool = self.engine._grammar_pool
        return {
            key: await self.loop.run_in_executor(pool, compiler.compile, so)
            for key, so in todo.items()
        }

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._unfinished:
            index, item = await self.queue.get()
            if isinstance(item, BaseException):
                if index not in self._unfinished:
                    # It ended here (a stop string) before the engine thread saw the abort.
                    continue
                self._unfinished.clear()
                raise item
            if item.finished:
                self._unfinished.discard(index)
            yield index, item

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _receive(
        self, index: int, out: RequestOutput, ttft: float | None, itl: float | None, e2e: float
    ) -> None:
        """On the event loop: an engine output (token ids) becomes the client's (text, stop
        strings) and joins the queue."""
        state = self._states.get(index)
        if state is None:
            tokenizer = self.engine.engine.tokenizer
            state = RequestState(tokenizer, out.prompt_token_ids, self._params[index])
            self._states[index] = state
        if state.process(out) is None:
            return  # a stop string ended it; the engine had not seen the abort yet
        if state.needs_abort:
            state.needs_abort = False
            self.engine.abort(out.request_id)
        if out.finished:
            del self._states[index]
        finish = out.outputs[0].finish_reason
        timing = OutputTiming(ttft, itl, e2e if out.finished else None, finish)
        for obs in self.engine.observers:
            obs.observe(out, timing)
        self.queue.put_nowait((index, out))

    def abort(self) -> None:
        """Abort the requests that have not finished (client gone, or an error)."""
        for index in sorted(self._unfinished):
            self.engine.abort(self.request_ids[index])
        self._unfinished.clear()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the caller's event loop is closed: nobody is waiting any more


def _settle(fut: asyncio.Future[None], err: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)


def _deliver(items: list[_Delivery]) -> None:
    for s, out, ttft, itl, e2e in items:
        s.group._receive(s.index, out, ttft, itl, e2e)
