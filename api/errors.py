"""The one place an error becomes an OpenAI error answer.

Receives what can go wrong at the HTTP edge: a ``ServerError`` (raised by the
actors and the API: 400, 404, 413, 429, 503, 500), a Session's terminal
``Failed`` message, or a ``werkzeug`` ``HTTPException`` (Quart's own 404,
405, ...). Emits an ``ErrorAnswer``: the status, the body
``{"error": {"message", "type", "param", "code"}}`` (``ErrorResponse``, the
type ``/openapi.json`` documents) and the headers, ``Retry-After`` whenever
the error carries one (every 429 and 503 does). Streams that already sent
their status put the same body in an SSE frame (``error_body``).

``InvalidParam`` is what the request types' attrs validators raise: a value
out of its field's bounds; ``api.convert`` answers it with a 400 naming the
field's full path.
"""

from __future__ import annotations

from typing import Any

import attrs
from werkzeug.exceptions import HTTPException

from runtime.errors import ServerError
from runtime.messages import Failed


@attrs.frozen(kw_only=True)
class ErrorDetail:
    message: str
    type: str
    param: str | None
    code: str | None


@attrs.frozen(kw_only=True)
class ErrorResponse:
    error: ErrorDetail


@attrs.frozen(kw_only=True)
class ErrorAnswer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def error_answer(error: ServerError | Failed | HTTPException) -> ErrorAnswer:
    """Status, OpenAI error body and headers (``Retry-After`` when known) of ``error``."""
    param = code = retry_after = None
    if isinstance(error, ServerError):
        status, message, kind = error.status, error.message, error.type
        param, code, retry_after = error.param, error.code, error.retry_after
    elif isinstance(error, Failed):
        status, message, kind, retry_after = error.status, error.message, error.type, error.retry_after
    elif isinstance(error, HTTPException):
        status = error.code or 500
        message = error.description or error.name
        kind = "not_found_error" if status == 404 else "invalid_request_error"
    else:
        raise TypeError(f"not an error this server answers: {error!r}")
    detail = ErrorDetail(message=message, type=kind, param=param, code=code)
    headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
    return ErrorAnswer(
        status=status, body=attrs.asdict(ErrorResponse(error=detail)), headers=headers
    )


def error_body(error: ServerError | Failed | HTTPException) -> dict[str, Any]:
    """Just the body: for an SSE error frame, after the stream's status was sent."""
    return error_answer(error).body


class InvalidParam(ValueError):
    """A request field's value is out of bounds (raised by an attrs validator).

    ``param`` is the field's path relative to the object being validated
    (``"role"``, ``"tools[2]"``); ``message`` says what is wrong and usually
    starts with ``param``. ``api.convert`` prefixes both with the object's
    path in the request (``messages[0].role``).
    """

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message
