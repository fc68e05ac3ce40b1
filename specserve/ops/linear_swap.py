"""Swapping a model's plain nn.Linear layers for a subclass that shares their parameters (the
decode gemv's DecodeLinear on CUDA, CpuLinear on the CPU)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def replace_linears_(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every plain nn.Linear child of `model` (subclasses, such as sharded or fp8
    layers, are left alone) by `make(child)`; returns how many."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))
                n += 1
    return n
