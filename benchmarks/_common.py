"""What every benchmark script shares: the repository on `sys.path` (a bare checkout runs the
scripts without an install) and the folder results go to.

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import out_dir  # noqa: E402
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def out_dir() -> str:
    """$OUT when set (the device machine brings back what is written there), else ./out."""
    path = os.environ.get("OUT") or "out"
    os.makedirs(path, exist_ok=True)
    return path


def write_json(name: str, data: object) -> str:
    """Write `data` as out_dir()/name and return the path."""
    import json

    path = os.path.join(out_dir(), name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    return path
