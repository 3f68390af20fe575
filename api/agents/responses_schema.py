"""Request types of the OpenAI Responses API (``POST /v1/responses``), as attrs classes.

Structured from JSON bodies by ``api.convert`` like the completion requests
(``api.schemas``): strict types, and each field's bounds stated once on the
field (``api.constraints``), checked by its attrs validator (a 400 naming
the field) and documented from the same statement in ``/openapi.json``.
``input`` items are checked where they are read (``api.agents.responses_input``):
they are free-form objects of many kinds. Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any

import attrs

from api.constraints import (
    REASONING_EFFORT,
    TEMPERATURE,
    TIMEOUT,
    TOKEN_LIMIT,
    TOP_P,
    constrained,
    constrained_by,
)
from api.errors import InvalidParam

TOOL_CHOICES = ("auto", "none", "required")
TEXT_FORMATS = ("text", "json_schema", "json_object")
ITEM_ROLES = ("user", "assistant", "system", "developer")  # developer: sent as system
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# Tool types some clients always send that a local model cannot serve: accepted
# and left out of the prompt (see docs/api.md). Any other non-function type is a 400.
IGNORED_TOOL_TYPES = ("web_search", "web_search_preview", "image_generation")

# What /openapi.json says of ``input`` and ``tools``, which api.agents.responses_input
# checks as it reads them (documentation only: the statement of what it accepts).
_PARTS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"enum": list(TEXT_PARTS)}, "text": {"type": "string"}},
    },
}
_TEXT = {"anyOf": [{"type": "string"}, _PARTS]}


def _item(kind: str, required: list[str], **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "required": required,
        "properties": {"type": {"const": kind}, **properties},
    }


INPUT_DOC = {
    "*": {"description": "a string (one user message) or input items; empty only with "
          "previous_response_id"},
    "string": {"minLength": 1},
    "array": {
        "minItems": 1,
        "items": {"anyOf": [
            _item("message", ["role", "content"], role={"enum": list(ITEM_ROLES)}, content=_TEXT),
            _item("function_call", ["type", "call_id", "name", "arguments"],
                  call_id={"type": "string"}, name={"type": "string"},
                  arguments={"type": "string", "contentMediaType": "application/json",
                             "contentSchema": {"type": "object"}}),
            _item("function_call_output", ["type", "call_id", "output"],
                  call_id={"type": "string"}, output=_TEXT),
            _item("reasoning", ["type"], content=_PARTS, summary=_PARTS),
        ]},
    },
}
TOOLS_DOC = {
    "array": {
        "items": {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"enum": ["function", "namespace", *IGNORED_TOOL_TYPES]},
                "name": {"type": "string"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
                "tools": {"type": "array", "items": {"type": "object"}},
            },
            "description": "a function tool; a namespace of function tools (name, tools); "
            "or a tool type accepted and left out",
        }
    }
}


def unsupported(message: str) -> Any:
    """A field refused (400 with ``message``) unless it is null or absent."""

    def refuse(name: str, value: Any) -> None:
        raise InvalidParam(name, message)

    return constrained(None, check=refuse, schema={"*": {"type": "null"}})


def _tool_choice(name: str, value: Any) -> None:
    if isinstance(value, str) and value not in TOOL_CHOICES:
        raise InvalidParam(name, f"{name} must be auto, none or required")
    if isinstance(value, dict) and value.get("type") == "function":
        named = value.get("name")
        if not isinstance(named, str) or not named:
            raise InvalidParam(f"{name}.name", f"{name}.name: is required for type 'function'")


def _named_schema(name: str, value: TextFormatIn) -> None:
    if value.type == "json_schema" and (value.schema is None or not value.name):
        raise InvalidParam(name, f"{name} of type json_schema needs 'name' and 'schema'")


@attrs.frozen(kw_only=True)
class TextFormatIn:
    type: str = constrained(choices=TEXT_FORMATS)
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


@attrs.frozen(kw_only=True)
class TextConfigIn:
    format: TextFormatIn | None = constrained(None, check=_named_schema)
    verbosity: str | None = None


@attrs.frozen(kw_only=True)
class ReasoningIn:
    effort: str | None = constrained_by(REASONING_EFFORT)
    summary: str | None = None


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    """POST /v1/responses. Unknown fields are ignored; see docs/api.md (Agent APIs)."""

    model: str = "default_model"
    input: str | list[dict[str, Any]] = constrained("", schema=INPUT_DOC)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = constrained(None, schema=TOOLS_DOC)
    tool_choice: str | dict[str, Any] | None = constrained(
        None, check=_tool_choice, schema={"string": {"enum": list(TOOL_CHOICES)}}
    )
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = constrained_by(TOKEN_LIMIT)
    temperature: float | None = constrained_by(TEMPERATURE)
    top_p: float | None = constrained_by(TOP_P)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool | None = constrained(
        None, choices=(False,), message="background responses are not supported"
    )
    text: TextConfigIn | None = None
    reasoning: ReasoningIn | None = None
    metadata: dict[str, Any] | None = None
    conversation: Any = unsupported("conversations are not supported: use previous_response_id")
    prompt: Any = unsupported("prompt templates are not supported")
    chat_template_kwargs: dict[str, Any] | None = None  # ours, as on chat completions
    timeout: float | None = constrained_by(TIMEOUT)  # ours, as on chat completions
    cache_salt: str | None = None  # ours, as on chat completions
