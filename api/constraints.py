"""Request fields that carry their own bounds: one statement for validation and the document.

``bounded(low, high)``, ``constrained(...)`` and ``constrained_by(constraint)``
return ``attrs`` fields whose metadata holds a ``Constraint`` (a range, the
allowed values, non-empty, at most n items, a key pattern, required although
nullable) and whose validator enforces it, raising ``InvalidParam`` naming the field (``api.convert``
prefixes the field's path in the request). ``api.schemas`` declares the
request types with them; ``api.openapi`` turns the same ``Constraint`` into
JSON Schema keywords (``constraint_of(field)``). What only code can check
(``check``) and what the server checks elsewhere (``schema``: documentation
only) sit in the same declaration. Fields that several APIs share (the
sampling bounds, the token limit, the timeout, the stop sequences) are
declared here once, as ``Constraint`` values.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import attrs

from api.errors import InvalidParam

METADATA_KEY = "constraint"

Number = int | float


@attrs.frozen(kw_only=True)
class Constraint:
    minimum: Number | None = None  # inclusive; for an object, bounds its values
    maximum: Number | None = None
    choices: tuple[Any, ...] | None = None
    nonempty: bool = False  # a string or an array with at least one element
    max_items: int | None = None  # for the array form
    keys: tuple[str, str] | None = None  # (what they are, regex): an object's keys
    required: bool = False  # must be given and not null, though the type admits null
    message: str | None = None  # replaces the generated one; {name} and {value} are filled in
    check: Callable[[str, Any], None] | None = None  # raises InvalidParam
    schema: dict[str, dict[str, Any]] = attrs.field(factory=dict)  # doc only, by JSON type


def constraint_of(field: attrs.Attribute) -> Constraint | None:
    return field.metadata.get(METADATA_KEY)


def constrained_by(constraint: Constraint, default: Any = None) -> Any:
    """An attrs field validated by (and documented from) ``constraint``."""
    return attrs.field(default=default, validator=_validate, metadata={METADATA_KEY: constraint})


def constrained(default: Any = attrs.NOTHING, **constraint: Any) -> Any:
    """An attrs field validated by (and documented from) ``Constraint(**constraint)``."""
    return constrained_by(Constraint(**constraint), default)


def bounded(low: Number | None = None, high: Number | None = None, *, default: Any = None,
            **more: Any) -> Any:
    """A numeric field in ``[low, high]`` (``None``: unbounded on that side)."""
    return constrained(default, minimum=low, maximum=high, **more)


# What every generating API accepts alike: chat and text completions
# (``api.schemas``), Responses (``api.agents.responses_schema``) and Anthropic
# Messages (``api.agents.messages_schema``) declare these fields with
# ``constrained_by(...)``, so that their bounds, checks and documented limits
# are the same everywhere.
MAX_STOP_SEQUENCES = 16
TEMPERATURE = Constraint(minimum=0)  # 0 is greedy
TOP_P = Constraint(minimum=0, maximum=1)
TOP_K = Constraint(minimum=0)  # 0 is off
TOKEN_LIMIT = Constraint(minimum=1)  # max_tokens and its other names
TIMEOUT = Constraint(minimum=0.001)  # seconds; ours: ends the request with "length"
# OpenAI's reasoning_effort (chat) and reasoning.effort (Responses): a chat-template
# variable (gpt-oss reads it); "none" also turns thinking off.
REASONING_EFFORT = Constraint(choices=("none", "minimal", "low", "medium", "high", "xhigh"))
STOP_SEQUENCES = Constraint(
    max_items=MAX_STOP_SEQUENCES,
    message=f"{{name}} takes at most {MAX_STOP_SEQUENCES} strings",
)


def _validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    c: Constraint = attribute.metadata[METADATA_KEY]
    name = attribute.name

    def fail(message: str, param: str = name) -> None:
        if c.message is not None:
            message = c.message.format(name=name, value=value)
        raise InvalidParam(param, message)

    if value is None:
        if c.required:
            fail(f"{name} is required")
        return
    if c.choices is not None and value not in c.choices:
        fail(f"{name} must be {_either(c.choices)}")
    if c.nonempty and isinstance(value, str | list) and not value:
        fail(f"{name} must not be empty")
    if c.max_items is not None and isinstance(value, list) and len(value) > c.max_items:
        fail(f"{name} takes at most {c.max_items} items")
    if isinstance(value, dict):
        for key, item in value.items():
            if c.keys is not None and not re.fullmatch(c.keys[1], key):
                fail(f"{name} keys must be {c.keys[0]}, got {key!r}")
            _check_range(c, f"{name}.{key}", item, fail)
    else:
        _check_range(c, name, value, fail)
    if c.check is not None:
        c.check(name, value)


def _check_range(c: Constraint, label: str, value: Any, fail: Callable[..., None]) -> None:
    if (c.minimum is None and c.maximum is None) or not isinstance(value, int | float):
        return
    if isinstance(value, float) and not math.isfinite(value):
        fail(f"{label} must be a finite number")
    if c.minimum is not None and value < c.minimum:
        fail(f"{label} must be at least {c.minimum}, got {value}")
    if c.maximum is not None and value > c.maximum:
        fail(f"{label} must be at most {c.maximum}, got {value}")


def _either(choices: tuple[Any, ...]) -> str:
    names = [str(c) for c in choices]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
