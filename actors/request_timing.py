"""One request's milestones and token counts, as its Session sees them.

``RequestTiming`` receives the items a Session hands its client (``note``) and
keeps when the request started, was submitted, first produced output and
ended, with its token counts and outcome; the access log, the request trace
and the metrics read it. Emits nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

from runtime.messages import Delta, Failed, Finished


@attrs.define
class RequestTiming:
    """One request's milestones (``time.monotonic()`` seconds) and token counts.

    ``outcome``: the finish reason, ``"error"`` for a ``Failed`` terminal, or
    None while none arrived (a client that left before the end)."""

    started: float = attrs.field(factory=time.monotonic)
    submitted: float | None = None  # handed to the Scheduler (prompt templated and tokenised)
    # Called once at the Submit when the request came over HTTP (``Arrivals``).
    on_submitted: Callable[[], None] | None = attrs.field(default=None, repr=False)
    first_output: float | None = None
    ended: float | None = None  # the terminal reached the Session
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queued: float | None = None  # seconds it waited for a place in the engine
    outcome: str | None = None

    def note(self, items, now: float) -> None:
        for item in items:
            if isinstance(item, Delta):
                if self.first_output is None and (
                    item.content or item.reasoning or item.tool_calls
                ):
                    self.first_output = now
            elif isinstance(item, Finished | Failed):
                self.ended = now
                self.outcome = "error" if isinstance(item, Failed) else str(item.finish_reason)
                if item.usage is not None:
                    self.prompt_tokens = item.usage.prompt_tokens
                    self.completion_tokens = item.usage.completion_tokens
                    self.cached_tokens = item.usage.cached_tokens
                    self.queued = item.usage.queued_seconds

    @property
    def time_to_first_output(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.started

    @property
    def duration(self) -> float | None:
        """Entering to the terminal (None: no terminal arrived)."""
        return None if self.ended is None else self.ended - self.started

    @property
    def inter_token(self) -> float | None:
        """Mean time between generated tokens, first output to the terminal."""
        if self.first_output is None or self.ended is None or self.completion_tokens < 2:
            return None
        return (self.ended - self.first_output) / (self.completion_tokens - 1)
