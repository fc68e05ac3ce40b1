"""The package import graph of specserve/ follows the documented layers (docs/architecture.md).

Every import is counted: top-level, inside functions, and under `if TYPE_CHECKING:`. A package may
import only packages of lower layers and the plain modules at the package top; the plain modules
import only each other; nothing inside the package imports the `specserve` facade itself.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "specserve"

# Top to bottom; packages on one row are peers and may not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("entrypoints",),
    ("bench", "train"),
    ("engine",),
    ("metrics",),
    ("worker",),
    ("spec_decode",),
    ("models",),
    ("attention",),
    # Tensor-parallel groups and collectives (models' row-parallel layers call them).
    ("distributed",),
    ("sample", "structured"),
    ("ops",),
    # Plain data types and the one home of tunables; `data` holds package data and its readers.
    ("config", "data", "<plain>"),
]
RANK = {pkg: len(LAYERS) - i for i, row in enumerate(LAYERS) for pkg in row}


def _unit(module: str, root: Path = ROOT) -> str | None:
    """The layer unit of a dotted module inside specserve: a subpackage, or `<plain>` for the
    modules at the package top (`specserve.config` is a package of its own)."""
    parts = module.split(".")
    if parts[0] != "specserve":
        return None
    if len(parts) == 1:
        return "<facade>"
    if (root / parts[1]).is_dir():
        return parts[1]
    return "<plain>"


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, root: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in the file."""
    mod = _module_name(path, root)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from specserve import ops` imports the module `specserve.ops`, not the facade;
            # `from specserve.pkg import name` imports `specserve.pkg` (and `name`, if a module).
            pkg_dir = root.parent.joinpath(*target.split("."))
            for a in node.names:
                sub = pkg_dir / a.name
                if sub.is_dir() or sub.with_suffix(".py").is_file():
                    out.append((f"{target}.{a.name}", node.lineno))
                else:
                    out.append((target, node.lineno))
    return out


def _edges(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(from unit, to unit) -> where, over every file of the package."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        src = _unit(_module_name(path, root), root)
        if src == "<facade>":
            continue  # specserve/__init__.py re-exports the public API for users
        for target, line in _imports(path, root):
            dst = _unit(target, root)
            if dst is None or dst == src:
                continue
            edges.setdefault((src, dst), []).append(f"{path.relative_to(root.parent)}:{line}")
    return edges


def _first_cycle(edges: dict[tuple[str, str], list[str]]) -> list[str] | None:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_every_unit_has_a_layer() -> None:
    units = {_unit(_module_name(p)) for p in ROOT.rglob("*.py")} - {"<facade>"}
    assert units <= set(RANK), f"packages without a layer in LAYERS: {sorted(units - set(RANK))}"


def test_package_graph_is_acyclic(root: Path = ROOT) -> None:
    cycle = _first_cycle(_edges(root))
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


def test_imports_only_go_down(root: Path = ROOT) -> None:
    bad = []
    for (src, dst), where in sorted(_edges(root).items()):
        if dst == "<facade>":
            bad.append(f"{src} imports the specserve facade ({where[0]}): import the module")
        elif RANK[dst] >= RANK[src] and not (src == dst == "<plain>"):
            if src in ("config", "<plain>") and dst in ("config", "<plain>"):
                continue  # the plain modules may use each other (acyclicity checks the rest)
            bad.append(f"{src} -> {dst}: {', '.join(where[:3])}")
    assert not bad, "imports against the layer order (see docs/architecture.md):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "line, upward",
    [
        ("from specserve.engine.engine import LLMEngine", True),
        ("from specserve.ops.gemv import gemv", False),
    ],
)
def test_the_check_sees_an_added_import(tmp_path: Path, line: str, upward: bool) -> None:
    """An import added to a lower layer of a copy of the package, even a type-only one, is
    reported; a downward one is not."""
    root = tmp_path / "specserve"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns("__pycache__", "data"))
    probe = f"from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    {line}\n"
    (root / "sample" / "layer_probe.py").write_text(probe)
    if upward:
        with pytest.raises(AssertionError):
            test_imports_only_go_down(root)
        with pytest.raises(AssertionError):
            test_package_graph_is_acyclic(root)
    else:
        test_imports_only_go_down(root)
