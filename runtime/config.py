"""The one configuration type behind both ways to start the server.

``ServerConfig`` is an attrs class structured by cattrs from either the
``mlx-trio-server`` command line (mlx_lm.server's flags, same names and
defaults) or ``MLX_TRIO_<SETTING>`` environment variables (for
``hypercorn api:app --worker-class trio``). Values arriving as strings are
parsed by the converter's hooks; a bad value raises ``ConfigError`` naming the
setting.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

import attrs
import cattrs
from cattrs.errors import ClassValidationError

ENV_PREFIX = "MLX_TRIO_"
DEFAULT_QUANTIZED_KV_START = 5000
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(ValueError):
    pass


ENGINE_MODES = ("process", "thread")


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


def _positive(instance, attribute, value):
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


@attrs.frozen(kw_only=True)
class ServerConfig:
    # --- mlx_lm.server's flags, same names and defaults
    model: str | None = None
    adapter_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    allowed_origins: tuple[str, ...] = ("*",)
    draft_model: str | None = None
    num_draft_tokens: int = 3
    trust_remote_code: bool = False
    log_level: str = attrs.field(default="INFO")
    chat_template: str = ""
    use_default_chat_template: bool = False
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = attrs.field(default=512, validator=_positive)
    chat_template_args: dict[str, Any] = attrs.field(factory=dict)
    decode_concurrency: int = attrs.field(default=32, validator=_positive)
    prompt_concurrency: int = attrs.field(default=8, validator=_positive)
    prefill_step_size: int = attrs.field(default=2048, validator=_positive)
    prompt_cache_size: int = 10
    prompt_cache_bytes: int | None = None
    kv_bits: int | None = attrs.field(default=None)
    kv_group_size: int = attrs.field(default=64)
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    pipeline: bool = False
    # --- ours
    max_queued_requests: int = attrs.field(default=256, validator=_positive)
    max_request_bytes: int = attrs.field(default=8 * 2**20, validator=_positive)
    tokenizer_threads: int = attrs.field(default=2, validator=_positive)
    request_timeout: float | None = attrs.field(default=None, validator=_positive)
    kv_cache_budget_bytes: int | None = attrs.field(default=None, validator=_positive)
    distributed_backend: str = attrs.field(default="any")
    distributed_timeout: float = attrs.field(default=60.0, validator=_positive)
    engine_mode: str = attrs.field(default="process")
    admission_window_ms: float = attrs.field(default=30.0)
    prompt_cache_min_reuse: int = attrs.field(default=64)
    stream_interval_ms: float = attrs.field(default=0.0)

    @kv_bits.validator
    def _check_kv_bits(self, attribute, value):
        if value is not None and value not in (2, 3, 4, 5, 6, 8):
            raise ValueError("kv_bits must be one of 2, 3, 4, 5, 6, 8")

    @kv_group_size.validator
    def _check_kv_group_size(self, attribute, value):
        if value not in (32, 64, 128):
            raise ValueError("kv_group_size must be 32, 64 or 128")

    @log_level.validator
    def _check_log_level(self, attribute, value):
        if value.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")

    @admission_window_ms.validator
    def _check_admission_window(self, attribute, value):
        if not 0 <= value <= 1000:
            raise ValueError("admission_window_ms must be between 0 and 1000")

    @stream_interval_ms.validator
    def _check_stream_interval(self, attribute, value):
        if not 0 <= value <= 1000:
            raise ValueError("stream_interval_ms must be between 0 and 1000")

    @prompt_cache_min_reuse.validator
    def _check_min_reuse(self, attribute, value):
        if value < 0:
            raise ValueError("prompt_cache_min_reuse must be 0 or more")

    @engine_mode.validator
    def _check_engine_mode(self, attribute, value):
        if value not in ENGINE_MODES:
            raise ValueError(f"engine_mode must be one of {', '.join(ENGINE_MODES)}")

    @distributed_backend.validator
    def _check_backend(self, attribute, value):
        from runtime.distributed import BACKENDS

        if value not in BACKENDS:
            raise ValueError(f"distributed_backend must be one of {', '.join(BACKENDS)}")

    def unsupported(self, *, distributed: bool | None = None) -> list[str]:
        """Settings this process cannot honour: start-up refuses them.

        ``distributed``: whether a launcher started this process as one rank
        of several (read from the environment when not given).
        """
        from runtime.distributed import launched_rank

        if distributed is None:
            distributed = launched_rank() is not None
        problems = []
        if self.pipeline and not distributed:
            problems.append(
                "--pipeline splits the model's layers across the ranks of a distributed "
                "launch: start the server with mlx.launch (see docs/distributed.md)"
            )
        if distributed:
            if self.pipeline and self.distributed_backend == "nccl":
                from runtime.distributed import PIPELINE_ON_GPU

                problems.append(PIPELINE_ON_GPU)
            if not self.model:
                problems.append("distributed serving needs --model (a model that can be sharded)")
            for name, flag in (
                ("adapter_path", "--adapter-path"),
                ("draft_model", "--draft-model"),
                ("kv_bits", "--kv-bits"),
            ):
                if getattr(self, name) is not None:
                    problems.append(f"{flag} is not supported in distributed serving")
        return problems


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)

    def bool_hook(value, _):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"not a boolean: {value!r}")

    def number_hook(kind):
        def hook(value, _):
            if isinstance(value, bool):
                raise ValueError(f"not a number: {value!r}")
            if kind is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(f"not an integer: {value!r}")
            return kind(value)

        return hook

    def optional_int_hook(value, _):
        if value is None or (isinstance(value, str) and value.strip() == ""):
            return None
        if isinstance(value, str):
            return parse_size(value)
        return number_hook(int)(value, int)

    def origins_hook(value, _):
        if isinstance(value, str):
            value = value.split(",")
        return tuple(v.strip() for v in value if v.strip())

    def json_dict_hook(value, _):
        if isinstance(value, str):
            value = json.loads(value) if value.strip() else {}
        if not isinstance(value, Mapping):
            raise ValueError("must be a JSON object")
        return dict(value)

    conv.register_structure_hook(bool, bool_hook)
    conv.register_structure_hook(int, number_hook(int))
    conv.register_structure_hook(float, number_hook(float))
    conv.register_structure_hook(int | None, optional_int_hook)

    def optional_float_hook(value, _):
        if value is None or (isinstance(value, str) and value.strip() == ""):
            return None
        return number_hook(float)(value, float)

    conv.register_structure_hook(float | None, optional_float_hook)
    conv.register_structure_hook_func(lambda t: t == tuple[str, ...], origins_hook)
    conv.register_structure_hook_func(lambda t: t == dict[str, Any], json_dict_hook)
    return conv


def _describe(exc: BaseException, type_) -> str:
    if isinstance(exc, ValueError | TypeError) and str(exc):
        return str(exc)
    return cattrs.v.format_exception(exc, type_)


converter = _make_converter()
FIELD_NAMES = tuple(a.name for a in attrs.fields(ServerConfig))


def config_from_mapping(values: Mapping[str, Any]) -> ServerConfig:
    try:
        return converter.structure(dict(values), ServerConfig)
    except ClassValidationError as exc:
        messages = cattrs.transform_error(exc, format_exception=_describe)
        raise ConfigError("; ".join(m.removesuffix(" @ $") for m in messages)) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from None


def config_from_env(environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Read ``MLX_TRIO_<SETTING>`` variables (e.g. ``MLX_TRIO_MAX_TOKENS=256``)."""
    environ = os.environ if environ is None else environ
    values = {}
    for name in FIELD_NAMES:
        key = ENV_PREFIX + name.upper()
        if key in environ:
            values[name] = environ[key]
    unknown = sorted(
        k
        for k in environ
        if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX) :].lower() not in FIELD_NAMES
    )
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
    return config_from_mapping(values)
