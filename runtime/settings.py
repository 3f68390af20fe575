"""How a setting is declared: the metadata every presentation of a setting reads.

``setting(default, help=..., group=..., ...)`` returns an attrs field whose
metadata is a ``Setting``: help, the ``Group`` it is listed under (one of
``GROUPS``, the sections of ``--help`` and of docs/configuration.md, declared
here), text format, bounds (which also become the field's attrs validators:
``gt``/``ge``/``le``/``in_``), whether it is ours or mlx_lm.server's, and
notes for the docs. ``complete_settings``, the class's
``field_transformer``, fills in what follows from the field: its name, flag
(``--max-tokens``), environment variable (``MLX_TRIO_MAX_TOKENS``), default,
and the text format its type implies, and lists the fields group by group.
``TextFormat`` parses a flag's or a variable's text (``"4GB"``, ``"a,b"``,
``"true"``). ``Settings(cls)`` lists a class's settings and makes the class
from values or environment variables through a strict cattrs converter,
raising ``ConfigError``. ``runtime.config`` declares ``ServerConfig`` with
these (its Advanced tuning settings in ``runtime.tuning_settings``); nothing
here knows its fields.
"""

import json
from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

import attrs
import cattrs
from attrs import validators
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn, override

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


def parse_duration(text: str) -> float:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"45s"``, ``"3600"`` -> seconds (bare: seconds)."""
    units = {"": 1, "S": 1, "M": 60, "H": 3600, "D": 86400}
    text = text.strip()
    number = text.rstrip("dhmsDHMS")
    try:
        return float(number) * units[text[len(number) :].strip().upper()]
    except (ValueError, KeyError):
        raise ValueError(f"not a duration: {text!r} (use e.g. 30d, 12h, 90m or 3600)") from None


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
DURATION = TextFormat("duration", parse_duration)
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


@attrs.frozen
class Group:
    """Settings a user looks for together: a section of ``--help`` (an argparse
    argument group) and of docs/configuration.md's tables."""

    title: str
    description: str  # one line, printed under the title


# The sections of --help and of docs/configuration.md's tables, in this order; each
# field names its own (``group=``), and within a group the fields keep their order.
MODEL = Group(
    "Model", "the served model, its adapter, draft model and chat template; what requests may name"
)
SERVER = Group("Server", "where and how the server runs: address, CORS, logs, engine, shutdown")
SAMPLING = Group("Sampling defaults", "for a request that does not send its own")
BATCHING = Group("Batching", "how many sequences the engine decodes and prefills together")
PROMPT_CACHE = Group("Prompt cache", "reuse of earlier prompts' KV caches for shared prefixes")
LIMITS = Group("Limits", "how much a request, and all of them together, may ask for")
STORED = Group("Stored responses", "what the Responses API keeps for previous_response_id and GET")
EMBEDDINGS = Group(
    "Embeddings", "an embedding model served at /v1/embeddings beside the chat model"
)
SECURITY = Group("Security", "who may call the API: API keys")
DISTRIBUTED = Group("Distributed", "one model served by several processes started by mlx.launch")
TUNING = Group(
    "Advanced tuning", "scheduling, streaming, kernels, KV quantization: the defaults suit most uses"
)
GROUPS = (MODEL, SERVER, SAMPLING, BATCHING, PROMPT_CACHE, LIMITS, STORED, EMBEDDINGS, SECURITY,
          DISTRIBUTED, TUNING)
_GROUP_ORDER = {group: index for index, group in enumerate(GROUPS)}


