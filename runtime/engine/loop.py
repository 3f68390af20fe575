"""The engine loops: the body of the thread (or process) that owns MLX for one model.

``run_engine_loop`` builds the engine (``make_core``, on this thread: MLX
streams belong to the thread that made them), then alternates draining the
inbox (a ``queue.SimpleQueue``: thread-safe, sync ``put``, so even a
cancelled trio task can post an ``Abort``) and stepping. It blocks on the
inbox only when there is no work, and hands each step's outputs to ``emit``,
which blocks while the trio side is more than a step or two behind. The
engine's ``CommandSource`` (``runtime.engine.commands``) decides what a round
applies and whether it steps (distributed: after one exchange with the other
ranks).

``run_follower_loop`` is a distributed rank other than 0: rank 0's commands
in, identical steps, outputs dropped. ``run_follower`` loads such a rank's
shard and runs it (the ``mlx-trio-server`` command on ranks > 0), watched by
a ``LeaderWatch`` (it leaves when its launcher or rank 0 is gone).

Both loops end the same way (``_close``): fail what is left, release the
batch generator, and drop the model on the thread that made its arrays.

``settle_heap`` (once a model is up, in each process that serves it) moves
what the process holds after loading out of the garbage collector's way.
"""

from __future__ import annotations

import gc
import logging
import queue
import time
from collections.abc import Callable

from runtime.distributed import LeaderWatch, ParentWatch, launched_rank
from runtime.engine.commands import drain
from runtime.engine.core import EngineCore
from runtime.messages import EngineCommand, Shutdown, StepOutputs

log = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 0.05
SHUTTING_DOWN = "the engine is shutting down"


def settle_heap() -> None:
    """Collect, then freeze every object the process holds (``gc.freeze``).

    Called once a model is up. What loading made (modules, the model's Python
    objects, the tokenizer's tables: about 110,000 objects with the tiny test
    model) lives as long as the model, yet every full collection walked it:
    60-90 ms on a 2-core CPU, a pause of the engine loop (ten decode steps at
    32 rows on an H200) or of the API's event loop (no arrivals, no chunks)
    whenever a burst of requests set one off. Frozen, a full collection walks
    only what came after. Unfrozen first: the cycles of a model swapped out
    since the last call can go.
    """
    began = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    log.info(
        "froze %d objects for the garbage collector in %.0f ms",
        gc.get_freeze_count(),
        1000 * (time.perf_counter() - began),
    )


def run_engine_loop(
    make_core: Callable[[], EngineCore],
    inbox: queue.SimpleQueue,
    emit: Callable[[StepOutputs], None],
    check_cancelled: Callable[[], None],
    *,
    on_ready: Callable[[EngineCore], None] = lambda core: None,
    on_crash: Callable[[str], None] = lambda reason: None,
    on_tick: Callable[[], None] = lambda: None,
    idle_wait: float = IDLE_WAIT_SECONDS,
) -> None:
    """The engine thread's body. Returns on ``Shutdown``; raises on cancellation.

    ``on_tick`` is called after every step, heartbeat or idle wake-up (liveness).
    """
    core = make_core()
    source = core.commands
    reason = SHUTTING_DOWN
    ended = False  # by a Shutdown or a crash: nobody else needs telling
    try:
        on_ready(core)
        while True:
            check_cancelled()
            # Held requests and nothing decoding: wait for a command, not past the window.
            hold = core.hold_timeout()
            drained = drain(
                inbox,
                block=hold is not None or not core.has_work,
                timeout=idle_wait if hold is None else hold,
            )
            commands = source.exchange(drained, has_work=core.has_work)
            if commands is None:
                on_tick()  # an idle wake-up (to see cancellation): no step
                continue
            if not _apply(core, commands):
                ended = True
                return
            outputs = core.step()
            on_tick()
            if outputs:
                emit(outputs)
    except Exception as exc:
        ended = True
        reason = source.failure(exc)
        try:
            on_crash(reason)  # /health turns 503 before the failures go out
        except BaseException:
            log.debug("could not report the crash")
        raise
    finally:
        if not ended:
            source.close()  # cancelled: stop the other ranks too
        _close(core, reason, emit)
        del core
        gc.unfreeze()  # the model's frozen objects (settle_heap) may be cycles
        gc.collect()


def run_follower_loop(core: EngineCore, on_tick: Callable[[], None] = lambda: None) -> None:
    """A distributed rank other than 0: rank 0's commands in, identical steps, outputs dropped.

    Returns on ``Shutdown``; a lost peer raises from the collective. ``on_tick``
    is called whenever rank 0 was heard from (an exchange) and after each step.
    """
    try:
        while True:
            commands = core.commands.follow()
            on_tick()
            if not _apply(core, commands):
                break
            core.step()
            on_tick()
    finally:
        _close(core, "this rank is stopping", None)
        gc.unfreeze()
        gc.collect()


def run_follower(config, parent: ParentWatch | None = None) -> int:
    """A rank other than 0: load its shard and step in lockstep with rank 0 until Shutdown.

    Beside it a ``LeaderWatch`` ends the process when the launcher (``parent``)
    is gone or rank 0 falls silent for ``--distributed-timeout`` seconds."""
    from runtime.engine.loading import make_engine_core

    rank = launched_rank()
    watch = LeaderWatch(parent, config.distributed_timeout)
    watch.start()
    core = make_engine_core(config, config.model)
    if not core.commands.lockstep:
        log.error("this process was launched as rank %s but found no group", rank)
        return 1
    settle_heap()
    log.info("rank %s ready; following rank 0", rank)
    watch.tick()
    try:
        run_follower_loop(core, watch.tick)
    except Exception:
        log.exception("rank %s: the engine failed", rank)
        return 1
    log.info("rank %s: shutdown from rank 0", rank)
    return 0


def _apply(core: EngineCore, commands: list[EngineCommand]) -> bool:
    """Hand ``commands`` to the engine in order; False at a ``Shutdown`` (the rest is dropped)."""
    for command in commands:
        if isinstance(command, Shutdown):
            return False
        core.handle_command(command)
    return True


def _close(core: EngineCore, reason: str, emit: Callable[[StepOutputs], None] | None) -> None:
    """Fail what is still running, deliver that (``emit``), and drop the model."""
    log.info("stopping after %d engine steps", core.counters.steps)
    leftover = core.close(reason)
    if leftover and emit is not None:
        try:
            emit(leftover)
        except BaseException:  # the trio side is gone: nobody to tell
            log.debug("could not deliver the engine's final outputs")
    # Free the model's arrays here, on the thread that made them: the trio
    # side keeps the handle (for its tokenizer) but must not keep the model.
    core.handle.model = None
