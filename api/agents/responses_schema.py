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

from api.constraints import bounded, constrained
from api.errors import InvalidParam

TOOL_CHOICES = ("auto", "none", "required")
TEXT_FORMATS = ("text", "json_schema", "json_object")


def unsupported(message: str) -> Any:
    """A field refused (400 with ``message``) unless it is null or absent."""

    def refuse(name: str, value: Any) -> None:
        raise InvalidParam(name, message)

    return constrained(None, check=refuse, schema={"*": {"type": "null"}})


def _tool_choice(name: str, value: Any) -> None:
    if isinstance(value, str) and value not in TOOL_CHOICES:
        raise InvalidParam(name, f"{name} must be auto, none or required")


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
    effort: str | None = None
    summary: str | None = None


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    """POST /v1/responses. Unknown fields are ignored; see docs/api.md (Agent APIs)."""

    model: str = "default_model"
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = constrained(
        None, check=_tool_choice, schema={"string": {"enum": list(TOOL_CHOICES)}}
    )
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = bounded(1)
    temperature: float | None = bounded(0)
    top_p: float | None = bounded(0, 1)
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
    timeout: float | None = bounded(0.001)  # ours, as on chat completions
