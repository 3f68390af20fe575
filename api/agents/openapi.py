"""The agent APIs' part of ``/openapi.json``: their paths and response schemas.

``agent_paths(ref)`` receives the document builder's ``ref`` (an attrs class
-> a ``$ref``, adding its schema to the components: ``api.openapi``) and
emits the path items of ``POST /v1/responses``, ``GET`` / ``DELETE
/v1/responses/{response_id}``, ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens``. Request bodies are the attrs request types
(``api.agents.responses_schema``, ``api.agents.messages_schema``), so their
bounds are the ones validation enforces. The answers are built as plain
objects by the renderers, so ``AGENT_COMPONENTS`` describes them by hand: the
fields clients read, other fields allowed. Streams are ``text/event-stream``
whose schema describes one named event. Errors are ``ErrorResponse`` on the
Responses paths and ``AnthropicError`` under ``/v1/messages``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from api.agents.messages_schema import CountTokensRequest, MessagesRequest
from api.agents.responses_schema import ResponsesRequest
from api.errors import ErrorResponse

COMPONENTS = "#/components/schemas/"

_STRING = {"type": "string"}
_INTEGER = {"type": "integer"}
_NULLABLE_OBJECT = {"type": ["object", "null"]}


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


_RESPONSE_ITEM = {
    **_object(["type", "id", "status"],
              type={"enum": ["message", "reasoning", "function_call"]},
              id=_STRING,
              status={"enum": ["in_progress", "completed", "incomplete"]},
              role={"const": "assistant"},
              content={"type": "array", "items": {"type": "object"}},
              summary={"type": "array"},
              call_id=_STRING,
              name=_STRING,
              arguments=_STRING,
              namespace=_STRING),
    "description": "An output item: a message (output_text parts), reasoning (reasoning_text "
    "parts) or a function call.",
}

_ANTHROPIC_BLOCK = {
    **_object(["type"],
              type={"enum": ["text", "thinking", "tool_use"]},
              text=_STRING,
              thinking=_STRING,
              signature=_STRING,
              id=_STRING,
              name=_STRING,
              input={"type": "object"}),
    "description": "A content block of the answer.",
}

AGENT_COMPONENTS: dict[str, dict[str, Any]] = {
    "Response": {
        **_object(
            ["id", "object", "created_at", "status", "model", "output"],
            id=_STRING,
            object={"const": "response"},
            created_at=_INTEGER,
            status={"enum": ["completed", "incomplete", "failed", "in_progress"]},
            error=_NULLABLE_OBJECT,
            incomplete_details=_NULLABLE_OBJECT,
            model=_STRING,
            output={"type": "array", "items": _RESPONSE_ITEM},
            previous_response_id={"type": ["string", "null"]},
            usage={"anyOf": [
                _object(["input_tokens", "output_tokens", "total_tokens"],
                        input_tokens=_INTEGER, output_tokens=_INTEGER, total_tokens=_INTEGER,
                        input_tokens_details={"type": "object"},
                        output_tokens_details={"type": "object"}),
                {"type": "null"},
            ]},
        ),
        "description": "An OpenAI Responses `response` object (the request's settings are "
        "echoed in further fields).",
    },
    "ResponseDeleted": _object(
        ["id", "object", "deleted"], id=_STRING, object={"const": "response"},
        deleted={"const": True},
    ),
    "Message": {
        **_object(
            ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
            id=_STRING,
            type={"const": "message"},
            role={"const": "assistant"},
            model=_STRING,
            content={"type": "array", "items": _ANTHROPIC_BLOCK},
            stop_reason={"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", None]},
            stop_sequence={"type": ["string", "null"]},
            usage=_object(
                ["input_tokens", "output_tokens"], input_tokens=_INTEGER, output_tokens=_INTEGER,
                cache_read_input_tokens=_INTEGER, cache_creation_input_tokens=_INTEGER,
            ),
        ),
        "description": "An Anthropic Message. usage.input_tokens leaves out the prompt tokens "
        "read from the prompt cache (cache_read_input_tokens).",
    },
    "MessageTokensCount": _object(["input_tokens"], input_tokens=_INTEGER),
    "AnthropicError": {
        **_object(
            ["type", "error"],
            type={"const": "error"},
            error=_object(["type", "message"], type=_STRING, message=_STRING),
        ),
        "description": "The body of every error answer under /v1/messages (Anthropic's shape).",
    },
}

_RETRY_AFTER = {
    "Retry-After": {"description": "seconds to wait before retrying", "schema": _INTEGER}
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(error_ref: dict[str, Any], *statuses: tuple[str, str]) -> dict[str, Any]:
    """Error answers with the error body ``error_ref``; 429 and 503 carry Retry-After."""
    out: dict[str, Any] = {}
    for status, description in (*statuses, ("default", "any other error")):
        answer: dict[str, Any] = {"description": description, "content": _json(error_ref)}
        if status in ("429", "503"):
            answer["headers"] = _RETRY_AFTER
        out[status] = answer
    return out


_GENERATION_ERRORS = (
    ("400", "invalid request: bad JSON, a wrong type or a value out of range (the field is named)"),
    ("404", "the model named is not on this machine"),
    ("413", "the request body, or its KV cache (prompt + max tokens), is over the server's limit"),
    ("429", "the admission queue is full"),
    ("503", "the model is loading, the engine died, or the server is shutting down"),
)


def _events(names: list[str], description: str) -> dict[str, Any]:
    """One named server-sent event (before OpenAPI 3.2, a stream's schema is its events')."""
    return {
        "type": "object",
        "description": description,
        "required": ["event", "data"],
        "properties": {
            "event": {"enum": names},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": _object(["type"], type={"enum": names}),
            },
        },
    }


_RESPONSE_EVENTS = _events(
    [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.output_item.done", "response.content_part.added", "response.content_part.done",
        "response.output_text.delta", "response.output_text.done",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.completed", "response.incomplete", "response.failed",
    ],
    "One event: `event: <type>` and `data: <JSON with type and sequence_number>`; last "
    "response.completed, response.incomplete or response.failed (with the response). "
    "`: keepalive` comments while a long prompt is processed, and response.in_progress "
    "again every 10 s.",
)

_MESSAGE_EVENTS = _events(
    [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop", "ping", "error",
    ],
    "One event: `event: <type>` and `data: <JSON with type>`; last message_stop, or an error "
    "event (an AnthropicError) when generation failed after the stream started.",
)


def _post(
    *, operation_id: str, summary: str, request: dict[str, Any], answer: dict[str, Any],
    errors: dict[str, Any], stream: dict[str, Any] | None = None,
) -> dict[str, Any]:
    content = _json(answer)
    if stream is not None:
        content["text/event-stream"] = {"schema": stream}
    return {
        "post": {
            "operationId": operation_id,
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {"200": {"description": summary, "content": content}, **errors},
        }
    }


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": COMPONENTS + name}


def agent_paths(ref: Callable[[type], dict[str, Any]]) -> dict[str, Any]:
    """The path items of the agent APIs (``ref`` adds the attrs types to the components)."""
    openai_errors = ref(ErrorResponse)
    anthropic_errors = _ref("AnthropicError")
    response_id = {"name": "response_id", "in": "path", "required": True, "schema": _STRING}

    def stored(operation_id: str, summary: str, answer: str) -> dict[str, Any]:
        return {
            "operationId": operation_id,
            "summary": summary,
            "parameters": [response_id],
            "responses": {
                "200": {"description": summary, "content": _json(_ref(answer))},
                **_errors(openai_errors, ("404", "this API key stored no response with this id")),
            },
        }

    return {
        "/v1/responses": _post(
            operation_id="createResponse",
            summary="OpenAI Responses: a response, or its event stream when stream is true",
            request=ref(ResponsesRequest),
            answer=_ref("Response"),
            errors=_errors(openai_errors, *_GENERATION_ERRORS),
            stream=_RESPONSE_EVENTS,
        ),
        "/v1/responses/{response_id}": {
            "get": stored("getResponse", "A stored response", "Response"),
            "delete": stored("deleteResponse", "Remove a stored response", "ResponseDeleted"),
        },
        "/v1/messages": _post(
            operation_id="createMessage",
            summary="Anthropic Messages: a message, or its event stream when stream is true",
            request=ref(MessagesRequest),
            answer=_ref("Message"),
            errors=_errors(anthropic_errors, *_GENERATION_ERRORS),
            stream=_MESSAGE_EVENTS,
        ),
        "/v1/messages/count_tokens": _post(
            operation_id="countMessageTokens",
            summary="The number of prompt tokens a Messages request with these fields renders",
            request=ref(CountTokensRequest),
            answer=_ref("MessageTokensCount"),
            errors=_errors(anthropic_errors, *_GENERATION_ERRORS),
        ),
    }
