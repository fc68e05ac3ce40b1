"""One tensor-parallel group: its rank, its store and the collectives of a sharded forward.

The groups are built straight from a `TCPStore` (torch.distributed's standard TCP rendezvous:
MASTER_ADDR / MASTER_PORT), never as torch's default process group, so one process may hold
several engines (tests do) and an engine's groups end with it. Collectives go through the
process group's own API (`allreduce([t]).wait()`); on CUDA they are NCCL's and are captured
inside the CUDA graphs like any kernel, on CPU they are gloo's.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


class TensorParallelError(RuntimeError):
    """A rank died, hung or disagreed: the engine cannot go on."""


class TensorParallel:
    """A rank's view of its tensor-parallel group. Rank 0 is the engine's own process."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        device: torch.device,
        timeout_s: float,
        store: dist.TCPStore | None = None,
    ) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # Rank 0 creates the store first (port 0: a free one) so it can tell workers the port.
        self.store = store or make_store(host, port, rank, world_size, timeout_s)
        prefix = dist.PrefixStore("tp", self.store)
        if device.type == "cuda":
            # NOTE: no NVLink multicast (NVLS): start_workers sets NCCL_NVLS_ENABLE=0 for every
            # rank; the engine's own rank sets it here before NCCL reads its environment.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.group: dist.ProcessGroup = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
        else:
            self.group = dist.ProcessGroupGloo(prefix, rank, world_size, self.timeout)

    # ---- collectives of the sharded forward ------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (a row-parallel layer's partial products)."""
        self.group.allreduce([x]).wait()
        return x

    def all_gather(
        self,
        # [..., n]
        x: torch.Tensor,
    ) -> torch.Tensor:
        """[..., world_size * n]: the ranks' tensors side by side along the last dim (the
        vocab shards of a logits row)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (KV blocks each rank's memory holds)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], opts).wait()
        return int(t.item())


def make_store(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The group's TCPStore: rank 0 serves it (port 0: any free port), the others connect."""
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def tp_reduce(tp: TensorParallel | None, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's output: summed over the ranks under tensor parallelism, `x`
    itself otherwise (TP = 1 runs no collective)."""
    return x if tp is None else tp.all_reduce(x)
