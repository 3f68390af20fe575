"""Server-sent-event frames, and the compact JSON text every answer body is written as.

``dumps`` writes a payload as JSON without spaces and with non-ASCII text as
is (``api.http`` answers with it, the agent APIs' events use it); ``sse``
frames a payload as one ``data:`` event, ``SSE_DONE`` ends an OpenAI stream,
and ``keepalive`` turns a ``Progress`` (a long prompt's prefill) into an SSE
comment. Receives payloads already unstructured; emits bytes.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.messages import Progress


def sse(payload: Any) -> bytes:
    return b"data: " + dumps(payload).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def keepalive(progress: Progress) -> bytes:
    return f": keepalive {progress.done}/{progress.total}\n\n".encode()
