"""The dependency rule: ``api/`` -> ``actors/`` -> ``runtime/``, and no import circles.

Every import in the three packages counts, also one inside a function or
under ``TYPE_CHECKING``: a circle that only type checkers see is still a
circle to a reader. Also: no source file of the three packages is longer
than the size a reader can hold (``MAX_LINES``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"runtime": 0, "actors": 1, "api": 2}
MAX_LINES = 550


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for layer in LAYER for p in (ROOT / layer).rglob("*.py")}
    return {
        name: {i for i in _imports(path, name) if i in files and i != name}
        for name, path in files.items()
    }


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_points_up_a_layer():
    upward = [
        f"{a} -> {b}"
        for a, targets in _graph().items()
        for b in targets
        if LAYER[b.split(".")[0]] > LAYER[a.split(".")[0]]
    ]
    assert not upward, "imports against api/ -> actors/ -> runtime/: " + ", ".join(sorted(upward))


def test_no_import_circles():
    assert not _circles(_graph())


def test_the_checker_sees_upward_imports_and_circles():
    graph = {"runtime.a": {"actors.b"}, "actors.b": {"runtime.a"}, "api.c": set()}
    assert _circles(graph) == [["actors.b", "runtime.a"]]
    assert LAYER["actors"] > LAYER["runtime"]


def test_no_source_file_is_too_long():
    long = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for layer in LAYER
        for p in (ROOT / layer).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, "split these: " + ", ".join(long)
