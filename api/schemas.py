"""Request types of the OpenAI endpoints, as attrs classes.

Structured from JSON bodies by ``api.convert`` (cattrs, strict types); the
ranges are checked by each class's ``validate()``, which raises ``ClientError``
naming the field. Unknown fields are ignored: real clients send many.
"""

from __future__ import annotations

import math
import re
from typing import Any

import attrs

from runtime.errors import ClientError

MAX_TOP_LOGPROBS = 20
MAX_CONTEXT_SIZE = 2**31 - 1  # penalty windows are sliced with 32-bit indices


@attrs.frozen(kw_only=True)
class StreamOptions:
    include_usage: bool = False


@attrs.frozen(kw_only=True)
class FunctionCallIn:
    name: str
    arguments: Any = "{}"  # a JSON string (OpenAI) or an object


@attrs.frozen(kw_only=True)
class ToolCallIn:
    function: FunctionCallIn
    id: str | None = None
    type: str = "function"


@attrs.frozen(kw_only=True)
class ContentPart:
    type: str
    text: str | None = None


@attrs.frozen(kw_only=True)
class ChatMessage:
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


@attrs.frozen(kw_only=True)
class GenerationFields:
    """Fields shared by chat and text completions (mlx_lm.server's set)."""

    model: str = "default_model"
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    n: int = 1
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: dict[str, float] | None = None
    timeout: float | None = None  # seconds; ours: ends the request with "length"
    adapters: str | None = None  # a LoRA adapter directory
    draft_model: str | None = None  # a draft model for speculative decoding
    num_draft_tokens: int | None = None

    def validate(self) -> None:
        _range("max_tokens", self.max_tokens, low=1)
        _range("timeout", self.timeout, low=0.001)
        _range("num_draft_tokens", self.num_draft_tokens, low=1, high=64)
        _range("temperature", self.temperature, low=0)
        _range("top_p", self.top_p, low=0, high=1)
        _range("top_k", self.top_k, low=0)
        _range("min_p", self.min_p, low=0, high=1)
        _range("seed", self.seed, low=0, high=2**63 - 1)
        _range("xtc_probability", self.xtc_probability, low=0, high=1)
        _range("xtc_threshold", self.xtc_threshold, low=0, high=0.5)
        _range("repetition_penalty", self.repetition_penalty, low=0)
        _range("repetition_context_size", self.repetition_context_size, low=0, high=MAX_CONTEXT_SIZE)
        _range("presence_context_size", self.presence_context_size, low=0, high=MAX_CONTEXT_SIZE)
        _range("frequency_context_size", self.frequency_context_size, low=0, high=MAX_CONTEXT_SIZE)
        _range("presence_penalty", self.presence_penalty, low=-2, high=2)
        _range("frequency_penalty", self.frequency_penalty, low=-2, high=2)
        if self.n != 1:
            raise ClientError("only n=1 is supported", param="n")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ClientError("stop takes at most 16 strings", param="stop")
        if self.logit_bias:
            for key, value in self.logit_bias.items():
                if not re.fullmatch(r"-?[0-9]+", key):
                    raise ClientError(
                        f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                    )
                _range(f"logit_bias.{key}", value, low=-100, high=100, param="logit_bias")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


@attrs.frozen(kw_only=True)
class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    role_mapping: dict[str, str] | None = None

    def validate(self) -> None:
        super().validate()
        _range("max_completion_tokens", self.max_completion_tokens, low=1)
        _range("top_logprobs", self.top_logprobs, low=0, high=MAX_TOP_LOGPROBS)
        if not self.messages:
            raise ClientError("messages must not be empty", param="messages")
        for i, message in enumerate(self.messages):
            if message.role not in ("system", "user", "assistant", "tool", "developer"):
                raise ClientError(
                    f"messages[{i}].role must be system, user, assistant, tool or developer",
                    param=f"messages[{i}].role",
                )
            if isinstance(message.content, list):
                for j, part in enumerate(message.content):
                    if part.type != "text":
                        raise ClientError(
                            f"content part type {part.type!r} is not supported (only 'text')",
                            param=f"messages[{i}].content[{j}].type",
                        )
                    if part.text is None:
                        raise ClientError(
                            "a text content part needs 'text'",
                            param=f"messages[{i}].content[{j}].text",
                        )
        if self.tools is not None:
            for i, tool in enumerate(self.tools):
                if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                    raise ClientError("tools must be function tools", param=f"tools[{i}]")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


@attrs.frozen(kw_only=True)
class CompletionRequest(GenerationFields):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False

    def validate(self) -> None:
        super().validate()
        _range("logprobs", self.logprobs, low=0, high=MAX_TOP_LOGPROBS)
        if self.echo:
            raise ClientError("echo is not supported", param="echo")
        if isinstance(self.prompt, str) and not self.prompt:
            raise ClientError("prompt must not be empty", param="prompt")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ClientError("prompt must not be empty", param="prompt")

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


def _range(name, value, *, low=None, high=None, param=None) -> None:
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ClientError(f"{name} must be a finite number", param=param or name)
    if low is not None and value < low:
        raise ClientError(f"{name} must be at least {low}, got {value}", param=param or name)
    if high is not None and value > high:
        raise ClientError(f"{name} must be at most {high}, got {value}", param=param or name)
