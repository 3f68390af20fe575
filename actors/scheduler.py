"""Scheduler: admission, request ids, and what enters the engine when.

``SchedulerCore`` (sans-IO) holds a bounded FIFO of waiting requests and the
set of requests inside the engine. At most ``max_in_engine`` sequences are in
the engine at once (mlx-lm's ``BatchGenerator`` batches them: decode
concurrency plus prompt concurrency, so a finished slot is refilled without a
round trip); at most ``max_waiting`` wait behind them, and beyond that
``admit`` raises ``Overloaded`` (429) before a byte is sent.

Memory: each request carries an estimate of its KV cache at its longest
(prompt + max_tokens). With a ``kv_budget``, a request larger than the whole
budget is refused (413), and a waiting request starts only when the estimates
of the sequences in the engine plus its own fit the budget, so the engine is
never asked to hold more KV cache than the budget allows. Requests wait here,
not in the engine, so a client that leaves while queued costs the engine
nothing, and the prompt-cache lookup happens when the request is started.

The ``Scheduler`` actor receives each engine step's ``StepOutputs`` (and the
ModelLoader's ``ModelReady`` / ``ModelLost``, in order with them) from the
engine hand-over, updates the core, hands the step to the prompt-cache policy
(``actors.prompt_cache.PromptCachePolicy``, a synchronous call: its index
follows the engine's entries before any client sees the step's results, and
it answers with the step's miss reasons filled in and the entries to evict),
puts those evictions into the engine's inbox as one ``EvictCache``, refills
the engine, and forwards the step to the Detokenizer.

Others reach it only through its port (``SchedulerPort``): ``allocate_id``,
``submit`` and ``abort`` are synchronous, so that a request can be aborted in
cleanup without awaiting; the commands they produce go straight into the
engine's inbox (``runtime.lifecycle.EngineInbox``: ``put`` never blocks).
``figures`` is a frozen snapshot for ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import collections
import logging
from typing import Protocol

import attrs
import trio

from runtime.errors import Overloaded, PayloadTooLarge, Unavailable
from runtime.handover import HandedOver
from runtime.lifecycle import EngineInbox, ModelLost, ModelReady
from runtime.messages import (
    Abort,
    AbortReason,
    EngineStats,
    EvictCache,
    SequenceFailed,
    StepOutputs,
    Submit,
)

log = logging.getLogger(__name__)


class SchedulerCore:
    def __init__(self, *, max_in_engine: int, max_waiting: int, kv_budget: int | None = None):
        if max_in_engine <= 0 or max_waiting < 0:
            raise ValueError("max_in_engine must be > 0 and max_waiting >= 0")
        self.max_in_engine = max_in_engine
        self.max_waiting = max_waiting
        self.kv_budget = kv_budget
        self.waiting: collections.OrderedDict[int, Submit] = collections.OrderedDict()
        self.in_engine: set[int] = set()
        self._reserved: dict[int, int] = {}
        self._next_id = 1

    @property
    def kv_reserved(self) -> int:
        return sum(self._reserved.values())

    def allocate_id(self) -> int:
        request_id = self._next_id
        self._next_id += 1
        return request_id

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.in_engine)

    def can_admit(self) -> bool:
        """Room for one more: in the engine, or in the FIFO behind it. While no
        engine is attached, a request waits for a slot it will take on attach."""
        return self.load < self.max_waiting + self.max_in_engine

    def admit(self, submit: Submit) -> None:
        if self.kv_budget is not None and submit.kv_bytes > self.kv_budget:
            raise PayloadTooLarge(
                f"this request needs about {submit.kv_bytes / 1e6:.1f} MB of KV cache "
                f"(prompt + max_tokens), more than the server's budget of "
                f"{self.kv_budget / 1e6:.1f} MB; send a shorter prompt or a lower max_tokens",
                param="max_tokens",
            )
        if not self.can_admit():
            raise Overloaded(
                f"the server is at capacity ({self.load} requests in flight); retry shortly",
                retry_after=1,
            )
        self.waiting[submit.request_id] = submit

    def to_start(self, *, engine_attached: bool = True) -> list[Submit]:
        """Move waiting requests into the engine while it has room.

        A request with several choices takes a slot (and an equal share of its
        KV estimate) per choice; one too large for the engine's slots starts
        when the engine is empty."""
        started: list[Submit] = []
        while engine_attached and self.waiting:
            head = next(iter(self.waiting.values()))
            ids = head.request_ids
            if self.in_engine and len(self.in_engine) + len(ids) > self.max_in_engine:
                break
            if not self._fits(head):
                break  # FIFO: the head waits for memory, and so do those behind it
            self.waiting.popitem(last=False)
            for request_id in ids:
                self.in_engine.add(request_id)
                self._reserved[request_id] = head.kv_bytes // len(ids)
            started.append(head)
        return started

    def _fits(self, submit: Submit) -> bool:
        if self.kv_budget is None or not self.in_engine:
            return True
        return self.kv_reserved + submit.kv_bytes <= self.kv_budget

    def abort(self, request_id: int, reason: AbortReason) -> Abort | None:
        """Forget a request; returns the ``Abort`` the engine needs, if any.

        A waiting request with several choices is aborted by its first id
        (the Session aborts all of them together)."""
        if self.waiting.pop(request_id, None) is not None:
            return None
        if request_id in self.in_engine:
            self.in_engine.discard(request_id)
            self._reserved.pop(request_id, None)
            return Abort(request_id=request_id, reason=reason)
        return None

    def on_outputs(self, outputs: StepOutputs) -> None:
        for request_id in outputs.terminal_ids():
            self.in_engine.discard(request_id)
            self._reserved.pop(request_id, None)

    def engine_lost(self) -> list[int]:
        """The engine died: everything inside it is gone. Returns those ids."""
        lost = sorted(self.in_engine)
        self.in_engine.clear()
        self._reserved.clear()
        return lost


class PromptCachePort(Protocol):
    """What the Scheduler needs of the prompt-cache policy."""

    def on_step(self, outputs: StepOutputs) -> tuple[StepOutputs, tuple[int, ...]]:
        """Account for one step: the step to forward, and the entries to evict."""

    def engine_changed(self, model: str | None) -> None:
        """A new engine (its model key) or none: the old one's cache is gone."""

    def device_budget(self, nbytes: int) -> None:
        """The byte limit the new engine gives the cache where none was configured."""


