"""Actor boundaries: what crosses them, and how an actor is reached.

* No code reaches into an actor's core: an actor's sans-IO core is its own
  (``self._core``), and everyone else goes through the actor's port
  (``SchedulerPort``, ``DetokenizerPort``, ``ModelLoaderPort``). The checker
  reads the three packages' sources and reports any ``x.core`` / ``x._core``
  whose ``x`` is not ``self``.
* Every message is frozen and typed: each class of the message modules
  (``runtime.messages``, ``runtime.lifecycle``) is a frozen attrs class whose
  fields name no ``typing.Any``, an enum, or a Protocol (a port, not a message).

Both checkers are also fed code that breaks their rule, to see it caught.
"""

from __future__ import annotations

import ast
import enum
import types
import typing
from pathlib import Path

import attrs
import pytest

import runtime.lifecycle
import runtime.messages

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "actors", "runtime")
CORE_NAMES = frozenset({"core", "_core"})
MESSAGE_MODULES = (runtime.messages, runtime.lifecycle)


# ----------------------------------------------------------------- the checkers


def reaches_into_cores(root: Path = ROOT) -> list[str]:
    """Every ``x.core`` / ``x._core`` in the packages under ``root`` whose ``x`` is not ``self``."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in CORE_NAMES
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    return found


def _names_any(hint: object) -> bool:
    if hint is typing.Any:
        return True
    return any(_names_any(arg) for arg in typing.get_args(hint) if arg is not Ellipsis)


def message_faults(module: types.ModuleType) -> list[str]:
    """The classes defined in ``module`` that are not frozen, typed messages."""
    faults = []
    for name, cls in sorted(vars(module).items()):
        if not isinstance(cls, type) or cls.__module__ != module.__name__:
            continue
        if issubclass(cls, enum.Enum) or getattr(cls, "_is_protocol", False):
            continue
        if not attrs.has(cls):
            faults.append(f"{name}: not an attrs class")
            continue
        fields = attrs.fields(cls)
        blank = object.__new__(cls)
        if fields:
            try:
                setattr(blank, fields[0].name, None)
                faults.append(f"{name}: not frozen")
            except attrs.exceptions.FrozenInstanceError:
                pass
        hints = typing.get_type_hints(cls, vars(module))
        faults += [f"{name}.{f.name}: Any" for f in fields if _names_any(hints[f.name])]
    return faults


# ------------------------------------------------------------------- the rules


def test_no_code_reaches_into_an_actors_core():
    found = reaches_into_cores()
    assert not found, "use the actor's port: " + ", ".join(found)


@pytest.mark.parametrize("module", MESSAGE_MODULES, ids=lambda m: m.__name__)
def test_every_message_is_frozen_and_typed(module):
    assert not message_faults(module)
    messages = [c for c in vars(module).values() if attrs.has(c) and c.__module__ == module.__name__]
    assert len(messages) >= 6  # the module still holds messages: the check read something


# ---------------------------------------------------- the checkers, on code that breaks the rules


def test_the_core_checker_catches_a_reach_past_the_port(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "api" / "health.py").write_text(
        "def load(rt):\n    return rt.scheduler.core.load\n"
    )
    (tmp_path / "actors" / "system.py").write_text(
        "class Runtime:\n"
        "    def load(self):\n"
        "        return self.scheduler._core.load + self._core.load\n"
    )
    (tmp_path / "runtime" / "loop.py").write_text("def f(core):\n    return core.handle\n")
    assert reaches_into_cores(tmp_path) == [
        "api/health.py:2 rt.scheduler.core",
        "actors/system.py:3 self.scheduler._core",
    ]


def test_the_message_checker_catches_mutable_and_untyped_messages():
    module = types.ModuleType("fake_messages")
    source = (
        "from typing import Any, Protocol\n"
        "import attrs\n"
        "@attrs.define\n"
        "class Mutable:\n"
        "    n: int\n"
        "@attrs.frozen\n"
        "class Untyped:\n"
        "    payload: tuple[Any, ...]\n"
        "@attrs.frozen\n"
        "class Fine:\n"
        "    n: int | None\n"
        "class Port(Protocol):\n"
        "    def put(self, x: int) -> None: ...\n"
        "class Plain:\n"
        "    pass\n"
    )
    exec(compile(source, "fake_messages", "exec"), vars(module))
    assert message_faults(module) == [
        "Mutable: not frozen",
        "Plain: not an attrs class",
        "Untyped.payload: Any",
    ]
