"""What the HTTP edge records of each request: its id, one access-log line, the HTTP metrics.

``RequestObserver`` wraps the app's ASGI callable (``app.asgi_app``), so it
sees every HTTP request from its first byte to its last, streams included
(Quart's ``after_request`` runs before a stream's body). For each request it:

* takes the client's ``x-request-id`` (only ``A-Z a-z 0-9 . _ : -`` kept, at
  most ``MAX_REQUEST_ID`` characters) or makes one, and adds it to the
  response's headers (``x-request-id``) as the response starts;
* keeps a ``RequestRecord`` in the ASGI scope (``current_record()``): the
  ``after_request`` hook notes the route rule there (``note_route``) and the
  generation path the request's ``RequestTiming`` (``note_timing``);
* when the request ends, however it ends, counts it in the runtime's metrics
  (endpoint and status; a request that ended before any answer was sent,
  because its client left, counts as 499) and writes one line to the
  ``mlx_trio.access`` logger: request id, method, endpoint, status, and for
  a generation its prompt, generated and cached tokens, finish, time to first
  output and duration. The line's fields are also on the log record, as the
  dict ``access``, for structured handlers.

For benchmarks only (``runtime.engine.host_speed.PROBE_ENV`` set, ``probe_path``; as the engine
process's probes), ``RequestTrace`` also appends one line per generation
request to ``PREFIX-api.PID``: ``R request_id arrived submitted first_output
ended`` in epoch seconds (``-``: never reached).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any

import attrs
from quart import request

from actors.metrics import CLIENT_CLOSED, ServerMetrics
from actors.request_timing import RequestTiming
from actors.session import Arrivals
from runtime.engine.host_speed import probe_path

ACCESS_LOG = logging.getLogger("mlx_trio.access")
SCOPE_KEY = "mlx_trio.request"
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID = 128
UNMATCHED = "unmatched"
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9._:\-]")


@attrs.define
class RequestRecord:
    request_id: str
    method: str
    path: str
    started: float  # time.monotonic()
    route: str = UNMATCHED
    status: int | None = None
    timing: RequestTiming | None = None
    # A generation request counted in ``Arrivals.http`` until its Submit (or its end).
    arrivals: Arrivals | None = None

    def left_arrivals(self) -> None:
        """Synchronous and idempotent: the request no longer waits to submit."""
        if self.arrivals is not None:
            self.arrivals.http -= 1
            self.arrivals = None


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``x-request-id``, cleaned and bounded; a new one if it sent none usable."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER.encode():
            cleaned = _NOT_IN_ID.sub("", value.decode("latin-1"))[:MAX_REQUEST_ID]
            if cleaned:
                return cleaned
    return uuid.uuid4().hex


GENERATION_PATHS = ("/completions", "/responses", "/messages")


def is_generation(method: str, path: str) -> bool:
    """A request that will start a generation (chat, text, Responses, Messages)."""
    return method == "POST" and path.rstrip("/").endswith(GENERATION_PATHS)


def current_record() -> RequestRecord | None:
    """The record of the request being handled (None outside ``RequestObserver``)."""
    return request.scope.get(SCOPE_KEY)


def note_route() -> None:
    """Call from ``after_request``: which route (rule) answered."""
    record = current_record()
    if record is not None and request.url_rule is not None:
        record.route = request.url_rule.rule


def note_timing(timing: RequestTiming) -> None:
    """The generation path: this request's Session timing, for the access log (and its
    Submit ends the request's count in ``Arrivals``)."""
    record = current_record()
    if record is not None:
        record.timing = timing
        if record.arrivals is not None:
            timing.on_submitted = record.left_arrivals


class RequestTrace:
    """Each generation request's milestones, appended to ``path`` (benchmarks only)."""

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def from_environment(cls) -> RequestTrace | None:
        path = probe_path("-api")
        return cls(path) if path else None

    def record(self, record: RequestRecord) -> None:
        """Synchronous: one short append (the engine's probes are benchmarks' too)."""
        timing = record.timing
        if timing is None:
            return
        to_epoch = time.time() - time.monotonic()
        marks = (record.started, timing.submitted, timing.first_output, timing.ended)
        fields = " ".join("-" if m is None else f"{m + to_epoch:.4f}" for m in marks)
        with open(self.path, "a") as f:
            f.write(f"R {record.request_id} {fields}\n")


class RequestObserver:
    """ASGI middleware: request ids, the access log and the HTTP metrics."""

    def __init__(self, app, metrics: ServerMetrics, arrivals: Arrivals | None = None):
        self._app = app
        self._metrics = metrics
        self._arrivals = arrivals  # generation requests on their way (Submit.followed)
        self._trace = RequestTrace.from_environment()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        record = RequestRecord(
            request_id=request_id_from(scope.get("headers", [])),
            method=scope.get("method", ""),
            path=scope.get("path", ""),
            started=time.monotonic(),
        )
        scope[SCOPE_KEY] = record
        id_header = (REQUEST_ID_HEADER.encode(), record.request_id.encode())

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), id_header]}
            await send(message)

        self._metrics.http_started()
        if self._arrivals is not None and is_generation(record.method, record.path):
            self._arrivals.http += 1
            record.arrivals = self._arrivals
        try:
            await self._app(scope, receive, send_with_id)
        finally:
            record.left_arrivals()
            self._finish(record)

    def _finish(self, record: RequestRecord) -> None:
        """Synchronous: may run while the request's task is being cancelled."""
        status = record.status if record.status is not None else CLIENT_CLOSED
        self._metrics.observe_response(record.route, status)
        fields = access_fields(record, status)
        # Health probes every few seconds would drown the requests: DEBUG for them.
        level = logging.DEBUG if fields.get("endpoint") == "/health" else logging.INFO
        ACCESS_LOG.log(level, "%s", access_line(fields), extra={"access": fields})
        if self._trace is not None:
            self._trace.record(record)


def access_fields(record: RequestRecord, status: int) -> dict[str, Any]:
    """The access-log fields of a finished request (times in milliseconds)."""
    fields: dict[str, Any] = {
        "request_id": record.request_id,
        "method": record.method,
        "endpoint": record.route,
        "status": status,
    }
    if record.route == UNMATCHED:
        fields["path"] = record.path
    timing = record.timing
    if timing is not None:
        fields["prompt_tokens"] = timing.prompt_tokens
        fields["generated_tokens"] = timing.completion_tokens
        fields["cached_tokens"] = timing.cached_tokens
        fields["finish"] = timing.outcome or "abandoned"
        if timing.submitted is not None:
            # our side before the engine: the model lease, the chat template, tokenising
            fields["submit_ms"] = round((timing.submitted - record.started) * 1000, 1)
        if timing.queued is not None:
            # after it, until the engine took it: the queue (a slot, the KV budget), the
            # engine's admission window
            fields["queued_ms"] = round(timing.queued * 1000, 1)
        if timing.first_output is not None:
            fields["ttft_ms"] = round((timing.first_output - record.started) * 1000, 1)
    fields["duration_ms"] = round((time.monotonic() - record.started) * 1000, 1)
    return fields


def access_line(fields: dict[str, Any]) -> str:
    """``key=value`` pairs; a value with spaces, quotes or control characters is JSON-quoted."""
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or any(c.isspace() or c in '"=\\' or not c.isprintable() for c in text):
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)
