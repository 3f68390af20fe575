"""The one generation path of every endpoint: an entered Session, rendered as JSON or SSE.

Receives a ``Session`` (not yet entered) and a renderer (the endpoint's wire
format: chat, text, Responses, Anthropic Messages). ``generate`` enters the
Session, so every refusal (400, 404, 413, 429, 503) is a proper status before
any byte is sent, then either drains it into one JSON body or returns a
streaming ``Response`` whose body is a ``SessionStream``.

Cancellation: a streaming body closes its Session when its last frame is
read, in the stream's ``aclose()``, which Quart calls when the body ends or
the client disconnects, or, if the response is dropped before its body
starts, by a ``weakref.finalize`` safety net. ``Session.close`` is
synchronous and aborts a sequence still in the engine. A non-streaming
request closes its Session in ``finally``; cancellation while waiting (the
client left) aborts it the same way.

Every successful answer carries the ``x-prompt-cache`` header
(``prompt_cache_header``): a streaming one what the prompt-cache policy predicted
when the request was submitted (the headers go out before the engine looks),
a JSON one what the engine's lookup did (``Usage``).

Shutdown under ``hypercorn api:app`` (``WATCH_SERVER_DEADLINE`` in the app's
config): Hypercorn tells the app nothing when it begins a graceful shutdown,
but it puts a deadline (its graceful timeout) on every request's task. A
request that sees one while it waits for its next events tells the runtime
(``Session.server_closing``), which ends every open request properly a
little before (``Runtime.drain_before``). ``mlx-trio-server`` drains on the
signal itself (``api.cli``).

Also here: what both completion endpoints and the agent APIs take from a
request's sampling fields (``sampling_params``) and deadline (``deadline``).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import trio
from quart import Response, current_app

from actors.session import Session
from api.errors import error_answer
from api.http import SSE_HEADERS, json_response
from api.observability import note_timing
from api.schemas import GenerationFields
from runtime.config import ServerConfig
from runtime.messages import (
    CacheMissReason,
    Failed,
    Finished,
    PromptCacheOutlook,
    SamplingParams,
)

PROMPT_CACHE_HEADER = "x-prompt-cache"


def prompt_cache_header(reused_tokens: int, miss_reason: CacheMissReason | None) -> str:
    """``hit; reused=123`` or ``miss; reason=evicted`` (docs/api.md#prompt-cache)."""
    if reused_tokens:
        return f"hit; reused={reused_tokens}"
    return f"miss; reason={miss_reason or CacheMissReason.NO_ENTRY}"


def _outlook_headers(outlook: PromptCacheOutlook | None) -> dict[str, str]:
    if outlook is None:
        return {}
    return {PROMPT_CACHE_HEADER: prompt_cache_header(outlook.reused_tokens, outlook.miss_reason)}

WATCH_SERVER_DEADLINE = "MLX_TRIO_WATCH_SERVER_DEADLINE"  # app config key (hypercorn api:app)


def _notice_server_deadline(session: Session) -> None:
    """A finite deadline on this task is the HTTP server's graceful timeout: it is closing.

    (A task already cancelled, its client gone, reads -inf: that is no shutdown.)"""
    deadline = trio.current_effective_deadline()
    if math.isfinite(deadline):
        session.server_closing(deadline)


class SessionStream:
    """The body of a streaming response: frames from an entered Session.

    ``interval`` (seconds, ``--stream-interval-ms``; 0: every engine step):
    after a chunk is sent, the next is sent no sooner than this. Text that
    arrives meanwhile merges in the Session's outbox, so each chunk carries
    several tokens: fewer HTTP chunks, less CPU per token, coarser streaming.
    The first chunk is never held back.
    """

    def __init__(
        self, session: Session, renderer, interval: float = 0.0, *, watch_deadline: bool = False
    ):
        self._session = session
        self._renderer = renderer
        self._interval = interval
        self._watch_deadline = watch_deadline
        self._open_choices = session.n  # the stream ends when each has ended (or one failed)
        self._next_send = -math.inf
        self._done = False
        # Closes the Session once: at the last frame, at aclose, or when collected.
        self._close_session = weakref.finalize(self, _close_session, session)

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        while not self._done:
            if self._interval and trio.current_time() < self._next_send:
                await trio.sleep_until(self._next_send)  # the outbox merges meanwhile
            if self._watch_deadline:
                _notice_server_deadline(self._session)
            try:
                items = await self._session.receive()
            except trio.EndOfChannel:
                self._done = True
                self._close_session()
                break
            self._open_choices -= sum(isinstance(i, Finished) for i in items)
            if self._open_choices <= 0 or any(isinstance(i, Failed) for i in items):
                self._done = True
                self._close_session()
            frames = self._renderer.stream_frames(items)
            if frames:  # an empty body chunk would read as the end of the stream
                self._next_send = trio.current_time() + self._interval
                return frames
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._close_session()


def _close_session(session: Session) -> None:
    session.close()


async def generate(
    session: Session, renderer, stream: bool, *, stream_interval: float = 0.0
) -> Response:
    """Enter ``session`` and answer with ``renderer``'s stream or body."""
    note_timing(session.timing)  # the access log reports its tokens and times
    await session.__aenter__()
    watch = bool(current_app.config.get(WATCH_SERVER_DEADLINE))
    if stream:
        try:
            body = SessionStream(session, renderer, stream_interval, watch_deadline=watch)
        except BaseException:
            session.close()
            raise
        headers = {**SSE_HEADERS, **_outlook_headers(session.prompt_cache)}
        response = Response(body, status=200, headers=headers)
        response.timeout = None  # our deadline is the request's own (Session)
        return response
    try:
        while renderer.terminal is None:
            if watch:
                _notice_server_deadline(session)
            try:
                items = await session.receive()
            except trio.EndOfChannel:
                break
            for item in items:
                renderer.add(item)
    finally:
        session.close()
    terminal = renderer.terminal
    if isinstance(terminal, Failed):
        answer = error_answer(terminal)  # status and Retry-After; the body in the API's shape
        return json_response(
            renderer.failure_body(terminal), status=answer.status, headers=answer.headers
        )
    body = renderer.body()
    usage = terminal.usage
    header = prompt_cache_header(usage.cached_tokens, usage.cache_miss_reason)
    return json_response(body, headers={PROMPT_CACHE_HEADER: header})


def effort_template_args(effort: str | None) -> dict[str, Any]:
    """Chat-template arguments for OpenAI's reasoning effort: the level as
    ``reasoning_effort`` (gpt-oss's template reads it), and for "none" thinking
    turned off as well (``enable_thinking``, which Qwen-style templates read)."""
    if effort is None:
        return {}
    args: dict[str, Any] = {"reasoning_effort": effort}
    if effort == "none":
        args["enable_thinking"] = False
    return args


def sampling_params(req: GenerationFields, config: ServerConfig) -> SamplingParams:
    """A request's sampling fields, the server's defaults where it sent none."""

    def pick(value, default):
        return default if value is None else value

    return SamplingParams(
        temperature=float(pick(req.temperature, config.temp)),
        top_p=float(pick(req.top_p, config.top_p)),
        top_k=int(pick(req.top_k, config.top_k)),
        min_p=float(pick(req.min_p, config.min_p)),
        xtc_probability=req.xtc_probability,
        xtc_threshold=req.xtc_threshold,
        repetition_penalty=req.repetition_penalty,
        repetition_context_size=req.repetition_context_size,
        presence_penalty=req.presence_penalty,
        presence_context_size=req.presence_context_size,
        frequency_penalty=req.frequency_penalty,
        frequency_context_size=req.frequency_context_size,
        logit_bias=req.logit_bias_pairs,
        seed=req.seed,
    )


def deadline(request_timeout: float | None, config: ServerConfig) -> float | None:
    """Seconds a request may run: the sooner of its own ``timeout`` and the server's."""
    limits = [t for t in (request_timeout, config.request_timeout) if t is not None]
    return min(limits) if limits else None
