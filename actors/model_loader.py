"""ModelLoader: owns the engine thread, from model load to exit, and restarts it.

The engine thread lives exactly as long as one loaded model: it is started by
``trio.to_thread.run_sync`` (one call for the model's lifetime, never one per
step, with ``abandon_on_cancel=False`` so trio waits for it and no orphan thread
keeps the model in memory). Its first act is loading the model on itself,
since MLX streams and RNG state belong to the thread that made them.

``ModelLoaderCore`` is the sans-IO state machine (loading -> ready -> restarting
-> ready ... | failed | stopped) that ``/health`` reads. Emits to the runtime:
``on_ready(handle, inbox)`` when the engine can take requests, and
``on_lost(reason, permanent)`` when it stopped taking them.
"""

from __future__ import annotations

import enum
import functools
import logging
import queue
from collections.abc import Callable

import trio

from runtime.engine import EngineCore, ModelHandle, run_engine_loop
from runtime.messages import StepOutputs

log = logging.getLogger(__name__)


class ModelState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


class ModelLoaderCore:
    def __init__(self, *, max_restarts: int = 5):
        self.state = ModelState.LOADING
        self.reason: str | None = None
        self.handle: ModelHandle | None = None
        self.restarts = 0
        self.max_restarts = max_restarts

    def ready(self, handle: ModelHandle) -> None:
        self.state = ModelState.READY
        self.reason = None
        self.handle = handle

    def crashing(self, reason: str) -> None:
        """The engine thread is going down with an error: stop reporting ready."""
        self.state = ModelState.RESTARTING
        self.reason = reason

    def engine_exited(self, error: BaseException | None) -> bool:
        """Record how the engine thread ended; returns whether to start it again."""
        if error is None:
            self.state = ModelState.STOPPED
            return False
        self.reason = f"{type(error).__name__}: {error}"
        if self.handle is None or self.restarts >= self.max_restarts:
            self.state = ModelState.FAILED
            return False
        self.restarts += 1
        self.state = ModelState.RESTARTING
        return True

    def backoff(self) -> float:
        return min(0.1 * 2**self.restarts, 5.0)


class ModelLoader:
    def __init__(
        self,
        make_core: Callable[[], EngineCore],
        *,
        outputs: trio.MemorySendChannel[StepOutputs],
        on_ready: Callable[[ModelHandle, queue.SimpleQueue], None],
        on_lost: Callable[[str, bool], None],
        core: ModelLoaderCore | None = None,
    ):
        self.core = core or ModelLoaderCore()
        self._make_core = make_core
        self._outputs = outputs
        self._on_ready = on_ready
        self._on_lost = on_lost
        self.inbox: queue.SimpleQueue | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._outputs:
            while True:
                inbox: queue.SimpleQueue = queue.SimpleQueue()
                error: BaseException | None = None
                try:
                    await trio.to_thread.run_sync(
                        functools.partial(self._engine_thread, inbox),
                        thread_name="mlx-engine",
                        abandon_on_cancel=False,
                    )
                except Exception as exc:
                    error = exc
                    log.error("engine thread ended with %s: %s", type(exc).__name__, exc)
                finally:
                    self.inbox = None
                again = self.core.engine_exited(error)
                self._on_lost(self.core.reason or "the engine stopped", not again)
                if not again:
                    return
                log.warning("restarting the engine (%d) in %.1fs", self.core.restarts, self.core.backoff())
                await trio.sleep(self.core.backoff())
                self.core.state = ModelState.LOADING

    def _engine_thread(self, inbox: queue.SimpleQueue) -> None:
        """Runs on the engine thread."""

        def ready(core: EngineCore) -> None:
            trio.from_thread.run_sync(self._ready, core.handle, inbox)

        def emit(outputs: StepOutputs) -> None:
            trio.from_thread.run(self._outputs.send, outputs)

        def crashed(reason: str) -> None:
            trio.from_thread.run_sync(self.core.crashing, reason)

        run_engine_loop(
            self._make_core,
            inbox,
            emit,
            trio.from_thread.check_cancelled,
            on_ready=ready,
            on_crash=crashed,
        )

    def _ready(self, handle: ModelHandle, inbox: queue.SimpleQueue) -> None:
        self.inbox = inbox
        self.core.ready(handle)
        log.info("model ready: %s", handle.model_key)
        self._on_ready(handle, inbox)
