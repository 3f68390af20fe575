"""ModelLoader: owns the engine thread, from model load to exit; swaps and restarts it.

The engine thread lives exactly as long as one loaded model: it is started by
``trio.to_thread.run_sync`` (one call for the model's lifetime, never one per
step, with ``abandon_on_cancel=False`` so trio waits for it and no orphan thread
keeps a model in memory). Its first act is loading the model on itself, since
MLX streams and RNG state belong to the thread that made them.

Sessions ``acquire`` the model they need (a ``ModelKey``) and hold a lease on
it until they end. A request for another model marks a swap as pending: new
requests for the current model then wait, and once the last lease is released
the engine is shut down (freeing its model) and a new engine thread loads the
wanted one. A model that fails to load fails the requests waiting for it and
the server goes back to its default model; the default model failing to load
leaves the server up, answering 503 with the reason.

``ModelLoaderCore`` is the sans-IO state machine; others reach the actor
only through its port (``ModelLoaderPort``): ``acquire`` / ``release`` a lease,
``status`` (a frozen ``ModelStatus``, what ``/health`` reads) and
``context_window``. A lease's ``LoadedModel`` is the trio side's copy, without
the model's weights. Emits into the engine hand-over (``runtime.handover``),
in order with the engine's steps: ``ModelReady(info, inbox)`` when an engine
can take requests, and ``ModelLost(reason, permanent)`` when it stopped taking
them.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from runtime.engine.core import EngineCore
from runtime.engine.loop import run_engine_loop, settle_heap
from runtime.engine.process import EngineProcessError, run_engine_proxy
from runtime.errors import NotFound, Unavailable, shutting_down
from runtime.handover import Handover
from runtime.lifecycle import EngineInbox, EngineReady, ModelInfo, ModelLost, ModelReady
from runtime.loaded_model import LoadedModel
from runtime.messages import Shutdown, StepOutputs
from runtime.models import ModelKey
from runtime.tokenizing import encoder_for

log = logging.getLogger(__name__)

FAILED_LOAD_MEMORY = 10.0  # seconds a failed load is answered from memory
STEPS_AHEAD = 4  # engine steps handed over but not yet taken by the Scheduler
SHUTDOWN_GRACE = 10.0  # distributed: seconds to wait for the engine thread at shutdown
RESTART_WINDOW_SECONDS = 600.0  # restarts counted against max_restarts: those this recent


@attrs.frozen
class EngineProcessSpec:
    """How to run engines in child processes: the tokenizer for the trio side, logging,
    the CPU's BLAS (``--cpu-blas``)."""

    load_tokenizer: Callable[[EngineReady], object]
    log_level: str = "INFO"
    log_format: str = logging.BASIC_FORMAT
    cpu_blas: str = "openblas"


class ModelState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