@attrs.frozen(kw_only=True)
class Setting:
    """One field's metadata. ``name``, ``flag``, ``env``, ``default`` and (when not
    given) ``format`` are filled in from the field when the class is made."""

    help: str
    group: Group
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
    group: Group,
    factory: Callable[[], Any] | None = None,
    converter: Callable[[Any], Any] | None = None,
    secret: bool = False,
    **more: Any,
) -> Any:
    """A ``ServerConfig`` field: its ``Setting`` metadata and the validators it implies.

    ``secret``: the value is left out of the config's ``repr`` (API keys)."""
    meta = Setting(help=help, group=group, **more)
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
    """Fill each field's ``Setting`` in from its name, default and type; list the fields
    group by group in ``GROUPS``' order, each group's in declaration order (so that a
    class's inherited settings, which attrs puts first, take their group's place)."""
    out = []
    for field in fields:
        meta = field.metadata.get(METADATA_KEY)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{field.name} is not declared with setting()")
        if meta.group not in _GROUP_ORDER:
            raise TypeError(f"{cls.__name__}.{field.name}: its group is not one of GROUPS")
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
    return sorted(out, key=lambda field: _GROUP_ORDER[field.metadata[METADATA_KEY].group])


# ----------------------------------------------------------------- reading


class ConfigError(ValueError):
    """A value that its setting does not take, or a name that is no setting's; the
    message names the setting."""


class Settings:
    """The settings of a class declared with ``setting()``, in declaration order, and
    how the class is made from text or values.

    A value that is text (a flag's, a variable's) is parsed by its setting's format;
    any other must have the field's type (no ``"1"`` for ``True``, no ``2.5`` for an
    integer); an unknown name fails. The errors are one ``ConfigError``, each part
    naming its setting (``max_tokens: ...; unknown setting(s): ...``)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.all: tuple[Setting, ...] = tuple(f.metadata[METADATA_KEY] for f in attrs.fields(cls))
        self.by_name = {s.name: s for s in self.all}
        self.converter = self._converter()

    def from_mapping(self, values: Mapping[str, Any]) -> Any:
        """The class from setting names to values."""
        try:
            return self.converter.structure(dict(values), self.cls)
        except ClassValidationError as exc:
            lines = cattrs.transform_error(exc, path="", format_exception=_describe)
            messages = []
            for line in lines:
                message, _, path = line.rpartition(" @ ")
                messages.append(f"{path.removeprefix('.')}: {message}" if path else message)
            raise ConfigError("; ".join(messages)) from None

    def from_env(self, environ: Mapping[str, str]) -> Any:
        """The class from ``MLX_TRIO_<NAME>`` variables; another ``MLX_TRIO_`` one fails."""
        values = {s.name: environ[s.env] for s in self.all if s.env in environ}
        known = {s.env for s in self.all}
        unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
        return self.from_mapping(values)

    def _converter(self) -> cattrs.Converter:
        conv = cattrs.Converter(forbid_extra_keys=True)
        conv.register_structure_hook(bool, _strict_bool)
        conv.register_structure_hook(int, _strict_number(int))
        conv.register_structure_hook(float, _strict_number(float))

        def field_hook(meta: Setting) -> Callable[[Any, Any], Any]:
            def hook(value: Any, type_: Any) -> Any:
                if isinstance(value, str):
                    return meta.format(value)  # text, as a flag or a variable gives it
                return conv.structure(value, type_)

            return hook

        hooks = {s.name: override(struct_hook=field_hook(s)) for s in self.all}
        conv.register_structure_hook(self.cls, make_dict_structure_fn(self.cls, conv, **hooks))
        return conv


def _strict_bool(value: Any, _: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"not a boolean: {value!r}")
    return value


def _strict_number(kind: type) -> Callable[[Any, Any], Any]:
    def hook(value: Any, _: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"not a number: {value!r}")
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(f"not an integer: {value!r}")
        return kind(value)

    return hook


def _describe(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"unknown setting(s): {', '.join(sorted(exc.extra_fields))}"
    if isinstance(exc, ValueError | TypeError) and exc.args and isinstance(exc.args[0], str):
        return exc.args[0]  # attrs validators add the attribute, the bounds, the value
    return cattrs.v.format_exception(exc, type_)
