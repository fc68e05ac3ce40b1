"""Tensor parallelism, rank-0 driven (vLLM's executor in spirit): the engine's process is rank 0
and runs its own ModelRunner; ranks 1..N-1 are worker processes that each build the same
engine over their shards (`LLMEngine(config, tp=...)`: the same start-up, so the same
collectives in the same order) and then only run the steps rank 0 sends them
(worker/tp_step.py). Tokens come back from rank 0's own runner: every rank samples the same
tokens from the same gathered logits with the (seed, position)-keyed RNG, so none are sent.

Rendezvous is torch.distributed's TCP store at MASTER_ADDR:MASTER_PORT. On one machine the
engine picks a free port and spawns its workers. Across machines every node runs the same
command with NNODES and NODE_RANK set (and MASTER_ADDR / MASTER_PORT naming node 0): node k
holds ranks k * N / NNODES ..; node 0's first rank is the engine, the other nodes only serve
steps and exit when the engine ends.

Failure: a worker that dies makes rank 0's next collective fail (gloo: at once; NCCL: at the
group's timeout, `distributed_timeout_seconds`), and rank 0 checks its local workers before
every step; either way the engine raises TensorParallelError naming the rank. A worker whose
engine died gets an error from the store and exits.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import sys
import traceback
from typing import Any

import torch

from specserve.config import EngineConfig
from specserve.distributed import TensorParallel, TensorParallelError
from specserve.distributed.group import make_store
from specserve.request import Request, RequestGrammar
from specserve.scheduler_output import SchedulerOutput
from specserve.worker.model_runner import ModelRunner
from specserve.worker.step_results import PendingStep, StepOutput
from specserve.worker.tp_step import StepChannel, StepMessage, StepReceiver, StepSender

logger = logging.getLogger("specserve")

# Debug: every step, rank 0 compares the tokens every rank sampled (a mismatch raises).
CHECK_ENV = "SPECSERVE_TP_CHECK"


@dataclasses.dataclass
class Rendezvous:
    host: str
    port: int
    nnodes: int
    node_rank: int

    @classmethod
    def from_env(cls) -> Rendezvous:
        nnodes, node_rank = int(os.environ.get("NNODES", 1)), int(os.environ.get("NODE_RANK", 0))
        if nnodes > 1 and "MASTER_ADDR" not in os.environ:
            raise ValueError("NNODES > 1 needs MASTER_ADDR and MASTER_PORT (node 0's address)")
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        # One machine: any free port (rank 0's store picks it); several: node 0's MASTER_PORT.
        port = int(os.environ.get("MASTER_PORT", 0)) if nnodes > 1 else 0
        return cls(host, port, nnodes, node_rank)


def start_tensor_parallel(config: EngineConfig) -> tuple[TensorParallel, list[Any]]:
    """Rank 0's group and its local worker processes. On a node other than 0 this serves that
    node's ranks until the engine ends, then exits the process."""
    n = config.tensor_parallel_size
    rdv = Rendezvous.from_env()
    if n % rdv.nnodes:
        raise ValueError(f"tensor_parallel_size {n} must be a multiple of NNODES {rdv.nnodes}")
    local = n // rdv.nnodes
    first = rdv.node_rank * local
    timeout = config.distributed_timeout_seconds
    store = make_store(rdv.host, rdv.port, first, n, timeout) if first == 0 else None
    port = store.port if store is not None else rdv.port
    # NOTE: no NVLink multicast (NVLS) in any rank: inherited by the workers' environment.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(max(first, 1), first + local):
        args = (config, rank, rank - first, rdv.host, port, torch.get_num_threads())
        p = ctx.Process(target=_worker_main, args=args, daemon=first == 0)
        p.start()
        procs.append(p)
    if first != 0:  # a node without the engine: serve until the engine ends
        for p in procs:
            p.join()
        sys.exit(max((p.exitcode or 0) for p in procs))
    try:
        tp = TensorParallel(0, n, rdv.host, port, config.torch_device, timeout, store)
    except Exception as e:
        stop_workers(procs)
        raise TensorParallelError(f"tensor-parallel rendezvous failed: {e}") from e
    return tp, procs


