"""Scheduler: admission, request ids, and what enters the engine when.

``SchedulerCore`` (sans-IO) holds a bounded FIFO of waiting requests and the
set of requests inside the engine. At most ``max_in_engine`` sequences are in
the engine at once (mlx-lm's ``BatchGenerator`` batches them: decode
concurrency plus prompt concurrency, so a finished slot is refilled without a
round trip); at most ``max_waiting`` wait behind them, and beyond that
``admit`` raises ``Overloaded`` (429) before a byte is sent.

Memory: each request carries an estimate of its KV cache at its longest
(prompt + max_tokens). With a ``kv_budget``, a request larger than the whole
budget is refused (413), and a waiting request starts only when what the
sequences in the engine reserve plus what it needs fit the budget, so the engine
is never asked to hold more KV cache than the budget allows. What a sequence
reserves, and how one that outgrows it is preempted and resumed, is
``actors.kv_reservations``: a preempted sequence's ``SequenceAborted`` (and its
resumption's ``SequenceStarted`` and prompt progress) stay here, so the client
sees one stream. Requests wait here, not in the engine, so a client that leaves
while queued costs the engine nothing, and the prompt-cache lookup happens when
the request is started.

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
import time
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from actors.kv_reservations import KvReservations
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
    def __init__(
        self,
        *,
        max_in_engine: int,
        max_waiting: int,
        kv_budget: int | None = None,
        reply_reserve_tokens: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_in_engine <= 0 or max_waiting < 0:
            raise ValueError("max_in_engine must be > 0 and max_waiting >= 0")
        self.max_in_engine = max_in_engine
        self.max_waiting = max_waiting
        self.kv_budget = kv_budget
        self.waiting: collections.OrderedDict[int, Submit] = collections.OrderedDict()
        self.in_engine: set[int] = set()
        self.reservations = KvReservations(reply_reserve_tokens)
        # A preempted sequence resumes as a new one in the engine, but its client has
        # one stream: its SequenceStarted passes once (``_shown``: the requests whose
        # start has passed), and its prefill's progress not at all (``_resuming``: the
        # resumed ones).
        self._shown: set[int] = set()
        self._resuming: set[int] = set()
        self._next_id = 1
        # How long each request waited in the queue: when it was admitted, and its wait
        # up to its latest start (a sequence preempted before its start was seen waits
        # again), until its ``SequenceStarted`` carries the wait to the Detokenizer.
        self._clock = clock
        self._admitted_at: dict[int, float] = {}
        self._queued: dict[int, float] = {}

    # What the engine's decoding batches save by holding their sessions' shared prefix
    # once (``EngineStats.shared_kv_bytes``, as of the last step): the sessions' whole
    # reservations less this is what their KV holds.
    shared_kv_bytes = 0

    @property
    def kv_reserved(self) -> int:
        return self.reservations.total - self.shared_kv_bytes

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
        now = self._clock()
        for request_id in submit.request_ids:
            self._admitted_at[request_id] = now

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
            self.in_engine.update(ids)
            self.reservations.start(head)
            started.append(head)
            now = self._clock()
            for request_id in ids:
                admitted = self._admitted_at.get(request_id)
                if admitted is not None:  # none once the client has seen it start
                    self._queued[request_id] = now - admitted
        return started

    def _fits(self, submit: Submit) -> bool:
        if self.kv_budget is None or not self.in_engine:
            return True
        return self.kv_reserved + self.reservations.needed(submit) <= self.kv_budget

    def abort(self, request_id: int, reason: AbortReason) -> Abort | None:
        """Forget a request; returns the ``Abort`` the engine needs, if any.

        A waiting request with several choices is aborted by its first id
        (the Session aborts all of them together)."""
        if self.waiting.pop(request_id, None) is not None:
            self._forget(request_id)
            return None
        if request_id in self.in_engine:
            self.in_engine.discard(request_id)
            self._forget(request_id)
            return Abort(request_id=request_id, reason=reason)
        return None

    def on_outputs(self, outputs: StepOutputs) -> tuple[StepOutputs, list[Abort]]:
        """Account for one step: the step as the client side gets it, and the
        sequences to preempt (their ``Abort``s) when the budget runs short."""
        reservations = self.reservations
        reservations.count(outputs.tokens)
        self.shared_kv_bytes = outputs.stats.shared_kv_bytes
        resumed = {e.request_id for e in outputs.aborted if reservations.is_preempting(e.request_id)}
        ended = outputs.terminal_ids() - resumed
        shown, resuming, queued = self._shown, self._resuming, self._queued
        if (resumed or resuming or queued
                or any(e.request_id in shown for e in outputs.started)):
            outputs = attrs.evolve(
                outputs,
                aborted=tuple(e for e in outputs.aborted if e.request_id not in resumed),
                started=tuple(
                    attrs.evolve(e, queued_seconds=queued[e.request_id] + (e.queued_seconds or 0))
                    if e.request_id in queued else e
                    for e in outputs.started if e.request_id not in shown),
                progress=tuple(e for e in outputs.progress if e.request_id not in resuming),
            )
        shown.update(e.request_id for e in outputs.started)
        for event in outputs.started:
            queued.pop(event.request_id, None)
            self._admitted_at.pop(event.request_id, None)
        for request_id in ended:
            self.in_engine.discard(request_id)
            self._forget(request_id)
        for request_id in sorted(resumed, reverse=True):
            self.in_engine.discard(request_id)
            # At the head of the queue: it was in the engine before those waiting.
            self.waiting[request_id] = reservations.resumed(request_id)
            self.waiting.move_to_end(request_id, last=False)
            resuming.add(request_id)
        budget = self.kv_budget
        victims = reservations.preempt(None if budget is None else budget + self.shared_kv_bytes)
        return outputs, [Abort(request_id=i, reason=AbortReason.PREEMPTED) for i in victims]

    def drop_waiting(self) -> list[int]:
        """No engine is coming back: forget the waiting requests. Returns their ids."""
        ids = [i for submit in self.waiting.values() for i in submit.request_ids]
        self.waiting.clear()
        for request_id in ids:
            self._forget(request_id)
        return ids

    def _forget(self, request_id: int) -> None:
        self.reservations.release(request_id)
        self._shown.discard(request_id)
        self._resuming.discard(request_id)
        self._admitted_at.pop(request_id, None)
        self._queued.pop(request_id, None)

    def engine_lost(self) -> list[int]:
        """The engine died: everything inside it is gone. Returns those ids."""
        lost = sorted(self.in_engine)
        self.in_engine.clear()
        for request_id in lost:
            self._forget(request_id)
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
    preemptions: int  # sequences taken out of the engine to resume later (KV budget)
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
            preemptions=core.reservations.preemptions,
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
            ids += self._core.drop_waiting()
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
        outputs, preempted = self._core.on_outputs(outputs)
        if self._engine_inbox is not None:
            for abort in preempted:
                self._engine_inbox.put(abort)
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
