"""The admission window: requests the engine holds back so that arrivals join its batch together.

mlx-lm's ``BatchGenerator`` adds a sequence by extending its prompt batch and
moves finished prompts to decoding by splitting it; each rebuilds the KV
arrays of the whole batch. So while at least ``batch`` sequences decode, a new
request waits here (not in the batch) until ``batch`` wait with ``tokens``
prompt tokens (or, with those decoding, they reach ``limit``) or the window
ends; it also waits while a sequence of the batch has its prompt done but not
yet its first token (``awaiting_first``: a prefill started in between would
delay that token by its whole length), and while ``Submit.followed`` says
more of its burst are on their way. ``burst_wait``: while nothing decodes, a
request that arrives alone waits that long for a second one.

Sans-IO: the engine core asks ``holds`` when a ``Submit`` arrives, ``due``
before each step (the requests to insert now), ``timeout`` when its loop may
sleep and ``waited`` as it inserts one (how long since it arrived); it drops
aborted ones (``runtime.engine.choices.abort_waiting`` over ``held``) and
clears them when it closes. Receives and emits ``Submit``s.
"""

from __future__ import annotations

import collections
import time

from runtime.messages import Submit

# Arrival times kept for ``waited``: a request that never starts is forgotten behind this
# many later ones.
ARRIVALS_KEPT = 4096


class AdmissionWindow:
    """The requests held back, and the rules that release them.

    ``window`` (seconds; 0: off), ``burst_wait`` (seconds; needs the window),
    ``batch`` (``--prompt-concurrency``), ``tokens`` (``--prefill-group-tokens``),
    ``limit`` (``--decode-concurrency``)."""

    def __init__(
        self,
        *,
        window: float = 0.0,
        burst_wait: float = 0.0,
        batch: int = 8,
        tokens: int = 0,
        limit: int | None = None,
    ):
        self.window = window
        self.burst_wait = burst_wait if window > 0 else 0.0
        self.batch = batch
        self.tokens = tokens
        self.limit = limit
        self.held: collections.deque[tuple[float, Submit]] = collections.deque()
        self._arrived: collections.OrderedDict[int, float] = collections.OrderedDict()

    def __bool__(self) -> bool:
        return bool(self.held)

    def request_ids(self) -> list[int]:
        return [i for _, sub in self.held for i in sub.request_ids]

    def holds(self, submit: Submit, *, decoding: int, awaiting_first: bool) -> bool:
        """Whether ``submit`` waits (then it is held: the caller does not insert it)."""
        self._arrived.setdefault(submit.request_id, time.monotonic())
        if len(self._arrived) > ARRIVALS_KEPT:
            self._arrived.popitem(last=False)
        if self.window <= 0 or not (
            self.held  # behind those already waiting (the next step decides for all)
            or awaiting_first
            or decoding >= self.batch
            or submit.followed
            or (self.burst_wait > 0 and not decoding)
        ):
            return False
        self.held.append((time.monotonic(), submit))
        return True

    def timeout(self, *, decoding: int) -> float | None:
        """While nothing decodes and requests are held (a burst: ``Submit.followed``, or
        the burst wait): how long the engine loop may wait for a command before the
        oldest one's hold ends (None: step now; held requests that nothing else holds
        join then)."""
        if decoding or not self.held:
            return None
        hold = self.window if self.held[-1][1].followed else self._lone_wait(decoding)
        return max(0.0, self.held[0][0] + hold - time.monotonic()) if hold else None

    def due(self, *, decoding: int, awaiting_first: bool) -> list[Submit]:
        """The held requests to insert before this step: all of them once the window is
        over (or they make a group, or nothing holds them), else none."""
        if not self.held:
            return []
        waited = time.monotonic() - self.held[0][0]
        if waited < self.window and (
            awaiting_first
            or (
                not self._make_a_group(decoding)
                and (decoding >= self.batch or self.held[-1][1].followed)
            )
        ):
            return []
        if waited < self._lone_wait(decoding):
            return []  # an idle engine's burst wait: others of the burst may follow
        due = [sub for _, sub in self.held]
        self.held.clear()
        return due

    def waited(self, request_id: int) -> float | None:
        """Seconds since ``request_id`` reached the engine (``holds``), as it is inserted:
        the window's hold, a shared prefix's leader, a read from disk. Forgotten once read."""
        arrived = self._arrived.pop(request_id, None)
        return None if arrived is None else time.monotonic() - arrived

    def clear(self) -> None:
        self.held.clear()

    def _lone_wait(self, decoding: int) -> float:
        """The burst wait while one request is held and nothing decodes (a second one
        that says nothing of others ends it: its burst has come), else 0."""
        return self.burst_wait if len(self.held) == 1 and not decoding else 0.0

    def _make_a_group(self, decoding: int) -> bool:
        """Do the held requests make a prefill group worth starting now?"""
        held = len(self.held)
        return held >= self.batch and (
            (self.limit is not None and held + decoding >= self.limit)
            or sum(len(sub.prompt) for _, sub in self.held) >= self.tokens
        )
