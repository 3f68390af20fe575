"""Detokenizer: token ids in, a request's text, reasoning and tool calls out.

Owns one ``RequestText`` per open request: mlx-lm's streaming detokenizer
(one per request: ``TokenizerWrapper.detokenizer`` builds a fresh one on each
access), the stop-string matcher, and what splits the text into content,
reasoning and tool calls: mlx-lm's ``TextStateMachine`` state (its
tokenizer's think and tool-call markers, calls parsed by its tool parser),
or for a gpt-oss model a ``runtime.harmony.HarmonyParser`` (channels and
recipients).

Receives ``StepOutputs`` (all sequences of one engine step at once) from the
Scheduler over a channel, and through its port (``DetokenizerPort``, used by
the Runtime) ``open`` and ``abort``. Emits into each request's ``Outbox``:
``Progress``, merged ``Delta``s and exactly one terminal ``Finished`` /
``Failed`` (none once its Session has closed: nobody reads it). A request it
ends early (a stop string in the text, a deadline, shutdown) it also aborts
in the engine, through the Scheduler's port (``SchedulerPort.abort``).

Stop strings are matched on decoded text, so they work across token
boundaries; text that could be the start of a stop string is held back until
it is known not to be one, and released when the request ends otherwise.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Protocol

import attrs
import trio
from mlx_lm.generate import TextStateMachine

from actors.scheduler import SchedulerPort
from runtime.errors import RESTART_RETRY_AFTER, Unavailable, shutting_down
from runtime.harmony import HarmonyParser, is_harmony_tokenizer
from runtime.messages import (
    AbortReason,
    CacheMissReason,
    Failed,
    Finished,
    FinishReason,
    Progress,
    StepOutputs,
    TextSpec,
    TokenEvent,
    TokenLogprob,
    ToolCall,
    Usage,
)
from runtime.mlx_lm_internals import keep_leading_space
from runtime.outbox import Outbox

log = logging.getLogger(__name__)


class StopMatcher:
    """Finds the first stop string in a text stream, holding back possible prefixes."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None  # the stop string found, once found

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found)."""
        if not self._stops:
            return text, False
        buf = self._held + text
        # The stop that completes first wins (ties: the longer one), which is
        # what a token-by-token stream sees, however the text was chunked.
        best = None
        for stop in self._stops:
            i = buf.find(stop)
            if i != -1:
                key = (i + len(stop), i)
                if best is None or key < best[0]:
                    best = key, stop
        if best is not None:
            self._held = ""
            self.matched = best[1]
            return buf[: best[0][1]], True
        keep = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class RequestText:
    """One request's text pipeline: tokens -> raw text -> stop check -> segments."""

    def __init__(
        self,
        spec: TextSpec,
        tokenizer,
        state_machine: TextStateMachine | None,
        *,
        harmony: bool = False,
    ):
        self.spec = spec
        self.tokenizer = tokenizer
        self._detok = tokenizer.detokenizer  # a new stateful object on every access
        if not spec.markup:
            keep_leading_space(self._detok)
        self._stops = StopMatcher(spec.stop)
        self._sm = state_machine if spec.markup and not harmony else None
        self._harmony = HarmonyParser() if spec.markup and harmony else None
        self._call: list[str] | None = None  # a Harmony tool call's name and arguments so far
        self._sm_state = self._sm.make_state(spec.initial_state) if self._sm else None
        self._prev_state = spec.initial_state
        self._tool_text = ""
        self.made_tool_call = False
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.cache_miss_reason: CacheMissReason | None = None
        self.queued_seconds: float | None = None

    def add(self, token: int, *, final: str | None) -> tuple[list[tuple[str, str]], bool]:
        """Feed one token. Returns (pieces in text order, stop string hit).

        Each piece is ("content" | "reasoning" | "tool", text); a "tool" piece is
        one whole tool-call block; a ("call", ToolCall) piece is a part of a Harmony call.
        """
        self.completion_tokens += 1
        if final == FinishReason.STOP:
            self._detok.finalize()  # the end-of-sequence token is not text
        else:
            self._detok.add_token(token)
            if final is not None:
                self._detok.finalize()
        raw = self._detok.last_segment
        safe, hit = self._stops.feed(raw)
        if final is not None and not hit:
            safe += self._stops.flush()
        return self._segment(safe, end=final is not None or hit), hit

    @property
    def stop_matched(self) -> str | None:
        return self._stops.matched

    def flush(self) -> list[tuple[str, str]]:
        """Everything held back (a possible stop-string or marker prefix), as pieces."""
        return self._segment(self._stops.flush(), end=True)

    def _segment(self, text: str, *, end: bool) -> list[tuple[str, Any]]:
        if self._harmony is not None:
            return self._harmony_pieces(text, end=end)
        if self._sm is None:
            return [("content", text)] if text else []
        self._sm_state, segments = TextStateMachine.split(self._sm_state, text)
        if end:
            self._sm_state, flushed, state = TextStateMachine.flush(self._sm_state)
            segments.append((state, flushed))
        pieces: list[tuple[str, str]] = []
        for state, piece in segments:
            if state == "tool":
                self._tool_text += piece
            else:
                if self._prev_state == "tool":
                    pieces.append(("tool", self._tool_text))
                    self._tool_text = ""
                if piece:
                    pieces.append(("reasoning" if state == "reasoning" else "content", piece))
            self._prev_state = state
        if end and self._prev_state == "tool" and self._tool_text:
            pieces.append(("tool", self._tool_text))
            self._tool_text = ""
        return pieces

    def _harmony_pieces(self, text: str, *, end: bool) -> list[tuple[str, Any]]:
        """Harmony's events as pieces; a tool call streams as ("call", ToolCall) parts:
        the first names it, the later ones carry its arguments piece by piece."""
        events = self._harmony.feed(text) if text else []
        if end:
            events += self._harmony.finish()
        pieces: list[tuple[str, Any]] = []
        for event in events:
            if event.kind == "tool_name":
                self._call = [f"call_{uuid.uuid4().hex[:24]}", ""]
                pieces.append(("call", ToolCall(name=event.text, arguments="", id=self._call[0])))
            elif event.kind in ("tool_arguments", "tool_end") and self._call is not None:
                call_id, so_far = self._call
                piece = event.text
                if event.kind == "tool_end":
                    self._call = None
                    piece = "" if so_far.strip() else "{}"  # a call without arguments
                    _check_arguments(so_far)
                else:
                    self._call[1] += piece
                if piece:
                    pieces.append(("call", ToolCall(name="", arguments=piece, id=call_id)))
            elif event.text:
                pieces.append((event.kind, event.text))
        return pieces


