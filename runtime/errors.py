"""Errors that become HTTP answers.

Each carries the status code, the OpenAI error ``type``/``param``/``code`` and,
for 429 and 503, the seconds a client should wait (``retry_after``). Raised by
the actors and the API; rendered only by ``api.errors.error_answer`` into
``{"error": {...}}`` and a ``Retry-After`` header. A request that has
already started ends with the same answer through
``runtime.messages.Failed.of(error)``.

The answer every layer gives while the server shuts down is built here once
(``shutting_down()``), with the wait it asks for (``RESTART_RETRY_AFTER``).
"""

from __future__ import annotations

SHUTTING_DOWN = "the server is shutting down"
RESTART_RETRY_AFTER = 5  # seconds: a restarted server or engine is back in about that long


class ServerError(Exception):
    status = 500
    type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after


class ClientError(ServerError):
    """Bad input: 400, naming the field in ``param``."""

    status = 400
    type = "invalid_request_error"


class NotFound(ServerError):
    status = 404
    type = "not_found_error"


class PayloadTooLarge(ServerError):
    status = 413
    type = "invalid_request_error"


class Overloaded(ServerError):
    """The admission queue is full: 429 with Retry-After."""

    status = 429
    type = "rate_limit_error"


class Unavailable(ServerError):
    """The engine is loading, dead or shutting down: 503 with Retry-After."""

    status = 503
    type = "service_unavailable"


def shutting_down() -> Unavailable:
    """The 503 for a request that comes, or is still open, while the server shuts down."""
    return Unavailable(SHUTTING_DOWN, retry_after=RESTART_RETRY_AFTER)
