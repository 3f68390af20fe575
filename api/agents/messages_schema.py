"""Request types of the Anthropic Messages API, as attrs classes.

``MessagesRequest`` (``POST /v1/messages``) and ``CountTokensRequest``
(``POST /v1/messages/count_tokens``: the fields that shape the prompt) are
structured from JSON bodies by ``api.convert`` like the completion requests
(``api.schemas``): strict types, and each field's bounds and allowed values
stated once on the field (``api.constraints``), checked by its attrs
validator (a 400 naming the field) and documented from the same statement in
``/openapi.json``. Which content blocks a message may hold is checked where
they are read (``api.agents.messages_input``). Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any

import attrs

from api.constraints import (
    STOP_SEQUENCES,
    TEMPERATURE,
    TIMEOUT,
    TOKEN_LIMIT,
    TOP_K,
    TOP_P,
    constrained,
    constrained_by,
)
from api.errors import InvalidParam

ROLES = ("user", "assistant", "system")  # system: Claude Code's mid-conversation messages


@attrs.frozen(kw_only=True)
class TextBlockIn:
    """A block inside a ``tool_result`` (only text is supported)."""

    type: str
    text: str | None = None


@attrs.frozen(kw_only=True)
class ContentBlockIn:
    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: Any = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[TextBlockIn] | None = None
    is_error: bool | None = None
    # thinking
    thinking: str | None = None
    signature: str | None = None


@attrs.frozen(kw_only=True)
class MessageIn:
    role: str = constrained(choices=ROLES, message="{name} must be 'user', 'assistant' or 'system'")
    content: str | list[ContentBlockIn]


@attrs.frozen(kw_only=True)
class SystemBlockIn:
    type: str = constrained(choices=("text",), message="{name}: only text blocks are supported")
    text: str


@attrs.frozen(kw_only=True)
class ToolIn:
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = constrained(
        None,
        choices=("custom",),
        message="{name}: tool type {value!r} is not supported (only client tools with an "
        "input_schema)",
    )


@attrs.frozen(kw_only=True)
class ToolChoiceIn:
    type: str = constrained(choices=("auto", "any", "tool", "none"))
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


def _named_tool(name: str, value: ToolChoiceIn) -> None:
    if value.type == "tool" and not value.name:
        raise InvalidParam(f"{name}.name", f"{name}.name is required for type 'tool'")


@attrs.frozen(kw_only=True)
class ThinkingIn:
    type: str = constrained(choices=("enabled", "disabled", "adaptive"))
    budget_tokens: int | None = None


@attrs.frozen(kw_only=True)
class OutputConfigIn:
    effort: str | None = None  # "low" | "medium" | "high" | "max"; others are ignored


@attrs.frozen(kw_only=True)
class CountTokensRequest:
    """POST /v1/messages/count_tokens: the fields that shape the prompt. Unknown fields are ignored."""

    model: str
    messages: list[MessageIn] = constrained(
        nonempty=True, message="messages: at least one message is required"
    )
    system: str | list[SystemBlockIn] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = constrained(None, check=_named_tool)
    thinking: ThinkingIn | None = None
    output_config: OutputConfigIn | None = None


@attrs.frozen(kw_only=True)
class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. Unknown fields are ignored; see docs/api.md (Agent APIs)."""

    max_tokens: int = constrained_by(TOKEN_LIMIT, default=attrs.NOTHING)
    stop_sequences: list[str] | None = constrained_by(STOP_SEQUENCES)
    temperature: float | None = constrained_by(TEMPERATURE)
    top_p: float | None = constrained_by(TOP_P)
    top_k: int | None = constrained_by(TOP_K)
    metadata: dict[str, Any] | None = None
    stream: bool = False
    timeout: float | None = constrained_by(TIMEOUT)  # ours, as on chat completions
    cache_salt: str | None = None  # ours, as on chat completions
