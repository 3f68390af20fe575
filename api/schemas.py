"""Request types of the OpenAI endpoints, as attrs classes.

Structured from JSON bodies by ``api.convert`` (cattrs, strict types). Each
field's bounds are stated once, on the field (``api.constraints``:
``bounded``, ``constrained``): its attrs validator checks them, raising
``InvalidParam``, which becomes a 400 naming the field, and ``api.openapi``
documents the same statement. Unknown fields are ignored: real clients send
many.
"""

from __future__ import annotations

from typing import Any

import attrs

from api.constraints import (
    REASONING_EFFORT,
    STOP_SEQUENCES,
    TEMPERATURE,
    TIMEOUT,
    TOKEN_LIMIT,
    TOP_K,
    TOP_P,
    bounded,
    constrained,
    constrained_by,
)
from api.errors import InvalidParam
from api.structured import (
    RESPONSE_FORMAT_TYPES,
    TOOL_CHOICE_MODES,
    check_response_format,
    check_tool_choice,
)

MAX_TOP_LOGPROBS = 20
MAX_CONTEXT_SIZE = 2**31 - 1  # penalty windows are sliced with 32-bit indices
ROLES = ("system", "user", "assistant", "tool", "developer")


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
class ImageUrlIn:
    url: str  # a data: URL, or http(s) when the server allows fetching
    detail: str | None = None  # OpenAI's resolution hint; the model's processor decides


@attrs.frozen(kw_only=True)
class ContentPart:
    type: str = constrained(
        choices=("text", "image_url"),
        message="content part type {value!r} is not supported ('text' or 'image_url')",
    )
    text: str | None = None  # required for 'text' parts (api.images checks)
    image_url: ImageUrlIn | None = None  # required for 'image_url' parts


@attrs.frozen(kw_only=True)
class ChatMessage:
    role: str = constrained(choices=ROLES)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # an assistant turn's thinking, as this server returns it (both names)
    reasoning_content: str | None = None
    reasoning: str | None = None


@attrs.frozen(kw_only=True)
class GenerationFields:
    """Fields shared by chat and text completions (mlx_lm.server's set)."""

    model: str = "default_model"
    max_tokens: int | None = constrained_by(TOKEN_LIMIT)
    # OpenAI's newer name; wins over max_tokens
    max_completion_tokens: int | None = constrained_by(TOKEN_LIMIT)
    temperature: float | None = constrained_by(TEMPERATURE)
    top_p: float | None = constrained_by(TOP_P)
    top_k: int | None = constrained_by(TOP_K)
    min_p: float | None = bounded(0, 1)
    stop: str | list[str] | None = constrained_by(STOP_SEQUENCES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = bounded(0, 2**63 - 1)
    n: int = bounded(1, default=1)  # at most the server's --max-choices (the route checks)
    xtc_probability: float = bounded(0, 1, default=0.0)
    xtc_threshold: float = bounded(0, 0.5, default=0.1)
    repetition_penalty: float = bounded(0, default=0.0)
    repetition_context_size: int = bounded(0, MAX_CONTEXT_SIZE, default=20)
    presence_penalty: float = bounded(-2, 2, default=0.0)
    presence_context_size: int = bounded(0, MAX_CONTEXT_SIZE, default=20)
    frequency_penalty: float = bounded(-2, 2, default=0.0)
    frequency_context_size: int = bounded(0, MAX_CONTEXT_SIZE, default=20)
    logit_bias: dict[str, float] | None = bounded(-100, 100, keys=("token ids", r"-?[0-9]+"))
    timeout: float | None = constrained_by(TIMEOUT)
    cache_salt: str | None = None  # ours (vLLM's): reuse only prompt-cache entries of this salt
    adapters: str | None = None  # a LoRA adapter directory
    draft_model: str | None = None  # a draft model for speculative decoding
    num_draft_tokens: int | None = bounded(1, 64)

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

    @property
    def token_limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


def _function_tools(name: str, tools: list[Any]) -> None:
    """Each tool is ``{"type": "function", "function": {"name": ..., ...}}`` (OpenAI's
    required fields; the rest is the chat template's to render)."""
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidParam(f"{name}[{i}]", f"{name} must be function tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            at = f"{name}[{i}].function"
            raise InvalidParam(at, f"{at}: is required (an object with the function's name)")
        if not isinstance(function.get("name"), str) or not function["name"]:
            at = f"{name}[{i}].function.name"
            raise InvalidParam(at, f"{at}: is required (a non-empty string)")


@attrs.frozen(kw_only=True)
class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = constrained(nonempty=True)
    logprobs: bool = False
    top_logprobs: int | None = bounded(0, MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = constrained(
        None,
        check=_function_tools,
        schema={
            "array": {
                "items": {
                    "type": "object",
                    "required": ["function"],
                    "properties": {
                        "type": {"const": "function"},
                        "function": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"name": {"type": "string", "minLength": 1}},
                        },
                    },
                    "description": "a function tool, as OpenAI defines it",
                }
            }
        },
    )
    # Enforced by constrained decoding (docs/structured-outputs.md); compiled against
    # the model's tokenizer when the prompt is prepared (400s name what cannot be enforced).
    response_format: dict[str, Any] | None = constrained(
        None,
        check=check_response_format,
        schema={
            "object": {
                "properties": {
                    "type": {"enum": list(RESPONSE_FORMAT_TYPES)},
                    "json_schema": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "schema": {"type": "object"},
                            "strict": {"type": "boolean"},
                        },
                    },
                },
                "required": ["type"],
                "description": "text, any JSON object, or a document valid against a JSON Schema",
            }
        },
    )
    tool_choice: str | dict[str, Any] | None = constrained(
        None,
        check=check_tool_choice,
        schema={
            "string": {"enum": list(TOOL_CHOICE_MODES)},
            "object": {
                "required": ["type", "function"],
                "properties": {
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    },
                },
                "description": "exactly one call of the named function",
            },
        },
    )
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = constrained_by(REASONING_EFFORT)
    chat_template_kwargs: dict[str, Any] | None = None
    role_mapping: dict[str, str] | None = None