class ModelLoaderCore:
    def __init__(self, default: ModelKey | None = None, *, max_restarts: int = 5):
        self.default = default or ModelKey("default")
        self.key = self.default  # the model loaded or loading now
        self.pending: ModelKey | None = None  # the model to load once leases reach 0
        self.leases = 0
        self.state = ModelState.LOADING
        self.reason: str | None = None
        self.handle: LoadedModel | None = None
        self.restarts = 0  # since the server started (/health, /metrics)
        # Restarts within the last RESTART_WINDOW_SECONDS: max_restarts of them mark the
        # model failed; older ones no longer count (a crash a week does not add up).
        self._recent_restarts: collections.deque[float] = collections.deque()
        self.max_restarts = max_restarts
        self.failed_loads: dict[ModelKey, tuple[str, float]] = {}
        self.waiting: collections.Counter[ModelKey] = collections.Counter()
        # Every model that has loaded: its context window (/v1/models, /health).
        self.context_windows: dict[ModelKey, int | None] = {}

    def ready(self, handle: LoadedModel) -> None:
        self.state = ModelState.READY
        self.reason = None
        self.handle = handle
        self.failed_loads.pop(self.key, None)
        self.context_windows[self.key] = handle.info.context_window

    def try_lease(self, key: ModelKey) -> bool:
        """Take a lease if ``key`` is loaded and not about to be swapped out.

        A request for another model asks for a swap only once nobody is waiting
        for the current one, so every swap serves the requests that caused it
        (no ping-pong between two models with neither making progress).
        """
        if key == self.key and self.state is ModelState.READY and self.pending is None:
            self.leases += 1
            return True
        if (
            self.pending is None
            and key != self.key
            and self.state is not ModelState.STOPPED
            and not self.waiting[self.key]
        ):
            self.pending = key
        return False

    def release(self) -> bool:
        """Drop a lease; returns whether the engine should now shut down for a swap."""
        self.leases = max(0, self.leases - 1)
        return self.swap_due()

    def swap_due(self) -> bool:
        return self.pending is not None and self.leases == 0 and self.state is ModelState.READY

    def crashing(self, reason: str) -> None:
        """The engine thread is going down with an error: stop reporting ready."""
        self.state = ModelState.RESTARTING
        self.reason = reason

    def engine_exited(self, error: BaseException | None) -> bool:
        """Record how the engine thread ended; returns whether to start one again."""
        if error is None:
            if self.pending is None:
                self.state = ModelState.STOPPED
                return False
            self.key, self.pending = self.pending, None  # a swap
            self.handle = None
            self.state = ModelState.LOADING
            return True
        self.reason = f"{type(error).__name__}: {error}"
        if isinstance(error, EngineProcessError):
            self.reason = str(error)  # already names the error
        if self.handle is not None:
            self.reason = f"the engine crashed ({self.reason})"
        if self.handle is None:  # it never loaded
            if self.key != self.default:
                self.failed_loads[self.key] = (self.reason, trio.current_time())
                self.key, self.pending = self.default, None
                self.state = ModelState.LOADING
                return True
            self.state = ModelState.FAILED
            return False
        now = trio.current_time()
        while self._recent_restarts and now - self._recent_restarts[0] > RESTART_WINDOW_SECONDS:
            self._recent_restarts.popleft()
        if len(self._recent_restarts) >= self.max_restarts:
            self.state = ModelState.FAILED
            return False
        self.restarts += 1
        self._recent_restarts.append(now)
        self.state = ModelState.RESTARTING
        self.handle = None
        return True

    def backoff(self) -> float:
        return min(0.1 * 2 ** len(self._recent_restarts), 5.0)


@attrs.frozen(kw_only=True)
class ModelStatus:
    """The ModelLoader's state at one moment (``/health``, ``/metrics``, start-up)."""

    state: ModelState
    reason: str | None
    model: ModelKey  # loaded or loading now
    default: ModelKey
    pending: ModelKey | None  # to load once the leases reach 0
    leases: int
    restarts: int
    info: ModelInfo | None  # the loaded model's (None: none is ready)
    ever_loaded: bool  # some model has loaded since the server started
    engine_mode: str  # "process" or "thread"


class ModelLoaderPort(Protocol):
    """How the Runtime (and through it each Session) reaches the ModelLoader."""

    async def acquire(self, key: ModelKey) -> LoadedModel:
        """Wait until ``key`` is loaded and lease it (404 / 503)."""

    def release(self) -> None:
        """Give a lease back; synchronous."""

    def status(self) -> ModelStatus: ...

    def context_window(self, key: ModelKey) -> int | None: ...


