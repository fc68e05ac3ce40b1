"""Swapping a model's plain nn.Linear layers for a subclass that shares their parameters (the
decode gemv's DecodeLinear on CUDA, CpuLinear on the CPU), keeping the markers the models set
on their layers (`norm_fed`, `silu_gate_up`, `early_trigger`, `keep_dense`: models/layers.py,
models/mla.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

L = TypeVar("L", bound=nn.Linear)


def plain_attributes(linear: nn.Linear) -> dict[str, Any]:
    """The attributes set on `linear` beyond nn.Linear's own (the models' markers)."""
    own = ("in_features", "out_features", "training")
    return {k: v for k, v in vars(linear).items() if not k.startswith("_") and k not in own}


def sharing(cls: type[L], linear: nn.Linear) -> L:
    """A `cls` over `linear`'s own Parameter objects (no copy: tied weights stay tied), with
    its plain attributes."""
    with torch.device("meta"):
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
    new.weight = linear.weight
    new.bias = linear.bias
    for k, v in plain_attributes(linear).items():
        setattr(new, k, v)
    return new


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