def _worker_main(
    config: EngineConfig, rank: int, local_rank: int, host: str, port: int, threads: int
) -> None:
    """A worker rank: the same engine start-up over its shards, then the steps rank 0 sends."""
    from specserve.engine.engine import LLMEngine

    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING)
    if config.torch_device.type == "cuda":
        config = dataclasses.replace(config, device=f"cuda:{local_rank}")
        torch.cuda.set_device(config.torch_device)
    timeout = config.distributed_timeout_seconds
    tp = TensorParallel(rank, config.tensor_parallel_size, host, port, config.torch_device, timeout)
    try:
        engine = LLMEngine(config, tp=tp)
        receiver = StepReceiver(engine.runner)
        channel = StepChannel(tp.store)
        step = 0
        while True:
            msg = channel.recv(step)
            if msg.shutdown:
                return
            out = receiver.run(msg)
            if msg.check:
                channel.post_tokens(rank, step, out)
            step += 1
    except BaseException:
        # Rank 0 reads this when it sees the group fail; an engine that ended is no error.
        try:
            tp.store.set(f"error/{rank}", traceback.format_exc())
        except Exception:  # noqa: BLE001 - the store went with rank 0: nothing to report to
            sys.exit(0)
        raise


def stop_workers(procs: list[Any], timeout: float = 10.0) -> None:
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(timeout)


class TPExecutor:
    """Rank 0's runner under tensor parallelism: sends each step to the workers, then runs it
    on its own ModelRunner. Everything else is the local runner's (attribute access goes
    through)."""

    def __init__(self, runner: ModelRunner, tp: TensorParallel, procs: list[Any]) -> None:
        self.runner, self.tp, self.procs = runner, tp, procs
        self.sender = StepSender()
        self.channel = StepChannel(tp.store)
        self.check = os.environ.get(CHECK_ENV, "") not in ("", "0")
        self.error: TensorParallelError | None = None
        # step number of each launched step, for the debug comparison
        self._steps: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def remove_request(self, req: Request) -> None:
        self.sender.remove(req)
        self.runner.remove_request(req)

    def launch(
        self, sched: SchedulerOutput, reqs_logprobs: list[int], num_drafts: int | None = None
    ) -> PendingStep:
        self._check_alive()
        msg = self.sender.message(sched, reqs_logprobs, num_drafts, self.runner, self.check)
        # Rank 0's launch applies the very masks it sent: building them walked its matchers
        # over the step's drafts already, and a second walk would only repeat that work.
        grammars: list[tuple[Request, RequestGrammar | None]] = []
        for s, r in zip(sched.scheduled, msg.requests):
            if r.masks is not None:
                grammars.append((s.req, s.req.grammar))
                s.req.grammar = r.masks
        try:
            self.channel.send(msg)
            pending = self.runner.launch(sched, reqs_logprobs, num_drafts)
        except Exception as e:
            raise self._failed(e) from e
        finally:
            for req, grammar in grammars:
                req.grammar = grammar
        self._steps[id(pending)] = msg.step
        return pending

    def finish(self, pending: PendingStep) -> StepOutput:
        step = self._steps.pop(id(pending))
        try:
            out = self.runner.finish(pending)
            if self.check:
                self.channel.compare_tokens(self.tp.world_size, step, out)
        except Exception as e:
            raise self._failed(e) from e
        return out

    def execute(
        self, sched: SchedulerOutput, reqs_logprobs: list[int], num_drafts: int | None = None
    ) -> StepOutput:
        return self.finish(self.launch(sched, reqs_logprobs, num_drafts))

    def close(self) -> None:
        """End the workers (a shutdown message; those that do not exit are killed)."""
        if self.error is None:  # (other nodes' workers too: none of them is in `procs`)
            try:
                msg = StepMessage(self.sender.step, [], [], [], None, shutdown=True)
                self.channel.send(msg)
            except Exception:  # noqa: BLE001 - a worker already gone: killed below
                pass
        stop_workers(self.procs)
        self.runner.close()

    def _check_alive(self) -> None:
        if self.error is not None:
            raise self.error
        if not all(p.is_alive() for p in self.procs):
            raise self._failed(None)

    def _failed(self, cause: BaseException | None) -> TensorParallelError:
        """The engine's error for a failed step: which ranks died, and what they reported."""
        if self.error is not None:
            return self.error
        why = []
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                why.append(f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}")
        for rank in range(1, self.tp.world_size):
            key = f"error/{rank}"
            try:
                if self.tp.store.check([key]):
                    why.append(f"rank {rank} failed:\n{self.tp.store.get(key).decode()}")
            except Exception:  # noqa: BLE001 - the store itself may be unusable now
                break
        if cause is not None:
            why.append(f"rank 0: {type(cause).__name__}: {cause}")
        self.error = TensorParallelError(
            "tensor-parallel step failed; the engine cannot continue: " + "; ".join(why)
        )
        stop_workers([p for p in self.procs if p.is_alive()], timeout=0.1)
        return self.error
