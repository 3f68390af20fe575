"""The OpenAPI 3.1 document of the HTTP API, served at ``GET /openapi.json``.

``openapi_document()`` builds (once, cached) the document from the same attrs
types the server structures requests into (``api.schemas``) and renders
responses from (``api.bodies``): each class becomes a JSON Schema under
``components/schemas`` (fields from ``attrs.fields`` with resolved type
hints; a field without a default is ``required``), referenced by ``$ref``.

A field's bounds come from the same ``Constraint`` its attrs validator
enforces (``api.constraints``): ranges become ``minimum``/``maximum``, allowed
values ``enum``/``const``, and so on, applied to the union member of the JSON
type they concern. The error body every non-2xx answer carries is
``ErrorResponse`` (``api.errors``; ``AnthropicError`` under ``/v1/messages``);
``/health`` answers with ``Health`` (200 or 503). Streams (``stream: true``)
are documented as ``text/event-stream`` whose schema describes one event, as
OpenAPI before 3.2 does. The agent APIs' paths and answers come from
``api.agents.openapi``. Nothing here is imported by the server until
``/openapi.json`` is first asked for.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any, Union

import attrs

import api.bodies as bodies
import api.schemas as schemas
from api.agents.openapi import AGENT_COMPONENTS, agent_paths
from api.constraints import Constraint, constraint_of
from api.errors import ErrorResponse

OPENAPI_VERSION = "3.1.0"
COMPONENTS = "#/components/schemas/"

_DESCRIPTIONS = {
    "ChatCompletionRequest": "POST /v1/chat/completions. Unknown fields are ignored. "
    "max_completion_tokens wins over max_tokens; without either, the server's default applies.",
    "CompletionRequest": "POST /v1/completions. Unknown fields are ignored. "
    "prompt is a string or a list of token ids.",
    "ErrorResponse": "The body of every error answer (OpenAI's shape).",
    "ChatCompletionChunk": "One `data:` frame of a streamed chat completion.",
    "TextCompletion": "A text completion, or one `data:` frame of a streamed one.",
}


_HEALTH = {
    "type": "object",
    "description": "The runtime's state; 503 (status 'unavailable', with a reason) while the "
    "model is loading, after the engine died, or while shutting down.",
    "required": ["status"],
    "properties": {
        "status": {"type": "string", "enum": ["ok", "unavailable"]},
        "reason": {"type": "string"},
        "model": {"type": "string"},
        "model_state": {"type": "string"},
        "active_sequences": {"type": "integer"},
        "requests_in_flight": {"type": "integer"},
        "waiting": {"type": "integer"},
        "engine_restarts": {"type": "integer"},
        "prompt_cache": {"type": "object"},
    },
}


# ------------------------------------------------------ attrs -> JSON Schema


_JSON_TYPES: dict[Any, str] = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    type(None): "null",
}


def _json_type(schema: dict[str, Any]) -> str | None:
    """The single JSON type a member schema stands for ("object" for a $ref)."""
    if "$ref" in schema:
        return "object"
    kind = schema.get("type")
    return kind if isinstance(kind, str) else None


class _Builder:
    def __init__(self) -> None:
        self.components: dict[str, dict[str, Any]] = {}

    def ref(self, cls: type) -> dict[str, Any]:
        name = cls.__name__
        if name not in self.components:
            self.components[name] = {}  # placeholder: recursion stops here
            self.components[name] = self.class_schema(cls)
        return {"$ref": COMPONENTS + name}

    def class_schema(self, cls: type) -> dict[str, Any]:
        attrs.resolve_types(cls)
        hints = typing.get_type_hints(cls)
        properties: dict[str, Any] = {}
        required: list[str] = []
        for field in attrs.fields(cls):
            schema = self.type_schema(hints.get(field.name, field.type))
            constraint = constraint_of(field)
            if constraint is not None:
                schema = _constrained(schema, constraint)
            if constraint is not None and constraint.required:
                schema = _without_null(schema)
                required.append(field.name)
            elif field.default is attrs.NOTHING:
                required.append(field.name)
            elif _is_json_value(field.default):
                schema = {**schema, "default": field.default}
            properties[field.name] = schema
        out: dict[str, Any] = {"type": "object", "properties": properties}
        if required:
            out["required"] = required
        description = _DESCRIPTIONS.get(cls.__name__) or (cls.__doc__ or "").strip()
        if description:
            out["description"] = description
        return out

    def type_schema(self, tp: Any) -> dict[str, Any]:
        if tp is Any:
            return {}
        if tp in _JSON_TYPES:
            return {"type": _JSON_TYPES[tp]}
        if attrs.has(tp):
            return self.ref(tp)
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin is Union or origin is types.UnionType:
            members = [self.type_schema(arg) for arg in args]
            kinds = [_json_type(m) for m in members]
            if all(k is not None and set(m) == {"type"} for k, m in zip(kinds, members, strict=True)):
                return {"type": kinds}  # only plain types: ["integer", "null"]
            return {"anyOf": members}
        if origin is list:
            item = args[0] if args else Any
            return {"type": "array", "items": self.type_schema(item)}
        if origin is dict:
            value = args[1] if args else Any
            return {"type": "object", "additionalProperties": self.type_schema(value)}
        raise TypeError(f"no JSON Schema for {tp!r}")


def _without_null(schema: dict[str, Any]) -> dict[str, Any]:
    kinds = schema.get("type")
    if isinstance(kinds, list):
        rest = [k for k in kinds if k != "null"]
        return {**schema, "type": rest[0] if len(rest) == 1 else rest}
    if "anyOf" in schema:
        return {**schema, "anyOf": [m for m in schema["anyOf"] if m.get("type") != "null"]}
    return schema


def _is_json_value(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _merge(schema: dict[str, Any], kind: str, keywords: dict[str, Any]) -> dict[str, Any]:
    """``keywords`` added where ``schema`` (maybe a union) admits JSON ``kind``."""
    if kind == "*" or schema.get("type") == kind:
        return {**schema, **keywords}
    if isinstance(schema.get("type"), list) and kind in schema["type"]:
        # Split the member out so its keywords cannot apply to the others.
        others = [t for t in schema["type"] if t != kind]
        rest = {k: v for k, v in schema.items() if k != "type"}
        member = {"type": kind, **keywords}
        return {**rest, "anyOf": [member, {"type": others if len(others) > 1 else others[0]}]}
    if "anyOf" in schema:
        members = [
            {**m, **keywords} if _json_type(m) == kind and "$ref" not in m else m
            for m in schema["anyOf"]
        ]
        return {**schema, "anyOf": members}
    return schema


def _bounds(low, high) -> dict[str, Any]:
    out = {}
    if low is not None:
        out["minimum"] = low
    if high is not None:
        out["maximum"] = high
    return out


def _constrained(schema: dict[str, Any], c: Constraint) -> dict[str, Any]:
    """``schema`` with the keywords that state ``c``, on the members they concern."""
    bounds = _bounds(c.minimum, c.maximum)
    if bounds:
        kinds = schema.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if "integer" in kinds or "number" in kinds:
            # minimum/maximum only constrain numbers: a nullable field keeps null.
            schema = {**schema, **bounds}
        elif _json_type(schema) == "object" and "additionalProperties" in schema:
            schema = {**schema, "additionalProperties": {**schema["additionalProperties"], **bounds}}
        elif isinstance(schema.get("anyOf"), list):
            schema = _merge(
                schema, "object", {"additionalProperties": {"type": "number", **bounds}}
            )
    if c.choices is not None:
        if all(isinstance(choice, bool) for choice in c.choices) and len(c.choices) == 1:
            schema = _merge(schema, "boolean", {"const": c.choices[0]})
        else:
            schema = _merge(schema, "string", {"enum": list(c.choices)})
    if c.nonempty:
        schema = _merge(schema, "string", {"minLength": 1})
        schema = _merge(schema, "array", {"minItems": 1})
    if c.max_items is not None:
        schema = _merge(schema, "array", {"maxItems": c.max_items})
    if c.keys is not None:
        schema = _merge(schema, "object", {"propertyNames": {"pattern": f"^{c.keys[1]}$"}})
    for kind, keywords in c.schema.items():
        schema = _merge(schema, kind, keywords)
    return schema


# ------------------------------------------------------------- the paths


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error(description: str, *, retry_after: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": _json(_ERROR_REF)}
    if retry_after:
        out["headers"] = {
            "Retry-After": {
                "description": "seconds to wait before retrying",
                "schema": {"type": "integer"},
            }
        }
    return out


_ERROR_REF = {"$ref": COMPONENTS + "ErrorResponse"}

_GENERATION_ERRORS = {
    "400": _error("invalid request: bad JSON, a wrong type or a value out of range (param names it)"),
    "404": _error("the model, adapters or draft_model named is not on this machine"),
    "413": _error(
        "the request body is larger than the server's limit, or the request's KV cache "
        "(prompt + max_tokens) would exceed the server's budget"
    ),
    "429": _error("the admission queue is full", retry_after=True),
    "503": _error("the model is loading, the engine died, or the server is shutting down", retry_after=True),
    "default": _error("any other error"),
}


def _sse_event(chunk_name: str) -> dict[str, Any]:
    """One server-sent event (before OpenAPI 3.2, a stream's schema is its events')."""
    return {
        "type": "object",
        "description": f"One event: `data: <{chunk_name} JSON>`; after an error, "
        "`data: <ErrorResponse JSON>`; last, `data: [DONE]`.",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [{"$ref": COMPONENTS + chunk_name}, _ERROR_REF]
                        },
                    },
                ],
            },
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }


def _generation(
    *, operation_id: str, summary: str, alias: str, request: type, body: type, chunk: type
) -> dict[str, Any]:
    chunk_name = chunk.__name__
    return {
        "post": {
            "operationId": operation_id,
            "summary": summary,
            "description": f"Also served at `{alias}`. With `stream: true` the answer is an SSE "
            f"stream of `data: <{chunk_name}>` frames (and `: keepalive` comments while a long "
            "prompt is processed), ending with `data: [DONE]`; an error after the stream started "
            "is a `data: <ErrorResponse>` frame before `[DONE]`.",
            "requestBody": {"required": True, "content": _json({"$ref": COMPONENTS + request.__name__})},
            "responses": {
                "200": {
                    "description": f"the completion; an SSE stream of {chunk_name} when stream is true",
                    "content": {
                        "application/json": {"schema": {"$ref": COMPONENTS + body.__name__}},
                        "text/event-stream": {"schema": _sse_event(chunk_name)},
                    },
                },
                **_GENERATION_ERRORS,
            },
        }
    }


def _tokenizer_path(
    *, operation_id: str, summary: str, request: type, answer: dict[str, Any]
) -> dict[str, Any]:
    return {
        "post": {
            "operationId": operation_id,
            "summary": summary,
            "requestBody": {"required": True, "content": _json({"$ref": COMPONENTS + request.__name__})},
            "responses": {
                "200": {"description": "the answer", "content": _json(answer)},
                "400": _error("a field is missing, of the wrong type or out of range (param names it)"),
                "404": _error("the model is not served here"),
                "default": _error("any other error"),
            },
        }
    }


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document (cached: callers must not mutate it)."""
    builder = _Builder()
    for cls in (
        schemas.ChatCompletionRequest,
        schemas.CompletionRequest,
        bodies.ChatCompletion,
        bodies.ChatCompletionChunk,
        bodies.TextCompletion,
        bodies.ModelList,
        bodies.ModelCard,
        schemas.TokenizeRequest,
        schemas.DetokenizeRequest,
        schemas.EmbeddingRequest,
        bodies.EmbeddingList,
        ErrorResponse,
    ):
        builder.ref(cls)
    agents = agent_paths(builder.ref)
    components = dict(sorted(builder.components.items()))
    components["Health"] = _HEALTH
    components.update(AGENT_COMPONENTS)

    paths = {
        "/v1/chat/completions": _generation(
            operation_id="createChatCompletion",
            summary="Chat completion",
            alias="/chat/completions",
            request=schemas.ChatCompletionRequest,
            body=bodies.ChatCompletion,
            chunk=bodies.ChatCompletionChunk,
        ),
        "/v1/completions": _generation(
            operation_id="createCompletion",
            summary="Text completion",
            alias="/completions",
            request=schemas.CompletionRequest,
            body=bodies.TextCompletion,
            chunk=bodies.TextCompletion,
        ),
        "/v1/embeddings": {"post": {
            "operationId": "createEmbedding",
            "summary": "Embeddings of texts or token ids by the --embedding-model",
            "description": "Also served at `/embeddings`. Requests waiting together share "
            "forward passes.",
            "requestBody": {"required": True, "content": _json({"$ref": COMPONENTS + "EmbeddingRequest"})},
            "responses": {
                "200": {"description": "one vector per input, in input order",
                        "content": _json({"$ref": COMPONENTS + "EmbeddingList"})},
                "400": _error("a bad field (param names it: input[2]), an input longer than the "
                              "model takes, dimensions it does not allow, the chat model named"),
                "404": _error("no embedding model of that name is served"),
                "413": _error("the request body is larger than the server's limit"),
                "429": _error("too many embedding requests are waiting", retry_after=True),
                "503": _error("the embedding model is loading or failed, or the server is "
                              "shutting down", retry_after=True),
                "default": _error("any other error"),
            },
        }},
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "summary": "The served model, then MLX models in the local Hugging Face cache",
                "responses": {
                    "200": {"description": "the models", "content": _json({"$ref": COMPONENTS + "ModelList"})},
                    "default": _error("any other error"),
                },
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "operationId": "retrieveModel",
                "summary": "One model of the list",
                "parameters": [
                    {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": {"description": "the model", "content": _json({"$ref": COMPONENTS + "ModelCard"})},
                    "404": _error("no such model"),
                    "default": _error("any other error"),
                },
            }
        },
        "/tokenize": _tokenizer_path(
            operation_id="tokenize",
            summary="Prompt text, or chat messages through the chat template, to token ids",
            request=schemas.TokenizeRequest,
            answer={
                "type": "object",
                "required": ["tokens", "count"],
                "properties": {
                    "tokens": {"type": "array", "items": {"type": "integer"}},
                    "count": {"type": "integer"},
                    "max_model_len": {"type": "integer"},
                },
            },
        ),
        "/detokenize": _tokenizer_path(
            operation_id="detokenize",
            summary="Token ids to text",
            request=schemas.DetokenizeRequest,
            answer={
                "type": "object",
                "required": ["prompt"],
                "properties": {"prompt": {"type": "string"}},
            },
        ),
        "/health": {
            "get": {
                "operationId": "health",
                "summary": "Liveness and readiness",
                "responses": {
                    "200": {"description": "ready", "content": _json({"$ref": COMPONENTS + "Health"})},
                    "503": {
                        "description": "not ready (see reason)",
                        "content": _json({"$ref": COMPONENTS + "Health"}),
                    },
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "the Prometheus text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": {
                    "200": {
                        "description": "the OpenAPI 3.1 document",
                        "content": _json({"type": "object"}),
                    }
                },
            }
        },
        **agents,
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "mlx-trio-server",
            "version": _version(),
            "description": "An OpenAI-compatible server for MLX models. Every error answer is "
            '`{"error": {"message", "type", "param", "code"}}`, under /v1/messages Anthropic\'s '
            '`{"type": "error", "error": {"type", "message"}}`; 429 and 503 carry Retry-After.',
        },
        "paths": paths,
        "components": {"schemas": components},
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-trio-server")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0.0.0"
