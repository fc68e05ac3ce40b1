"""Tensor parallelism: process groups, the collectives model layers call, and rendezvous."""

from specserve.distributed.group import TensorParallel, TensorParallelError, tp_reduce

__all__ = ["TensorParallel", "TensorParallelError", "tp_reduce"]
