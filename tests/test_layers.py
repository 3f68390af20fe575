"""The dependency rule: ``api/`` -> ``actors/`` -> ``runtime/``, and no import circles.

Every import in the three packages counts, also one inside a function or
under ``TYPE_CHECKING``: a circle that only type checkers see is still a
circle to a reader. Also: no source file of the three packages is longer
than the size a reader can hold (``MAX_LINES``). The checkers read a source
tree (``ROOT``, or a small one a test writes) and report what breaks a rule;
the tests also feed them trees that break each rule, to see them caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"runtime": 0, "actors": 1, "api": 2}
MAX_LINES = 500


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
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


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the three packages under ``root``: the modules of theirs it imports."""
    files = {_module(p, root): p for layer in LAYER for p in (root / layer).rglob("*.py")}
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


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` that point up a layer (``runtime`` importing ``api``)."""
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if LAYER[b.split(".")[0]] > LAYER[a.split(".")[0]]
    )


def _too_long(root: Path = ROOT) -> list[str]:
    """The source files of the three packages under ``root`` longer than ``MAX_LINES``."""
    return [
        f"{p.relative_to(root)} ({n} lines)"
        for layer in LAYER
        for p in sorted((root / layer).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]


def test_no_import_points_up_a_layer():
    upward = _upward(_graph())
    assert not upward, "imports against api/ -> actors/ -> runtime/: " + ", ".join(upward)


def test_no_import_circles():
    assert not _circles(_graph())


def test_no_source_file_is_too_long():
    long = _too_long()
    assert not long, "split these: " + ", ".join(long)


# ------------------------------------------------- the checkers, on trees that break the rules


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A source tree of the three packages under ``root``: ``files`` maps paths to text."""
    for layer in LAYER:
        (root / layer).mkdir()
        (root / layer / "__init__.py").write_text("")
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_catches_runtime_importing_api(tmp_path):
    """An upward import is caught also inside a function (a lazy import); the
    downward imports of the same tree are not reported."""
    root = _tree(
        tmp_path,
        {
            "runtime/kernel.py": "def serve():\n    from api.edge import handler\n",
            "actors/actor.py": "from runtime.kernel import serve\n",
            "api/edge.py": "from actors.actor import serve as handler\n",
            "api/page.py": "import runtime.kernel\n",
        },
    )
    assert _upward(_graph(root)) == ["runtime.kernel -> api.edge"]


def test_the_checker_catches_an_actor_importing_api(tmp_path):
    root = _tree(tmp_path, {"actors/actor.py": "import api.edge\n", "api/edge.py": ""})
    assert _upward(_graph(root)) == ["actors.actor -> api.edge"]


def test_the_checker_catches_a_circle(tmp_path):
    """A circle through a relative import and one seen only under ``TYPE_CHECKING``
    is caught; the module that imports into it without being imported back is not
    part of it, and nothing in the tree points up a layer."""
    root = _tree(
        tmp_path,
        {
            "runtime/engine/__init__.py": "",
            "runtime/engine/a.py": "from .b import B\n",
            "runtime/engine/b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from runtime.engine.c import C\n"
            ),
            "runtime/engine/c.py": "from runtime.engine import a\n",
            "runtime/user.py": "from runtime.engine.a import B\n",
        },
    )
    graph = _graph(root)
    assert _circles(graph) == [["runtime.engine.a", "runtime.engine.b", "runtime.engine.c"]]
    assert not _upward(graph)


def test_circles_are_found_in_a_graph_apart():
    """``_circles`` on graphs given as data: every circle, each once; none in a tree."""
    graph = {
        "runtime.a": {"runtime.b"},
        "runtime.b": {"runtime.a", "runtime.c"},
        "runtime.c": set(),
        "actors.x": {"actors.y", "runtime.c"},
        "actors.y": {"actors.z"},
        "actors.z": {"actors.x"},
        "api.p": {"actors.x", "runtime.a"},
    }
    assert sorted(_circles(graph)) == [
        ["actors.x", "actors.y", "actors.z"],
        ["runtime.a", "runtime.b"],
    ]
    acyclic = {"api.p": {"actors.x"}, "actors.x": {"runtime.c"}, "runtime.c": set()}
    assert _circles(acyclic) == []


def test_the_checker_catches_a_file_too_long(tmp_path):
    root = _tree(
        tmp_path,
        {"api/long.py": "x = 1\n" * (MAX_LINES + 1), "api/full.py": "x = 1\n" * MAX_LINES},
    )
    assert _too_long(root) == [f"api/long.py ({MAX_LINES + 1} lines)"]
