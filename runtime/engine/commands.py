"""Where an engine loop's commands come from: this process's inbox, or rank 0's.

The engine loops (``runtime.engine.loop``) drain their inbox between steps and
hand what they drained to the engine's ``CommandSource``, which answers with
the commands to apply before the next step, or ``None`` for no step this
round. Two variants:

* ``LocalCommands``: one process serves the model; the inbox's commands as
  they are, a step whenever there are commands or work.
* ``SharedCommands``: a distributed group (``runtime.distributed``). Every step
  is preceded by one collective exchange (``share``) that gives every rank
  rank 0's commands, so all ranks apply the same commands and run identical
  steps; rank 0 never steps without an exchange, nor exchanges without a
  step. While idle rank 0 exchanges an empty list every ``heartbeat`` seconds,
  so a lost rank shows even without traffic. Followers (``follow``) take
  what rank 0 sent; leaving without a ``Shutdown``, rank 0 sends one
  (``close``) so that the followers stop too.

``drain`` empties an inbox (``queue.SimpleQueue``, or an engine process's
``ConnectionInbox``) without blocking while there is work.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Protocol

from runtime.distributed import HEARTBEAT_SECONDS
from runtime.messages import EngineCommand, Shutdown

log = logging.getLogger(__name__)


class CommandSource(Protocol):
    lockstep: bool  # every rank of a group must run the same steps

    def exchange(self, commands: list[EngineCommand], *, has_work: bool) -> list | None:
        """The commands to apply before the next step, or ``None``: no step this round."""

    def follow(self) -> list[EngineCommand]:
        """A follower rank: the commands rank 0 applies before its next step (blocks)."""

    def close(self) -> None:
        """The loop ends without a ``Shutdown`` (cancelled): tell whoever must know."""

    def failure(self, exc: BaseException) -> str:
        """What requests are told when the engine loop fails with ``exc``."""


class LocalCommands:
    """This process's inbox is the only source."""

    lockstep = False

    def exchange(self, commands: list[EngineCommand], *, has_work: bool) -> list | None:
        return commands if commands or has_work else None

    def follow(self) -> list[EngineCommand]:
        raise TypeError("only a rank of a distributed group follows another")

    def close(self) -> None:
        pass

    def failure(self, exc: BaseException) -> str:
        return f"the engine crashed ({type(exc).__name__}: {exc}); it is restarting"


class SharedCommands:
    """Rank 0's commands, shared with every rank of a distributed group once per step.

    ``share(commands)`` is the collective (``runtime.distributed.CommandExchange.share``):
    every rank calls it once per step, in the same order; rank 0 passes its
    list, the others ``None``, and all get rank 0's list back.
    """

    lockstep = True

    def __init__(
        self,
        share: Callable[[list | None], list],
        *,
        heartbeat: float = HEARTBEAT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._share = share
        self.heartbeat = heartbeat
        self._clock = clock
        self._last_shared = clock()

    def exchange(self, commands: list[EngineCommand], *, has_work: bool) -> list | None:
        now = self._clock()
        if not (commands or has_work or now - self._last_shared >= self.heartbeat):
            return None
        self._last_shared = now
        return self._share(commands)

    def follow(self) -> list[EngineCommand]:
        return self._share(None)

    def close(self) -> None:
        try:
            self._share([Shutdown()])
        except Exception:
            log.debug("could not tell the other ranks to stop")

    def failure(self, exc: BaseException) -> str:
        return f"the distributed engine failed ({type(exc).__name__}: {exc})"


def drain(inbox, *, block: bool, timeout: float) -> list[EngineCommand]:
    """Everything in ``inbox`` now; waits up to ``timeout`` for a first one when ``block``."""
    commands = []
    try:
        commands.append(inbox.get(timeout=timeout) if block else inbox.get_nowait())
        while True:
            commands.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return commands