class DetokenizerPort(Protocol):
    """How the Runtime reaches the Detokenizer."""

    def open(self, request_id: int, spec: TextSpec, outbox: Outbox, tokenizer: object) -> None:
        """Start a request's text, into ``outbox``."""

    def abort(self, request_id: int, reason: AbortReason) -> None:
        """End a request early with the terminal ``reason`` calls for (none for
        ``CLOSED``), and abort it in the engine; synchronous and idempotent."""

    def abort_all(self, reason: AbortReason) -> None:
        """``abort`` every open request (the server is shutting down)."""

    def open_requests(self) -> int: ...


class DetokenizerCore:
    """Sans-IO: ``open`` / ``abort`` requests, ``on_outputs`` per engine step.

    Each request is opened with the tokenizer of the model it leased, so a
    model swap or an engine restart needs nothing from this core: requests
    waiting through a restart keep their entries."""

    def __init__(self, *, scheduler: SchedulerPort):
        self._scheduler = scheduler
        self._requests: dict[int, tuple[RequestText, Outbox]] = {}
        self._per_tokenizer: dict[int, tuple[Any, TextStateMachine, bool]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def open(self, request_id: int, spec: TextSpec, outbox: Outbox, tokenizer) -> None:
        state_machine, harmony = self._splitter(tokenizer)
        self._requests[request_id] = (
            RequestText(spec, tokenizer, state_machine, harmony=harmony),
            outbox,
        )

    def _splitter(self, tokenizer) -> tuple[TextStateMachine, bool]:
        """One state machine per tokenizer (its markers), and whether it speaks Harmony;
        the last few tokenizers are remembered."""
        entry = self._per_tokenizer.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            if len(self._per_tokenizer) >= 4:
                self._per_tokenizer.pop(next(iter(self._per_tokenizer)))
            entry = (tokenizer, _make_state_machine(tokenizer), is_harmony_tokenizer(tokenizer))
            self._per_tokenizer[id(tokenizer)] = entry
        return entry[1], entry[2]

    def abort(self, request_id: int, reason: AbortReason) -> None:
        """End a request early, then abort it in the engine (idempotent).

        ``CLOSED``: dropped (its Session is gone); otherwise its held-back text
        first, then ``DEADLINE``: ``Finished`` with "length"; ``STOP_STRING``:
        ``Finished`` with "stop"; ``SHUTDOWN``: ``Failed`` (503)."""
        entry = self._requests.pop(request_id, None)
        if entry is not None and reason is not AbortReason.CLOSED:
            text, outbox = entry
            self._deliver(text, outbox, text.flush(), ())
            if reason is AbortReason.SHUTDOWN:
                failure = Failed.of(shutting_down())
                outbox.put_terminal(attrs.evolve(failure, usage=self._usage(text)))
            else:
                finish = FinishReason.LENGTH if reason is AbortReason.DEADLINE else FinishReason.STOP
                outbox.put_terminal(self._finished(text, finish))
        self._scheduler.abort(request_id, reason)

    def abort_all(self, reason: AbortReason) -> None:
        for request_id in list(self._requests):
            self.abort(request_id, reason)

    def _fail(self, request_id: int, failure: Failed) -> None:
        """The engine failed the sequence: its held-back text, then ``failure``."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        text, outbox = entry
        self._deliver(text, outbox, text.flush(), ())
        outbox.put_terminal(attrs.evolve(failure, usage=self._usage(text)))

    def on_outputs(self, outputs: StepOutputs) -> None:
        for started in outputs.started:
            entry = self._requests.get(started.request_id)
            if entry is not None:
                entry[0].cached_tokens = started.cached_tokens
                entry[0].cache_miss_reason = started.miss_reason
                entry[0].queued_seconds = started.queued_seconds
        for p in outputs.progress:
            entry = self._requests.get(p.request_id)
            if entry is not None:
                entry[1].put_progress(Progress(done=p.done, total=p.total))
        for event in outputs.tokens:
            self._on_token(event)
        for aborted in outputs.aborted:
            entry = self._requests.pop(aborted.request_id, None)
            if entry is not None:
                entry[1].put_terminal(self._finished(entry[0], FinishReason.ABORT))
        for failed in outputs.failed:
            if failed.retryable:  # the engine stopped, or a step ran out of memory: retry
                failure = Failed.of(Unavailable(failed.message, retry_after=RESTART_RETRY_AFTER))
            else:
                failure = Failed(message=failed.message)
            self._fail(failed.request_id, failure)

    def _on_token(self, event: TokenEvent) -> None:
        entry = self._requests.get(event.request_id)
        if entry is None:
            return  # aborted, or already finished by a stop string
        text, outbox = entry
        pieces, hit = text.add(event.token, final=event.finish_reason)
        logprobs = (_token_logprob(text.tokenizer, event),) if event.logprob is not None else ()
        self._deliver(text, outbox, pieces, logprobs)
        if hit:
            self._requests.pop(event.request_id, None)
            self._scheduler.abort(event.request_id, AbortReason.STOP_STRING)
            outbox.put_terminal(
                self._finished(text, FinishReason.STOP, stop_sequence=text.stop_matched)
            )
        elif event.finish_reason is not None:
            self._requests.pop(event.request_id, None)
            outbox.put_terminal(self._finished(text, event.finish_reason))

    def _deliver(self, text: RequestText, outbox: Outbox, pieces, logprobs) -> None:
        content: list[str] = []
        reasoning: list[str] = []
        tool_calls: list[ToolCall] = []
        for kind, piece in pieces:
            if kind == "call":
                last = tool_calls[-1] if tool_calls else None
                if last is not None and last.id == piece.id:  # two parts of one call: joined
                    piece = attrs.evolve(last, arguments=last.arguments + piece.arguments)
                    tool_calls[-1] = piece
                else:
                    tool_calls.append(piece)
            elif kind == "tool":
                tools = None if text.spec.tools is None else list(text.spec.tools)
                calls = self._parse_tool(text.tokenizer, piece, tools)
                if calls is None:
                    content.append(piece)  # rejected by the parser: returned as text
                else:
                    tool_calls.extend(calls)
            elif kind == "reasoning":
                reasoning.append(piece)
            else:
                content.append(piece)
        if tool_calls:
            text.made_tool_call = True
        outbox.put_delta(
            content="".join(content),
            reasoning="".join(reasoning),
            tool_calls=tuple(tool_calls),
            logprobs=logprobs,
        )

    def _finished(
        self, text: RequestText, reason: str, *, stop_sequence: str | None = None
    ) -> Finished:
        if reason == FinishReason.STOP and text.made_tool_call:
            reason = FinishReason.TOOL_CALLS
        return Finished(
            finish_reason=FinishReason(reason),
            stop_sequence=stop_sequence,
            usage=self._usage(text),
        )

    @staticmethod
    def _usage(text: RequestText) -> Usage:
        return Usage(
            prompt_tokens=text.spec.prompt_tokens,
            completion_tokens=text.completion_tokens,
            cached_tokens=text.cached_tokens,
            cache_miss_reason=text.cache_miss_reason,
            queued_seconds=text.queued_seconds,
        )

    def _parse_tool(self, tokenizer, tool_text: str, tools) -> list[ToolCall] | None:
        """The calls in one tool block, or None if the parser rejects it."""
        try:
            parser = getattr(tokenizer, "tool_parser", None)
            if parser is None:
                raise ValueError("this model has no tool-call parser")
            parsed = parser(tool_text, tools)
            parsed = parsed if isinstance(parsed, list) else [parsed]
            return [_tool_call(p) for p in parsed]
        except Exception as exc:  # a bad call is returned as text, never a crash
            log.warning(
                "tool call not parsed (%s: %s); returning it as text", type(exc).__name__, exc
            )
            return None



def _token_logprob(tokenizer, event: TokenEvent) -> TokenLogprob:
    decode = tokenizer.decode
    return TokenLogprob(
        token=event.token,
        text=decode([event.token]),
        logprob=float(event.logprob),
        top=tuple((i, decode([i]), float(lp)) for i, lp in event.top_logprobs),
    )


def _tool_call(parsed: Any) -> ToolCall:
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        raise ValueError(f"not a tool call: {parsed!r}")
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(
        name=parsed["name"],
        arguments=arguments,
        id=str(parsed.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
    )


def _check_arguments(arguments: str) -> None:
    """A streamed call's arguments, once whole: already sent, so only logged when not
    a JSON object."""
    try:
        valid = not arguments.strip() or isinstance(json.loads(arguments), dict)
    except ValueError:
        valid = False
    if not valid:
        log.warning("tool call arguments are not a JSON object: %.200r", arguments)


def _make_state_machine(tokenizer) -> TextStateMachine:
    from mlx_lm.generate import make_text_state_machine

    return make_text_state_machine(tokenizer)


class Detokenizer:
    """The actor: one ``on_outputs`` per engine step received; ``DetokenizerPort``
    is its surface."""

    def __init__(self, core: DetokenizerCore):
        self._core = core

    def open(self, request_id: int, spec: TextSpec, outbox: Outbox, tokenizer: object) -> None:
        self._core.open(request_id, spec, outbox, tokenizer)

    def abort(self, request_id: int, reason: AbortReason) -> None:
        self._core.abort(request_id, reason)

    def abort_all(self, reason: AbortReason) -> None:
        self._core.abort_all(reason)

    def open_requests(self) -> int:
        return len(self._core)

    async def run(
        self,
        outputs: trio.MemoryReceiveChannel[StepOutputs],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        async with outputs:
            async for step in outputs:
                self._core.on_outputs(step)