class ModelLoader:
    def __init__(
        self,
        make_core: Callable[[ModelKey], EngineCore],
        *,
        handover: Handover,
        core: ModelLoaderCore | None = None,
        distributed: bool = False,
        step_timeout: float = 60.0,
        engine_process: EngineProcessSpec | None = None,
        on_loaded: Callable[[float], None] = lambda seconds: None,
    ):
        """``distributed``: this is rank 0 of a group (``runtime.distributed``):
        no engine restarts (the group cannot be rebuilt in-process), a watchdog
        that declares the group lost when no step or heartbeat has come for
        ``step_timeout`` seconds, and a bounded wait for the engine thread at
        shutdown (a hung peer can block it in a collective for ever).

        ``engine_process``: run each engine in a child process
        (``runtime.engine.process``); the engine thread slot then holds the
        thread that relays its messages.

        ``on_loaded(seconds)``: an engine became ready, ``seconds`` after it was
        started (the model load: a restart's backoff is not counted)."""
        self._core = core or ModelLoaderCore()
        self._make_core = make_core
        self._handover = handover
        self.inbox: EngineInbox | None = None
        self._changed = trio.Event()
        self.distributed = distributed
        self.step_timeout = step_timeout
        self.last_tick = time.monotonic()  # written by the engine thread
        self.engine_process = engine_process
        self._on_loaded = on_loaded
        self._engine_started = time.monotonic()
        if distributed:
            self._core.max_restarts = 0

    # ------------------------------------------------------------- the port

    def status(self) -> ModelStatus:
        core = self._core
        return ModelStatus(
            state=core.state,
            reason=core.reason,
            model=core.key,
            default=core.default,
            pending=core.pending,
            leases=core.leases,
            restarts=core.restarts,
            info=core.handle.info if core.handle is not None else None,
            ever_loaded=bool(core.context_windows),
            engine_mode="process" if self.engine_process is not None else "thread",
        )

    def context_window(self, key: ModelKey) -> int | None:
        """The context window of ``key``, once it has loaded."""
        return self._core.context_windows.get(key)

    # ----------------------------------------------------- leases (Sessions)

    async def acquire(self, key: ModelKey, *, wait: float = 600.0) -> LoadedModel:
        """Wait (bounded) until ``key`` is loaded, and lease it. Raises 404 / 503."""
        self._core.waiting[key] += 1
        try:
            with trio.move_on_after(wait):
                return await self._wait_for_lease(key)
        finally:
            self._core.waiting[key] -= 1
            if not self._core.waiting[key]:
                del self._core.waiting[key]
            self._notify()  # a waiter leaving can unblock a swap
        raise Unavailable(f"model {key.model!r} is still loading", retry_after=5)

    async def _wait_for_lease(self, key: ModelKey) -> LoadedModel:
        while True:
            if self._core.try_lease(key):
                return self._core.handle
            failure = self._core.failed_loads.get(key)
            if failure is not None:
                reason, when = failure
                if trio.current_time() - when < FAILED_LOAD_MEMORY:
                    raise NotFound(
                        f"model {key.model!r} could not be loaded: {reason}", param="model"
                    )
                del self._core.failed_loads[key]  # long ago: try again
            if self._core.state is ModelState.FAILED:
                raise Unavailable(f"the model failed to load: {self._core.reason}", retry_after=30)
            if self._core.state is ModelState.STOPPED:
                raise shutting_down()
            self._maybe_swap()
            await self._changed.wait()

    def release(self) -> None:
        """Synchronous: called from Session cleanup, possibly while cancelled."""
        self._core.release()
        self._maybe_swap()

    def _maybe_swap(self) -> None:
        if self._core.swap_due() and self.inbox is not None:
            log.info("swapping model %s -> %s", self._core.key.model, self._core.pending.model)
            self.inbox.put(Shutdown())
            self.inbox = None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # ------------------------------------------------------------ the actor

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._handover.bind()
        if self.distributed:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_group)
                try:
                    await self._run_engines(task_status)
                finally:
                    nursery.cancel_scope.cancel()
        else:
            await self._run_engines(task_status)

    async def _run_engines(self, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        try:
            with contextlib.closing(self._handover):
                while True:
                    inbox: queue.SimpleQueue = queue.SimpleQueue()
                    error: BaseException | None = None
                    try:
                        await self._run_engine_thread(inbox)
                    except Exception as exc:
                        error = exc
                        log.error("engine thread ended with %s: %s", type(exc).__name__, exc)
                    finally:
                        self.inbox = None
                    again = self._core.engine_exited(error)
                    if self.distributed and error is not None:
                        self._core.reason = (
                            f"the distributed group failed ({self._core.reason}); "
                            "restart the whole launch"
                        )
                    await self._handover.put(
                        ModelLost(reason=self._core.reason or "the engine stopped", permanent=not again)
                    )
                    self._notify()
                    if not again:
                        return
                    if self._core.state is ModelState.RESTARTING:
                        log.warning(
                            "restarting the engine (%d) in %.1fs",
                            self._core.restarts,
                            self._core.backoff(),
                        )
                        await trio.sleep(self._core.backoff())
                        self._core.state = ModelState.LOADING
        finally:
            if self._core.state is not ModelState.FAILED:
                self._core.state = ModelState.STOPPED
            self._notify()

    async def _run_engine_thread(self, inbox: queue.SimpleQueue) -> None:
        self._engine_started = time.monotonic()
        if not self.distributed:
            # trio waits for the thread: no orphan keeps a model in memory.
            await trio.to_thread.run_sync(
                functools.partial(self._engine_thread, inbox, self._core.key),
                thread_name="mlx-engine",
                abandon_on_cancel=False,
            )
            return
        # Distributed: a hung peer can hold the thread in a collective for ever,
        # so on cancellation wait for it (it tells the other ranks to stop on
        # its way out) only for a bounded time.
        finished = threading.Event()
        try:
            await trio.to_thread.run_sync(
                functools.partial(self._engine_thread, inbox, self._core.key, finished),
                thread_name="mlx-engine",
                abandon_on_cancel=True,
            )
        except trio.Cancelled:
            grace = 0.0 if self._core.state is ModelState.FAILED else SHUTDOWN_GRACE
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(finished.wait, grace, abandon_on_cancel=True)
            raise

    async def _watch_group(self) -> None:
        """Rank 0: no step or heartbeat for ``step_timeout`` means a peer died or hung."""
        interval = min(1.0, self.step_timeout / 4)
        while True:
            await trio.sleep(interval)
            if self._core.state is not ModelState.READY:
                continue
            silent = time.monotonic() - self.last_tick
            if silent > self.step_timeout:
                await self._group_lost(
                    f"the distributed group stopped responding: no engine step for "
                    f"{silent:.0f} s (a rank died or hung); restart the whole launch"
                )

    async def _group_lost(self, reason: str) -> None:
        log.error("%s", reason)
        self._core.state = ModelState.FAILED
        self._core.reason = reason
        self.inbox = None
        self._notify()
        await self._handover.put(ModelLost(reason=reason, permanent=True))

    def _engine_thread(
        self, inbox: queue.SimpleQueue, key: ModelKey, finished: threading.Event | None = None
    ) -> None:
        """Runs on the engine thread."""
        try:
            self._engine_thread_body(inbox, key)
        finally:
            if finished is not None:
                finished.set()

    def _tick(self) -> None:
        self.last_tick = time.monotonic()

    def _engine_thread_body(self, inbox: queue.SimpleQueue, key: ModelKey) -> None:
        def emit(outputs: StepOutputs) -> None:
            # At most STEPS_AHEAD steps in flight, handed over without waiting
            # for the event loop: the engine never stalls on a busy trio thread,
            # and never runs more than a few steps ahead of its consumers.
            self._handover.put_from_thread(outputs, trio.from_thread.check_cancelled)

        def ready(handle: LoadedModel, attach=inbox) -> None:
            # ``attach``: what the trio side puts commands into (an engine
            # process gives its ``ProcessInbox``). The tokenizer's encoder is
            # chosen now (about 20 ms of probes), not on the first request's
            # event loop. Then this process's heap: the model (thread mode) or
            # its tokenizer, out of the GC's way.
            encoder_for(handle.tokenizer)
            settle_heap()
            trio.from_thread.run(self._ready, handle, attach)

        def crashed(reason: str) -> None:
            trio.from_thread.run_sync(self._core.crashing, reason)

        make_core = functools.partial(self._make_core, key)
        spec = self.engine_process
        if spec is not None:
            run_engine_proxy(
                make_core,
                inbox,
                spec.load_tokenizer,
                emit=emit,
                on_ready=ready,
                on_crash=crashed,
                check_cancelled=trio.from_thread.check_cancelled,
                log_level=spec.log_level,
                log_format=spec.log_format,
                cpu_blas=spec.cpu_blas,
            )
            return
        run_engine_loop(
            make_core,
            inbox,
            emit,
            trio.from_thread.check_cancelled,
            on_ready=lambda core: ready(core.handle),
            on_crash=crashed,
            on_tick=self._tick,
        )

    async def _ready(self, loaded: LoadedModel, inbox: EngineInbox) -> None:
        self.last_tick = time.monotonic()
        # The Scheduler hears of the engine before any Session can lease it;
        # a request that races ahead of this note waits in the Scheduler.
        await self._handover.put(ModelReady(info=loaded.info, inbox=inbox))
        self.inbox = inbox
        handle = loaded.for_trio_side()  # the weights stay the engine's
        self._core.ready(handle)
        seconds = time.monotonic() - self._engine_started
        self._on_loaded(seconds)
        log.info("model ready: %s (loaded in %.1f s)", handle.info.model_key, seconds)
        self._notify()
        self._maybe_swap()
