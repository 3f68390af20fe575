"""The API edge's cattrs converter: JSON values <-> attrs types, strictly.

``structure_or_400(data, cls)`` structures a parsed JSON body into a request
type, whose attrs validators check the bounds; every failure becomes a
``ClientError`` (400) whose message and ``param`` name the field, e.g.
``max_tokens: expected an integer, got a string`` or ``messages[0].role must
be ...`` (``cattrs.transform_error`` finds the path). Types are strict (``true`` is not an integer, ``"5"`` is not a
number, NaN is not a number). ``unstructure`` turns response types into JSON
values, leaving out fields that are still at their default ``None``.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar, Union, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import (
    ClassValidationError,
    IterableValidationError,
    IterableValidationNote,
)

from api.errors import InvalidParam
from runtime.errors import ClientError

T = TypeVar("T")

_JSON_NAMES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
    type(None): "null",
}


def _json_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    for kind, name in _JSON_NAMES.items():
        if isinstance(value, kind):
            return name
    return type(value).__name__


class WrongType(TypeError):
    def __init__(self, expected: str, value: Any):
        super().__init__(f"expected {expected}, got {_json_name(value)}")


def _strict_int(value, _):
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            return int(value)
        raise WrongType("an integer", value)
    return value


def _strict_float(value, _):
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WrongType("a number", value)
    if isinstance(value, float) and not math.isfinite(value):
        raise TypeError("expected a finite number")
    return float(value)


def _strict_bool(value, _):
    if not isinstance(value, bool):
        raise WrongType("a boolean", value)
    return value


def _strict_str(value, _):
    if not isinstance(value, str):
        raise WrongType("a string", value)
    return value


def _any(value, _):
    return value


def _is_union(t) -> bool:
    return get_origin(t) is Union or type(t).__name__ == "UnionType"


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=False, omit_if_default=False)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(Any, _any)

    def union_hook_factory(t):
        members = get_args(t)
        non_none = [m for m in members if m is not type(None)]

        def hook(value, _):
            if value is None:
                if type(None) in members:
                    return None
                raise WrongType(_describe_type(t), value)
            for m in non_none:
                if _matches(value, m):
                    return conv.structure(value, m)
            raise WrongType(_describe_type(t), value)

        return hook

    conv.register_structure_hook_factory(_is_union, union_hook_factory)

    def list_hook_factory(t):
        (item,) = get_args(t) or (Any,)

        def hook(value, _):
            if not isinstance(value, list):
                raise WrongType("an array", value)
            errors, out = [], []
            for i, v in enumerate(value):
                try:
                    out.append(conv.structure(v, item))
                except Exception as exc:
                    exc.add_note(IterableValidationNote(f"Structuring {t} @ index {i}", i, item))
                    errors.append(exc)
            if errors:
                raise IterableValidationError(f"While structuring {t!r}", errors, t)
            return out

        return hook

    def dict_hook_factory(t):
        args = get_args(t) or (str, Any)
        _, val_t = args

        def hook(value, _):
            if not isinstance(value, dict):
                raise WrongType("an object", value)
            return {str(k): conv.structure(v, val_t) for k, v in value.items()}

        return hook

    conv.register_structure_hook_factory(lambda t: get_origin(t) is list, list_hook_factory)
    conv.register_structure_hook_factory(lambda t: get_origin(t) is dict, dict_hook_factory)

    def attrs_guard_factory(cls):
        inner = cattrs.gen.make_dict_structure_fn(cls, conv)

        def hook(value, _):
            if not isinstance(value, dict):
                raise WrongType("an object", value)
            return inner(value, cls)

        return hook

    conv.register_structure_hook_factory(attrs.has, attrs_guard_factory)
    return conv


def _matches(value: Any, t: Any) -> bool:
    origin = get_origin(t) or t
    if origin is bool:
        return isinstance(value, bool)
    if origin is int:
        if isinstance(value, float):
            return value.is_integer()
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list)
    if origin is dict or attrs.has(origin):
        return isinstance(value, dict)
    return True


def _describe_type(t: Any) -> str:
    parts = []
    for m in get_args(t):
        origin = get_origin(m) or m
        if origin is type(None):
            parts.append("null")
        elif attrs.has(origin) or origin is dict:
            parts.append("an object")
        elif origin is list:
            inner = get_args(m)
            parts.append(f"an array of {_describe_type_one(inner[0])}s" if inner else "an array")
        else:
            parts.append(_JSON_NAMES.get(origin, getattr(origin, "__name__", str(origin))))
    return " or ".join(parts)


def _describe_type_one(t: Any) -> str:
    if attrs.has(t):
        return "object"
    return {int: "integer", str: "string", float: "number", bool: "boolean"}.get(t, "value")


converter = _make_converter()


def _describe(exc: BaseException, _type: Any = None) -> str:
    """The text of one leaf error (cattrs' ``format_exception`` for our messages)."""
    if isinstance(exc, InvalidParam):
        return exc.message
    if isinstance(exc, KeyError):
        return "is required"
    return str(exc) or type(exc).__name__


def client_error(exc: ClassValidationError | IterableValidationError) -> ClientError:
    """The 400 for the first error of a failed structuring, naming the field by its path.

    ``cattrs.transform_error`` walks the exception groups and builds the paths
    (``.messages[0].role``); it calls ``_describe`` once per line, in order, so
    the first exception seen is the first line's. An ``InvalidParam`` from an
    attrs validator is reported at its object's path: its own ``param`` is
    appended there (and to its message when that starts with the field).
    """
    seen: list[BaseException] = []

    def describe(leaf: BaseException, type_: Any) -> str:
        seen.append(leaf)
        return _describe(leaf, type_)

    first = cattrs.transform_error(exc, path="", format_exception=describe)[0]
    message, _, path = first.rpartition(" @ ")
    path = path.removeprefix(".")
    leaf = seen[0]
    if isinstance(leaf, InvalidParam):
        param = f"{path}.{leaf.param}" if path else leaf.param
        if path and message.startswith(leaf.param):
            message = f"{path}.{message}"
        return ClientError(message, param=param)
    return ClientError(f"{path}: {message}" if path else message, param=path or None)


def structure_or_400(data: Any, cls: type[T]) -> T:
    if not isinstance(data, dict):
        raise ClientError("the request body must be a JSON object", param=None)
    try:
        value = converter.structure(data, cls)
    except (ClassValidationError, IterableValidationError) as exc:
        raise client_error(exc) from None
    except (TypeError, ValueError) as exc:
        raise ClientError(str(exc)) from None
    validate = getattr(value, "validate", None)  # checks across fields, where a type has them
    if validate is not None:
        validate()
    return value


response_converter = cattrs.Converter(omit_if_default=True)


def unstructure(value: Any) -> Any:
    return response_converter.unstructure(value)
