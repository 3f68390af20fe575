"""The engine -> trio hand-over: bounded by construction, never dropping a message.

Owns one trio memory channel and the two kinds of credit that bound it:

* ``steps_ahead`` credits (a ``threading.Semaphore``, one pool for every
  engine a ModelLoader runs, restarts and swaps included) for the engine's
  ``StepOutputs``. The engine thread takes a credit before a step is handed
  over (blocking the engine, never the event loop) and the consumer gives it
  back when it takes the step, so at most ``steps_ahead`` steps are in flight
  and the engine runs at most that far ahead of the Scheduler.
* ``LIFECYCLE_SLOTS`` credits (a ``trio.Semaphore``) for the ModelLoader's
  ``ModelReady`` / ``ModelLost`` notes, taken with ``await`` on the trio side.

The channel holds ``steps_ahead + LIFECYCLE_SLOTS`` items, exactly what the
credits allow, so ``send_nowait`` can never find it full: a terminal event
cannot be dropped, so a request cannot hang on a lost message.

Receives ``StepOutputs`` from the engine thread (``put_from_thread``) and
lifecycle messages from trio tasks (``put``); emits ``HandedOver`` items to
one consumer, which calls ``taken()`` on each as it takes it.

Cancellation: ``put`` is a checkpoint; ``put_from_thread`` waits for a credit
in short slices and calls ``check_cancelled`` between them, so a cancelled
runtime never leaves the engine thread blocked here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import attrs
import trio

LIFECYCLE_SLOTS = 2
CREDIT_WAIT_SECONDS = 0.05


@attrs.frozen
class HandedOver:
    """One message, with the credit its consumer gives back on receipt."""

    message: Any
    _release: Callable[[], None] = attrs.field(eq=False, repr=False)

    def taken(self) -> Any:
        self._release()
        return self.message


class Handover:
    def __init__(self, steps_ahead: int):
        if steps_ahead < 1:
            raise ValueError("steps_ahead must be at least 1")
        self.steps_ahead = steps_ahead
        self._step_credits = threading.Semaphore(steps_ahead)
        self._lifecycle_credits = trio.Semaphore(LIFECYCLE_SLOTS)
        self._send, self.receive = trio.open_memory_channel[HandedOver](
            steps_ahead + LIFECYCLE_SLOTS
        )
        self._token: trio.lowlevel.TrioToken | None = None

    def bind(self) -> None:
        """Call from the trio thread before any engine thread starts."""
        self._token = trio.lowlevel.current_trio_token()

    # ------------------------------------------------------------- producers

    def put_from_thread(self, message: Any, check_cancelled: Callable[[], None]) -> None:
        """From the engine thread: wait for a step credit, then hand over without waiting."""
        while not self._step_credits.acquire(timeout=CREDIT_WAIT_SECONDS):
            check_cancelled()
        assert self._token is not None, "Handover.bind() was not called"
        try:
            self._token.run_sync_soon(self._deliver, message, self._step_credits.release)
        except trio.RunFinishedError:
            self._step_credits.release()

    async def put(self, message: Any) -> None:
        """From a trio task: a lifecycle note, in order with the steps handed over so far."""
        await self._lifecycle_credits.acquire()
        self._deliver(message, self._lifecycle_credits.release)

    def _deliver(self, message: Any, release: Callable[[], None]) -> None:
        # Never full (see the module docstring); closed only when the runtime stops.
        try:
            self._send.send_nowait(HandedOver(message, release))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            release()

    def close(self) -> None:
        self._send.close()
