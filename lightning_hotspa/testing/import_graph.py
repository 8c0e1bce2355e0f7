"""The package's import graph read from the source (no import runs), deferred imports included.

Every ``import`` / ``from ... import`` statement counts, wherever it sits (module top, inside a
function, under ``if TYPE_CHECKING``): a cycle hidden by a function-level import is still a cycle
in the design. Used by the tests (no cycles; dependencies point down) and to print the layers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["find_cycles", "import_graph", "package_of"]


def _modules(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, path: Path, known: Mapping[str, Path]) -> Iterator[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in known else base


def import_graph(root: str | Path, package: str | None = None) -> dict[str, set[str]]:
    """module -> the package's modules it imports (``root`` is the package directory)."""
    root = Path(root)
    package = package or root.name
    known = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        hits = set()
        for target in _targets(module, path, known):
            while target and target not in known and target.startswith(package + "."):
                target = target.rpartition(".")[0]  # an attribute of a module: the module
            if target in known and target != module:
                hits.add(target)
        graph[module] = hits
    return graph


def find_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def package_of(module: str, depth: int = 2) -> str:
    """``lightning_hotspa.planner.solve.solver`` -> ``lightning_hotspa.planner`` (top-level modules stay)."""
    return ".".join(module.split(".")[:depth])
