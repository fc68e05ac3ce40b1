"""The one typed home of the engine's kept switches and numeric tunables.

Kernels and runners read `tunables()` when they launch; tests and benchmarks change a field for a
block of code with `override(...)`, which restores the previous values on exit. Nothing else in
the package keeps a module-level knob.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class Tunables:
    """Fields are grouped by the package that reads them; each says what it trades."""


_current = Tunables()


def tunables() -> Tunables:
    """The values in force."""
    return _current


@contextmanager
def override(**changes: Any) -> Iterator[Tunables]:
    """Set fields of the tunables for the duration of a `with` block."""
    names = {f.name for f in dataclasses.fields(Tunables)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise AttributeError(f"unknown tunables {unknown}; known: {sorted(names)}")
    saved = {name: getattr(_current, name) for name in changes}
    for name, value in changes.items():
        setattr(_current, name, value)
    try:
        yield _current
    finally:
        for name, value in saved.items():
            setattr(_current, name, value)
