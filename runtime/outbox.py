"""A request's mailbox between the Detokenizer and its Session.

The Detokenizer ``put``s synchronously and never blocks; the Session
``await``s ``get()``. If the Session lags, new text is merged into the pending
``Delta`` instead of queued, so the mailbox holds at most one progress note,
one merged delta and one terminal message: bounded by construction, and a slow
client never holds up the engine.

Cancellation: ``get()`` is a checkpoint. ``close()`` is synchronous, so it is
safe in cleanup that runs while cancelled; puts after ``close()`` are dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from runtime.messages import Delta, Failed, Finished, Progress, TokenLogprob, ToolCall


class Outbox:
    def __init__(self, on_put: Callable[[], None] | None = None) -> None:
        """``on_put`` is called whenever something is put (several choices of one
        request wait on all their outboxes at once: ``actors.session``)."""
        self._on_put = on_put
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls: list[ToolCall] = []
        self._logprobs: list[TokenLogprob] = []
        self._progress: Progress | None = None
        self._terminal: Finished | Failed | None = None
        self._wakeup = trio.Event()
        self._closed = False
        self._delivered_terminal = False

    # -------------------------------------------------------------- producer

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def has_terminal(self) -> bool:
        return self._terminal is not None or self._delivered_terminal

    @property
    def finished(self) -> bool:
        """Nothing more will come out: closed, or the terminal was taken."""
        return self._closed or self._delivered_terminal

    def _wake(self) -> None:
        self._wakeup.set()
        if self._on_put is not None:
            self._on_put()

    def put_delta(
        self,
        *,
        content: str = "",
        reasoning: str = "",
        tool_calls: tuple[ToolCall, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        if self._closed or self.has_terminal:
            return
        if content:
            self._content.append(content)
        if reasoning:
            self._reasoning.append(reasoning)
        self._tool_calls.extend(tool_calls)
        self._logprobs.extend(logprobs)
        if content or reasoning or tool_calls or logprobs:
            self._wake()

    def put_progress(self, progress: Progress) -> None:
        if self._closed or self.has_terminal:
            return
        self._progress = progress
        self._wake()

    def put_terminal(self, message: Finished | Failed) -> None:
        """The one terminal message; later terminals are ignored."""
        if self._closed or self.has_terminal:
            return
        self._terminal = message
        self._wake()

    def close(self) -> None:
        self._closed = True
        self._wake()

    # -------------------------------------------------------------- consumer

    def take(self) -> tuple[Progress | Delta | Finished | Failed, ...]:
        """Everything pending, in order: progress, merged delta, terminal."""
        items: list = []
        if self._progress is not None:
            items.append(self._progress)
            self._progress = None
        if self._content or self._reasoning or self._tool_calls or self._logprobs:
            items.append(
                Delta(
                    content="".join(self._content),
                    reasoning="".join(self._reasoning),
                    tool_calls=tuple(self._tool_calls),
                    logprobs=tuple(self._logprobs),
                )
            )
            self._content.clear()
            self._reasoning.clear()
            self._tool_calls.clear()
            self._logprobs.clear()
        if self._terminal is not None:
            items.append(self._terminal)
            self._terminal = None
            self._delivered_terminal = True
        return tuple(items)

    async def get(self) -> tuple[Progress | Delta | Finished | Failed, ...]:
        """Wait until something is pending, then take it all."""
        while True:
            items = self.take()
            if items:
                return items
            if self._closed or self._delivered_terminal:
                raise trio.EndOfChannel
            await self._wakeup.wait()
            self._wakeup = trio.Event()