@attrs.frozen(kw_only=True)
class CompletionRequest(GenerationFields):
    prompt: str | list[int] = constrained(
        nonempty=True,
        # documentation only: the Session checks the ids against the model's vocabulary
        schema={"array": {"items": {"type": "integer", "minimum": 0}}},
    )
    # An integer N (OpenAI's legacy form): the sampled token's logprob and the N most
    # likely; true / false (mlx_lm.server's form): per-token logprobs as chat gives them.
    logprobs: bool | int | None = bounded(0, MAX_TOP_LOGPROBS)
    top_logprobs: int | None = bounded(0, MAX_TOP_LOGPROBS)  # with logprobs: true
    echo: bool = constrained(False, choices=(False,), message="echo is not supported")

    @property
    def logprobs_form(self) -> str | None:
        """``"legacy"`` (an integer), ``"content"`` (true, or ``top_logprobs`` alone) or None."""
        if isinstance(self.logprobs, bool):
            return "content" if self.logprobs or self.top_logprobs else None
        if self.logprobs is not None:
            return "legacy"
        return "content" if self.top_logprobs else None

    @property
    def top_logprobs_wanted(self) -> int:
        if self.logprobs_form == "legacy":
            return int(self.logprobs)
        return self.top_logprobs or 0


@attrs.frozen(kw_only=True)
class TokenizeRequest:
    """``POST /tokenize``: ``prompt`` (text, as completions encode it) or ``messages``
    (rendered by the chat template, as chat completions do), not both."""

    model: str = "default_model"
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = constrained(None, nonempty=True)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = constrained(None, check=_function_tools)
    chat_template_kwargs: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class DetokenizeRequest:
    """``POST /detokenize``: token ids back to text."""

    model: str = "default_model"
    tokens: list[int] = constrained(
        schema={"array": {"items": {"type": "integer", "minimum": 0}}}
    )


EMBEDDING_INPUT_KINDS = (
    "a string, an array of strings, an array of token ids or an array of arrays of token ids"
)
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}


def embedding_inputs(value: Any) -> tuple[tuple[str | tuple[int, ...], ...], bool]:
    """``input`` of an embeddings request as a tuple of texts and token-id tuples, and
    whether it was one input (a string or one array of ids) rather than an array of
    them; ``InvalidParam`` naming the element (``input[2]``) for anything else."""
    if isinstance(value, str):
        if not value:
            raise InvalidParam("input", "input must not be an empty string")
        return (value,), True
    if not isinstance(value, list):
        raise InvalidParam("input", f"input must be {EMBEDDING_INPUT_KINDS}")
    if not value:
        raise InvalidParam("input", "input must not be an empty array")
    if all(_is_token_id(item) for item in value):
        return (tuple(value),), True
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise InvalidParam(f"input[{i}]", f"input[{i}] must not be an empty string")
            out.append(item)
        elif isinstance(item, list):
            if not item:
                raise InvalidParam(f"input[{i}]", f"input[{i}] must not be an empty array")
            for k, token in enumerate(item):
                if not _is_token_id(token):
                    raise InvalidParam(
                        f"input[{i}][{k}]", f"input[{i}][{k}] must be a token id (an integer >= 0)"
                    )
            out.append(tuple(item))
        else:
            raise InvalidParam(
                f"input[{i}]", f"input[{i}] must be a string or an array of token ids"
            )
    return tuple(out), False


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_embedding_input(name: str, value: Any) -> None:
    embedding_inputs(value)


@attrs.frozen(kw_only=True)
class EmbeddingRequest:
    """``POST /v1/embeddings``: OpenAI's fields; ``dimensions`` only where the model
    allows it (docs/models.md#embeddings)."""

    model: str
    input: Any = constrained(
        attrs.NOTHING,
        required=True,
        check=_check_embedding_input,
        schema={"*": {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            _TOKEN_IDS,
            {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
        ]}},
    )
    encoding_format: str = constrained("float", choices=("float", "base64"))
    dimensions: int | None = bounded(1)
    user: str | None = None
