"""How a setting is declared: the metadata every presentation of a setting reads.

``setting(default, help=..., ...)`` returns an attrs field whose metadata is
a ``Setting``: help, text format, bounds (which also become the field's attrs
validators: ``gt``/``ge``/``le``/``in_``), whether it is ours or
mlx_lm.server's, and notes for the docs. ``complete_settings``, the class's
``field_transformer``, fills in what follows from the field: its name, flag
(``--max-tokens``), environment variable (``MLX_TRIO_MAX_TOKENS``), default,
and the text format its type implies. ``TextFormat`` parses a flag's or a
variable's text (``"4GB"``, ``"a,b"``, ``"true"``). ``runtime.config``
declares ``ServerConfig`` with these; nothing here knows its fields.
"""

import json
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

import attrs
from attrs import validators

ENV_PREFIX = "MLX_TRIO_"
METADATA_KEY = "setting"


# ------------------------------------------------------------ text formats


def parse_size(text: str) -> int:
    """``"512M"``, ``"4GB"``, ``"1000"`` -> bytes (decimal units, like mlx_lm)."""
    units = {"": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}
    text = text.strip()
    digits = ""
    for ch in text:
        if ch.isdigit() or ch == ".":
            digits += ch
        else:
            break
    unit = text[len(digits) :].strip().upper()
    try:
        return int(Decimal(digits) * units[unit])
    except (InvalidOperation, KeyError):
        raise ValueError(f"not a size: {text!r} (use e.g. 512M or 4GB)") from None


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def parse_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def parse_json_object(text: str) -> dict[str, Any]:
    value = json.loads(text) if text.strip() else {}
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


def parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None


@attrs.frozen
class TextFormat:
    """How a setting's value is written as text (a flag's or a variable's)."""

    kind: str  # what the docs call it: "integer", "size or none", ...
    parse: Callable[[str], Any]

    def __call__(self, text: str) -> Any:
        return self.parse(text)

    def or_none(self) -> "TextFormat":
        """The same format, or empty text for ``None``."""
        return TextFormat(f"{self.kind} or none", lambda text: self.parse(text) if text.strip() else None)


STRING = TextFormat("string", str)
INTEGER = TextFormat("integer", parse_int)
NUMBER = TextFormat("number", parse_float)
BOOLEAN = TextFormat("boolean", parse_bool)
SIZE = TextFormat("size", parse_size)
LIST = TextFormat("comma-separated list", parse_list)
JSON_OBJECT = TextFormat("JSON object", parse_json_object)

_FORMAT_OF_TYPE: dict[Any, TextFormat] = {
    str: STRING,
    str | None: STRING,
    int: INTEGER,
    int | None: INTEGER.or_none(),
    float: NUMBER,
    float | None: NUMBER.or_none(),
    bool: BOOLEAN,
    tuple[str, ...]: LIST,
    dict[str, Any]: JSON_OBJECT,
}


# ---------------------------------------------------------------- settings


@attrs.frozen(kw_only=True)
class Setting:
    """One field's metadata. ``name``, ``flag``, ``env``, ``default`` and (when not
    given) ``format`` are filled in from the field when the class is made."""

    help: str
    format: TextFormat | None = None
    minimum: int | float | None = None  # inclusive
    above: int | float | None = None  # exclusive minimum
    maximum: int | float | None = None  # inclusive
    choices: tuple[Any, ...] | None = None
    ours: bool = False  # not one of mlx_lm.server's flags
    repeatable: bool = False  # a list flag that may be given several times (values add up)
    notes: str = ""  # more for docs/configuration.md (Markdown)
    default_text: str | None = None  # for a default that is computed at start-up
    name: str = ""
    flag: str = ""
    env: str = ""
    default: Any = None

    def bounds_text(self) -> str:
        """The bounds in words: ``> 0``, ``0-1000``, ``>= 0`` (empty when none)."""
        if self.above is not None:
            return f"> {self.above}"
        if self.minimum is not None and self.maximum is not None:
            return f"{self.minimum}-{self.maximum}"
        if self.minimum is not None:
            return f">= {self.minimum}"
        if self.maximum is not None:
            return f"<= {self.maximum}"
        return ""

    def show_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        return show_value(self.default)


def show_value(value: Any) -> str:
    """A setting's value as its flag would be written (``none`` for ``None``)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, dict):
        return json.dumps(value)
    if value == "":
        return '""'
    return str(value)


def setting(
    default: Any = attrs.NOTHING,
    *,
    help: str,
    factory: Callable[[], Any] | None = None,
    converter: Callable[[Any], Any] | None = None,
    secret: bool = False,
    **more: Any,
) -> Any:
    """A ``ServerConfig`` field: its ``Setting`` metadata and the validators it implies.

    ``secret``: the value is left out of the config's ``repr`` (API keys)."""
    meta = Setting(help=help, **more)
    checks = []
    if meta.above is not None:
        checks.append(validators.gt(meta.above))
    if meta.minimum is not None:
        checks.append(validators.ge(meta.minimum))
    if meta.maximum is not None:
        checks.append(validators.le(meta.maximum))
    if meta.choices is not None:
        checks.append(validators.in_(meta.choices))
    validator = validators.and_(*checks) if checks else None
    if validator is not None and default is None:
        validator = validators.optional(validator)
    if factory is not None:
        default = attrs.Factory(factory)
    return attrs.field(
        default=default,
        validator=validator,
        converter=converter,
        repr=not secret,
        metadata={METADATA_KEY: meta},
    )


def complete_settings(cls: type, fields: list[attrs.Attribute]) -> list[attrs.Attribute]:
    """Fill each field's ``Setting`` in from its name, default and type."""
    out = []
    for field in fields:
        meta = field.metadata.get(METADATA_KEY)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{field.name} is not declared with setting()")
        text_format = meta.format or _FORMAT_OF_TYPE.get(field.type)
        if text_format is None:
            raise TypeError(f"{cls.__name__}.{field.name}: no text format for {field.type!r}")
        default = field.default
        if isinstance(default, attrs.Factory):
            default = default.factory()
        meta = attrs.evolve(
            meta,
            name=field.name,
            flag="--" + field.name.replace("_", "-"),
            env=ENV_PREFIX + field.name.upper(),
            default=default,
            format=text_format,
        )
        out.append(field.evolve(metadata={**field.metadata, METADATA_KEY: meta}))
    return out
