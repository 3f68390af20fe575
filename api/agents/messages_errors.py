"""The one builder of Anthropic-shaped errors, for everything under ``/v1/messages``.

Receives what can go wrong there, as everywhere: a ``ServerError``, a
Session's terminal ``Failed``, or a ``werkzeug`` ``HTTPException`` (Quart's
404 and 405, decided before a route is chosen); the app's error handlers
(``api.server``) send every error under ``PATH`` here. The status, message and
``Retry-After`` come from the app's one error builder
(``api.errors.error_answer``); only the body's shape is Anthropic's:
``{"type": "error", "error": {"type", "message"}}``, its ``type`` named
after the status (Anthropic's names; another 4xx is ``invalid_request_error``,
another 5xx ``api_error``). Emits the body (``error_body``, also an SSE ``error``
event's data) or the whole JSON response (``error_response``).
"""

from __future__ import annotations

from typing import Any

from quart import Response
from werkzeug.exceptions import HTTPException

from api.errors import ErrorAnswer, error_answer
from api.http import json_response
from runtime.errors import ServerError
from runtime.messages import Failed

PATH = "/v1/messages"  # this path and every path below it answer errors in this shape

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def _shaped(answer: ErrorAnswer) -> dict[str, Any]:
    other = "invalid_request_error" if answer.status < 500 else "api_error"  # e.g. 405
    kind = ERROR_TYPES.get(answer.status, other)
    return {"type": "error", "error": {"type": kind, "message": answer.body["error"]["message"]}}


def error_body(error: ServerError | Failed | HTTPException) -> dict[str, Any]:
    """Just the body: for an SSE ``error`` event, after the stream's status was sent."""
    return _shaped(error_answer(error))


def error_response(error: ServerError | Failed | HTTPException) -> Response:
    answer = error_answer(error)
    return json_response(_shaped(answer), status=answer.status, headers=answer.headers)
