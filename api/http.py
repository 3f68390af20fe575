"""HTTP plumbing every route shares: JSON bodies in and out, error answers, SSE headers.

Receives Quart's request (``read_json``: strict UTF-8 JSON, NaN refused,
nesting and lone surrogates refused by ``api.json_input``, a 400 naming the
problem); emits ``Response`` objects (``json_response``,
``error_response``: the status, OpenAI error body and ``Retry-After`` that
``api.errors.error_answer`` makes).
"""

from __future__ import annotations

import json
import platform
from typing import Any

from quart import Response, request
from werkzeug.exceptions import HTTPException

from api.errors import error_answer
from api.json_input import loads as load_json_body
from api.sse import dumps
from runtime.errors import ClientError, ServerError
from runtime.messages import Failed

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


# A request body up to this size is templated and tokenised on the trio thread:
# about 1 ms of Jinja and tokenizer at 2 KB (0.45 ms a KB measured on a 2-core
# CPU), less than the two GIL hand-overs of a worker thread cost a burst of
# arrivals while the loop streams to other clients.
INLINE_PREPARE_BYTES = 2048


def small_body() -> bool:
    """Is the current request's body small enough to prepare its prompt inline?"""
    length = request.content_length
    return length is not None and length <= INLINE_PREPARE_BYTES


def fingerprint() -> str:
    """``system_fingerprint``: this server's and MLX's versions and the machine."""
    try:
        import mlx.core as mx
        import mlx_lm

        return f"mlx-trio-server-{mlx_lm.__version__}-{mx.__version__}-{platform.machine()}"
    except Exception:  # pragma: no cover - mlx missing is caught at load
        return "mlx-trio-server"


def json_response(payload: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(payload), status=status, headers=headers, content_type="application/json")


def error_response(error: ServerError | Failed | HTTPException) -> Response:
    answer = error_answer(error)
    return json_response(answer.body, status=answer.status, headers=answer.headers)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json() -> Any:
    raw = await request.get_data(cache=False, as_text=False)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ClientError("the request body is not valid UTF-8") from None
    try:
        return load_json_body(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as exc:
        raise ClientError(f"the request body is not valid JSON: {exc}") from None