@attrs.frozen(kw_only=True)
class SchedulerFigures:
    """The Scheduler's state at one moment (``/health``, ``/metrics``)."""

    in_flight: int  # waiting or in the engine
    running: int  # in the engine
    waiting: int
    kv_reserved_bytes: int
    kv_budget_bytes: int | None
    stats: EngineStats  # the engine's latest snapshot


class SchedulerPort(Protocol):
    """How the Runtime, Sessions (through it) and the Detokenizer reach the Scheduler."""

    @property
    def kv_budget(self) -> int | None:
        """Bytes of KV cache the engine's sequences may hold together (None: no limit)."""

    def allocate_id(self) -> int: ...

    def submit(self, submit: Submit) -> None:
        """Admit (429 / 413 / 503) and start it when the engine has room."""

    def abort(self, request_id: int, reason: AbortReason) -> None:
        """Stop a request early; synchronous and idempotent (safe in cleanup)."""

    def figures(self) -> SchedulerFigures: ...


class Scheduler:
    """The actor around ``SchedulerCore``; ``SchedulerPort`` is its whole surface.

    Receives from the engine hand-over, in order: ``ModelReady`` (attach the
    engine's inbox, set the KV budget, start what waits), ``StepOutputs`` and
    ``ModelLost`` (detach; what was inside the engine fails with 503, and, if
    no engine is coming back, what waits too).
    """

    def __init__(
        self,
        core: SchedulerCore,
        *,
        to_detokenizer: trio.MemorySendChannel[StepOutputs],
        prompt_cache: PromptCachePort,
        kv_budget_override: int | None = None,
    ):
        self._core = core
        self._to_detokenizer = to_detokenizer
        self._prompt_cache = prompt_cache
        self._kv_budget_override = kv_budget_override
        self._engine_inbox: EngineInbox | None = None
        self._gone: str | None = None  # no engine is coming back: why
        self._last_stats = EngineStats()  # the latest engine snapshot: /health, /metrics

    # ------------------------------------------------------------ the port

    @property
    def kv_budget(self) -> int | None:
        return self._core.kv_budget

    def allocate_id(self) -> int:
        return self._core.allocate_id()

    def figures(self) -> SchedulerFigures:
        core = self._core
        return SchedulerFigures(
            in_flight=core.load,
            running=len(core.in_engine),
            waiting=len(core.waiting),
            kv_reserved_bytes=core.kv_reserved,
            kv_budget_bytes=core.kv_budget,
            stats=self._last_stats,
        )

    @property
    def engine_attached(self) -> bool:
        return self._engine_inbox is not None

    def submit(self, submit: Submit) -> None:
        """Admit (or raise ``Overloaded``) and start it if the engine has room.

        Before the engine's ``ModelReady`` has arrived (it follows the lease
        that let the Session in) or while it restarts, the request waits here."""
        if self._gone is not None:
            raise Unavailable(f"the engine stopped: {self._gone}", retry_after=30)
        self._core.admit(submit)
        self._start_waiting()

    def abort(self, request_id: int, reason: AbortReason) -> None:
        """Synchronous and idempotent: safe in cleanup under cancellation."""
        abort = self._core.abort(request_id, reason)
        if abort is not None and self._engine_inbox is not None:
            self._engine_inbox.put(abort)

    def _start_waiting(self) -> None:
        if self._engine_inbox is None:
            return
        for submit in self._core.to_start():
            self._engine_inbox.put(submit)

    # ------------------------------------------------------- engine messages

    def on_model_ready(self, ready: ModelReady) -> None:
        info = ready.info
        if self._kv_budget_override is not None:
            self._core.kv_budget = self._kv_budget_override
        elif info.kv_bytes_per_token and info.kv_budget:
            self._core.kv_budget = info.kv_budget
        self._gone = None
        self._engine_inbox = ready.inbox
        self._prompt_cache.device_budget(info.prompt_cache_budget)
        self._prompt_cache.engine_changed(info.model_key)
        self._start_waiting()

    def on_model_lost(self, lost: ModelLost) -> StepOutputs:
        """Detach the engine; returns the failures for the Detokenizer."""
        self._engine_inbox = None
        self._prompt_cache.engine_changed(None)
        ids = self._core.engine_lost()
        if lost.permanent:
            self._gone = lost.reason
            ids += [i for submit in self._core.waiting.values() for i in submit.request_ids]
            self._core.waiting.clear()
        self._last_stats = EngineStats()  # the dead engine's figures are not the truth
        return StepOutputs(
            failed=tuple(
                SequenceFailed(
                    request_id=i, message=f"the engine stopped: {lost.reason}", retryable=True
                )
                for i in ids
            )
        )

    def on_step(self, outputs: StepOutputs) -> StepOutputs:
        """Account for one engine step; returns it as the Detokenizer gets it."""
        self._core.on_outputs(outputs)
        outputs, evicted = self._prompt_cache.on_step(outputs)
        if evicted and self._engine_inbox is not None:
            # Before new submits: they are looked up after it.
            self._engine_inbox.put(EvictCache(entry_ids=evicted))
        self._start_waiting()
        self._last_stats = outputs.stats
        return outputs

    # ------------------------------------------------------------ the actor

    async def run(
        self,
        engine: trio.MemoryReceiveChannel[HandedOver],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        async with engine, self._to_detokenizer:
            async for item in engine:
                message = item.taken()  # the engine may run one more step ahead
                if isinstance(message, StepOutputs):
                    message = self.on_step(message)
                elif isinstance(message, ModelReady):
                    self.on_model_ready(message)
                    continue
                elif isinstance(message, ModelLost):
                    message = self.on_model_lost(message)
                    if not message:
                        continue
                await self._to_detokenizer.send(message)
