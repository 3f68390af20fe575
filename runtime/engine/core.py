"""The engine core: a synchronous state machine around one batch generator.

``EngineCore`` receives ``Submit`` / ``Abort`` commands (``handle_command``)
and emits one ``StepOutputs`` per ``step()``. It never blocks and knows
nothing of threads, trio or the distributed group, so tests drive it directly
(with ``tests.fakes.FakeBatchGenerator`` where determinism matters).

It owns, for one loaded model: the batch generator (mlx-lm's
``BatchGenerator``, or ``runtime.engine.serial.SerialGenerator`` for requests
that cannot share a batch: one interface, one path), a ``SequenceRecord`` per
sequence in it (``runtime.engine.sequences``), the prompt cache's arrays
(``runtime.engine.cache_handoffs``: a lookup at admission, inserts at segment
ends, at finish and for a prefill aborted mid-way, reported as
``cache_events``, and the disk tier; the prompt-cache policy's ``EvictCache``
removes entries between steps), the requests it holds outside the batch
(admission window, choices, shared prefills, reads from disk), and
the counters of ``EngineStats`` (``runtime.engine.counters``). How a sequence
samples and is inserted (its rows' registrations with the batch sampler) is
``runtime.engine.inserts``'s.

``step()`` runs one generator step and turns its responses into events in one
place, ``sequences.token_event`` (as vLLM v1's engine core loops over its
outputs). A step that raises fails one sequence, its batch, or after several
in a row the engine (``runtime.engine.failures``). Several choices of one request (n > 1) share its prompt's prefill
(``runtime.engine.choices``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import attrs

from runtime.decode_lanes import lane_stats
from runtime.engine import failures
from runtime.engine.admission import AdmissionWindow
from runtime.engine.cache_handoffs import SPILL_SECONDS, CacheHandoffs
from runtime.engine.choices import (
    PendingChoices,
    abort_waiting,
    further_choices,
    prompt_but_last_done,
)
from runtime.engine.commands import CommandSource, LocalCommands
from runtime.engine.counters import EngineCounters
from runtime.engine.disk_tier import POLL_SECONDS as DISK_POLL_SECONDS
from runtime.engine.failures import FAILED_STEPS_TO_RESTART, EngineBroken, SequenceError
from runtime.engine.inserts import SequenceInserts
from runtime.engine.sequences import (
    SequenceRecord,
    plain_kv_caches,
    token_event,
    uncached_segments,
    without_thinking_tail,
)
from runtime.engine.shared_prefill import SharedPrefills, save_points
from runtime.held_prefix import held_prefix_stats
from runtime.loaded_model import LoadedModel
from runtime.messages import (
    Abort,
    AbortReason,
    EngineCommand,
    EngineStats,
    EvictCache,
    PromptProgress,
    SequenceAborted,
    SequenceFailed,
    SequenceStarted,
    StepOutputs,
    Submit,
    TokenEvent,
)

log = logging.getLogger(__name__)


class EngineCore:
    """Sans-IO engine: commands in, one ``StepOutputs`` per ``step()`` out."""

    def __init__(
        self,
        handle: LoadedModel,
        *,
        batch_generator_factory: Callable[[], Any],
        prompt_cache: Any,
        prompt_cache_max_entries: int | None = None,
        sampler_factory: Callable[[Any], Any] | None = None,
        logits_processors_factory: Callable[[Any], list] | None = None,
        batch_sampler: Any = None,
        constraint_factory: Callable[[Any], Any] | None = None,
        insert_options: Callable[[Submit], dict[str, Any]] | None = None,
        stop_sequences: Any = None,
        commands: CommandSource | None = None,
        admission_window: float = 0.0,
        admission_batch: int = 8,
        admission_tokens: int = 0,
        admission_limit: int | None = None,
        prefill_group: Callable[[Any], Any] | None = None,
        burst_wait: float = 0.0,
        shared_prefill_min_tokens: int = 0,
        aborted_prefill_min_tokens: int = 0,
        paced_steps: Any = None,
        short_prompts_first: Any = None,
        disk: Any = None,
    ):
        """``batch_generator_factory()`` makes the generator (again after a failed step).

        ``prompt_cache``: a ``runtime.prompt_cache_store.PromptCacheStore`` (or
        a test double with its methods), without limits of its own; ``CacheEntries``
        stores no entry the actor's count limit (``prompt_cache_max_entries``) evicts at once.

        ``sampler_factory``, ``logits_processors_factory``, ``batch_sampler``,
        ``constraint_factory``, ``insert_options``, ``stop_sequences``: how each
        sequence samples and is inserted (``runtime.engine.inserts.SequenceInserts``).

        ``commands``: how the engine loops get this engine's commands
        (``runtime.engine.commands``); a ``lockstep`` source (distributed) also
        turns the admission window off, since every rank must run the same
        steps and a window that ends on each rank's own clock would not.

        ``admission_window`` (seconds; 0: off), ``burst_wait``, ``admission_batch``,
        ``admission_tokens``, ``admission_limit``: the ``AdmissionWindow``'s
        (``runtime.engine.admission``).

        ``prefill_group(generator)`` sizes each step's prefill group (None:
        mlx-lm's ``prefill_batch_size``; ``mlx_lm_prefill.size_prefill_group``);
        ``paced_steps`` (``runtime.engine.pacing.PacedSteps``; None: full chunks)
        sizes its chunk while sequences decode and times each ``next()``;
        ``short_prompts_first`` (None: off) sets a long prefill aside for short prompts.
        ``shared_prefill_min_tokens`` (0: off): a request that repeats that many
        uncached tokens of a prompt being prefilled waits for that prefix's
        prompt-cache copy (``runtime.engine.shared_prefill``).
        ``aborted_prefill_min_tokens``, ``disk``: ``runtime.engine.cache_handoffs``'s."""
        self.handle = handle
        self.commands = commands or LocalCommands()
        self._new_batch_generator = batch_generator_factory
        self._batch = batch_generator_factory()
        self.prompt_cache = prompt_cache
        # Plain KV caches need no save point before a prompt's thinking tail.
        self._plain_kv_caches = plain_kv_caches(handle.model)
        self.counters = EngineCounters()
        self._cache = CacheHandoffs(
            prompt_cache, prompt_cache_max_entries, handle.info.model_key, self.counters,
            aborted_prefill_min_tokens=aborted_prefill_min_tokens, disk=disk,
        )
        self.cache_entries = self._cache.entries
        self.batch_sampler = batch_sampler
        self._inserts = SequenceInserts(
            sampler_factory=sampler_factory,
            logits_processors_factory=logits_processors_factory,
            batch_sampler=batch_sampler,
            constraint_factory=constraint_factory,
            insert_options=insert_options,
            stop_sequences=stop_sequences,
        )
        self.admission = AdmissionWindow(
            window=0.0 if self.commands.lockstep else admission_window,
            burst_wait=burst_wait,
            batch=admission_batch,
            tokens=admission_tokens,
            limit=admission_limit,
        )
        self._prefill_group = prefill_group
        self._size_group = prefill_group if short_prompts_first is None \
            else short_prompts_first.sizing(prefill_group)
        self._paced = paced_steps
        self._short_first = short_prompts_first
        self._awaiting_first: set[int] = set()  # uids past their prompt, without a token
        self._clones = PendingChoices()  # choices waiting for their first choice's prompt
        self._shared = SharedPrefills(shared_prefill_min_tokens)  # waiting for a prefix
        self._disk = disk  # requests waiting for an entry read from disk
        self._by_uid: dict[int, SequenceRecord] = {}
        self._by_request: dict[int, SequenceRecord] = {}
        self._started: list[SequenceStarted] = []
        self._aborted: list[SequenceAborted] = []
        self._failed: list[SequenceFailed] = []
        self._failed_steps = 0  # steps in a row that failed their whole batch

    # ------------------------------------------------------------ commands

    def _request_ids(self, *, held: bool = True) -> list[int]:
        """The requests the engine holds: in the generator, then (``held``) in the window."""
        ids = list(self._by_request)
        ids += self._clones.request_ids()
        if held:
            ids += self.admission.request_ids()
            ids += self._shared.request_ids()
            if self._disk is not None:
                ids += self._disk.request_ids()
        return ids

    @property
    def active_request_ids(self) -> set[int]:
        return set(self._request_ids())

    @property
    def has_work(self) -> bool:
        return bool(self._by_request or self.admission or self._shared or self._disk)

    def hold_timeout(self) -> float | None:
        """How long the engine loop may wait for a command before the admission window
        needs a step (None: step now). While entries are read from disk and nothing is
        in the batch, at most ``DISK_POLL_SECONDS``."""
        hold = self.admission.timeout(decoding=len(self._by_uid))
        if self._disk and not self._by_uid:
            return DISK_POLL_SECONDS if hold is None else min(hold, DISK_POLL_SECONDS)
        return hold

    def handle_command(self, command: EngineCommand) -> None:
        if isinstance(command, Submit):
            if command.request_id in self.active_request_ids:
                return  # duplicate submit: the first one stands
            if not self.admission.holds(
                command, decoding=len(self._by_uid), awaiting_first=bool(self._awaiting_first)
            ):
                self._submit(command)
        elif isinstance(command, Abort):
            if self._abort(command.request_id, command.reason is AbortReason.PREEMPTED):
                self.counters.aborted(command.posted_at)
        elif isinstance(command, EvictCache):
            self.cache_entries.evict(command.entry_ids)
        else:
            raise TypeError(f"unexpected engine command {command!r}")

    def _submit(self, sub: Submit, *, start: list | None = None, clone: bool = False) -> None:
        """Insert ``sub`` (``start``: a KV cache of all its prompt but the last token,
        instead of the prompt cache's nearest entry; ``clone``: a further choice)."""
        if sub.request_id in self.active_request_ids:
            return  # duplicate submit: the first one stands
        if self._plain_kv_caches:
            segments, types = without_thinking_tail(sub.segments, sub.segment_types)
            if types is not sub.segment_types:
                sub = attrs.evolve(sub, segments=segments, segment_types=types)
        if start is None and not clone and self._cache.waits_for_disk(sub):
            return  # until its prefix is read from disk
        if start is None and not clone and self._shared.wait_behind(
            sub, lambda tokens: self._cache.cached_now(sub, tokens)
        ):
            return  # behind a sequence that is prefilling the same prefix
        try:
            uid, cached, segment_types, batch_kv_bytes = self._insert(sub, start)
        except Exception as exc:  # one bad request must not take the engine down
            log.exception("request %s could not be admitted", sub.request_id)
            for request_id in sub.request_ids:
                self._failed.append(SequenceFailed(request_id=request_id, message=str(exc)))
            return
        seq = SequenceRecord(
            request_id=sub.request_id,
            uid=uid,
            logprobs=sub.logprobs,
            top_logprobs=sub.top_logprobs,
            segment_types=[] if clone else segment_types[::-1],
            save_final=not clone,
            cache_key=self._cache.key(sub),
        )
        self._by_uid[uid] = seq
        self._by_request[sub.request_id] = seq
        if not clone:
            self._shared.track(
                sub.request_id, sub.prompt, save_points(sub.segments, cached), cached,
                scope=sub.cache_scope,
            )
        # A copy of the first choice's cache is no prompt-cache hit.
        self.counters.started(cached if start is None else 0, len(sub.prompt))
        self.counters.prompt_tokens_computed += len(sub.prompt) - cached
        self._started.append(SequenceStarted(
            request_id=sub.request_id, prompt_tokens=len(sub.prompt), cached_tokens=cached,
            batch_kv_bytes=batch_kv_bytes, queued_seconds=self.admission.waited(sub.request_id),
        ))
        if sub.choice_ids and len(sub.prompt) - cached > 1:
            self._clones.wait_for(sub)  # until its prompt is processed
        elif sub.choice_ids:  # nothing to share: the prompt cache (if anything) serves each
            for choice in further_choices(sub):
                self._submit(choice, clone=True)

    def _insert(self, sub: Submit, start: list | None = None) -> tuple[int, int, list[str], int]:
        """Into the generator, after the prompt cache (or from ``start``): (uid, tokens
        cached, segment types, the batch's KV bytes now: the prompt cache's byte budget
        gives way to them)."""
        sampling = self._inserts.sampling_of(sub)  # a request that cannot run fails here
        prompt = list(sub.prompt)
        if start is not None:
            cache, rest = start, prompt[-1:]
        else:
            cache, rest = self._cache.lookup(sub, prompt)
        cached = len(prompt) - len(rest)
        segments, types = uncached_segments(sub.segments, sub.segment_types, cached)
        uid = self._inserts.insert(
            self._batch, sub, sampling, segments=segments, cache=cache, cached_tokens=prompt[:cached]
        )
        return uid, cached, types, int(self._batch.prompt_cache_nbytes)

    def _abort(self, request_id: int, preempted: bool = False) -> bool:
        """Remove a sequence now (a first choice with the choices waiting for its prompt;
        a preempted one leaves its KV cached); returns whether there was one to remove."""
        ended = (
            abort_waiting(self.admission.held, self._clones, request_id)
            or self._shared.drop(request_id)
            or (self._disk.drop(request_id) if self._disk is not None else [])
        )
        self._aborted.extend(SequenceAborted(request_id=r) for r in ended)
        if ended:
            return True
        seq = self._by_request.get(request_id)
        if seq is None:
            return False  # already finished: its terminal event has been emitted
        self._cache.aborted(self._batch, seq, preempted)  # before its followers look it up
        self._forget(seq)
        self._batch.remove([seq.uid])
        self._aborted.append(SequenceAborted(request_id=request_id))
        waiting = self._clones.take(request_id)
        self._aborted.extend(SequenceAborted(request_id=c.request_id) for c in waiting)
        return True

    def _forget(self, seq: SequenceRecord) -> None:
        del self._by_uid[seq.uid]
        self._awaiting_first.discard(seq.uid)
        del self._by_request[seq.request_id]
        self._inserts.forget(seq.uid)
        for follower in self._shared.ended(seq.request_id):
            self._submit(follower)  # its leader left: the prompt cache serves what it holds

    # ---------------------------------------------------------------- steps

    def step(self) -> StepOutputs:
        """Run one engine step (if there is work) and collect everything since the last."""
        began = time.perf_counter()
        if self._disk is not None:
            self._cache.disk_step(self._submit)
        for sub in self.admission.due(
            decoding=len(self._by_uid), awaiting_first=bool(self._awaiting_first)
        ):
            self._submit(sub)
        progress: list[PromptProgress] = []
        tokens: list[TokenEvent] = []
        batch_size = len(self._by_uid)
        if self._by_uid:
            try:
                self._run_step(progress, tokens)
                self._failed_steps = 0
            except SequenceError as exc:
                self._fail_sequence(exc)
            except Exception as exc:
                log.exception("engine step failed; failing its %d sequences (%s)",
                              len(self._by_uid), failures.memory_text())
                message, retryable = failures.failed_step(exc)  # out of memory: 503, retry shortly
                self._fail_all(message, retryable=retryable)
                self._failed_steps += 1
                if failures.device_lost(exc):  # no later step of this process would run
                    raise EngineBroken(f"the device failed: {exc}") from exc
                if self._failed_steps >= FAILED_STEPS_TO_RESTART:  # its failures go at close()
                    raise EngineBroken(f"{self._failed_steps} steps in a row failed: {exc}") from exc
        self.counters.stepped(
            time.perf_counter() - began,
            prefill=bool(progress),
            worked=bool(self._by_uid or tokens or progress),
            batch_size=batch_size,
            generated=len(tokens),
        )
        outputs = StepOutputs(
            started=tuple(self._started),
            progress=tuple(progress),
            tokens=tuple(tokens),
            aborted=tuple(self._aborted),
            failed=tuple(self._failed),
            cache_events=self.cache_entries.take_events(),
            stats=self.stats(),
        )
        self._started.clear()
        self._aborted.clear()
        self._failed.clear()
        return outputs

    def _run_step(self, progress: list[PromptProgress], tokens: list[TokenEvent]) -> None:
        paced = self._paced
        aside = self._short_first is not None and self._short_first.before(self._batch)
        if paced is not None:
            paced.before(self._batch, self._size_group)
        elif self._size_group is not None:
            self._size_group(self._batch)
        began = time.perf_counter()
        prompt_responses, generation_responses = self._batch.next()
        if paced is not None and not aside:  # its line is of the long prompts' steps
            paced.after(time.perf_counter() - began)
        save = []
        share = []  # first choices whose prompt is processed up to its last token
        shared = self._shared
        for r in prompt_responses:
            seq = self._by_uid.get(r.uid)
            if seq is None:
                continue
            done, total = seq.prompt_progress = r.progress
            progress.append(PromptProgress(request_id=seq.request_id, done=done, total=total))
            shared.progressed(seq.request_id, done)
            if r.end_of_segment and not r.end_of_prompt and seq.segment_types:
                save.append(r.uid)
            if seq.request_id in self._clones and prompt_but_last_done(r):
                share.append(r.uid)
            if done >= total - 1:  # its first token comes in two steps at most
                self._awaiting_first.add(r.uid)
        wanted = sorted(set(save) | set(share))
        extracted = self._batch.extract_cache(wanted) if wanted else {}
        released: list[Submit] = []
        for uid in save:
            cache, cache_tokens = extracted[uid]
            seq = self._by_uid[uid]
            self._cache.segment_end(seq, cache, cache_tokens)
            released += shared.stored(seq.request_id, len(cache_tokens))
        for follower in released:  # their lookup finds the prefix just stored
            self._submit(follower)
        if shared:  # the waiting ones' streams hear of their leader's progress
            for request_id, done, total in shared.progress():
                progress.append(PromptProgress(request_id=request_id, done=done, total=total))
        for uid in share:  # the prompt cache may hold this very cache: only copies then
            first = self._by_uid[uid].request_id
            self._clones.start(first, extracted[uid][0], self._submit, own=uid not in save)

        by_uid, clones, awaiting_first = self._by_uid, self._clones, self._awaiting_first
        any_clones = bool(clones)  # none waiting now: none can start waiting in this loop
        for r in generation_responses:
            seq = by_uid.get(r.uid)
            if seq is None:
                continue
            if any_clones and seq.request_id in clones:  # its prompt ended with nothing to share
                clones.start(seq.request_id, None, self._submit)
            if awaiting_first:
                awaiting_first.discard(r.uid)
            tokens.append(token_event(seq, r))
            if r.finish_reason is not None:
                self._forget(seq)
                self._cache.finished(seq, r)

    def _fail_sequence(self, error: SequenceError) -> None:
        seq = self._by_uid.get(error.uid)
        log.error("request %s failed: %s", seq.request_id if seq else f"(uid {error.uid})",
                  error.message, exc_info=error.__cause__ or error)
        if seq is not None:
            self._forget(seq)
            self._failed.append(SequenceFailed(request_id=seq.request_id, message=error.message))
            self._failed += [
                SequenceFailed(request_id=c.request_id, message=error.message)
                for c in self._clones.take(seq.request_id)
            ]

    def _fail_all(self, message: str, *, retryable: bool = False, closing: bool = False) -> None:
        """Fail what the generator holds, and (``closing``) what the window holds."""
        for request_id in self._request_ids(held=closing):
            self._failed.append(
                SequenceFailed(request_id=request_id, message=message, retryable=retryable)
            )
        if closing:
            self.admission.clear()
        waiting = self._shared.clear()  # their leaders are gone
        if self._disk is not None:
            waiting += self._disk.clear()
        self._clones.clear()
        self._by_uid.clear()
        self._awaiting_first.clear()
        self._by_request.clear()
        self._inserts.clear()  # a new generator's uids start again at 0
        self._close_batch()
        if not closing:
            self._batch = self._new_batch_generator()
            for sub in waiting:
                self._submit(sub)

    def _close_batch(self) -> None:
        close = getattr(self._batch, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                log.exception("closing the batch generator failed")

    def stats(self) -> EngineStats:
        stats = self.counters.stats(
            active_sequences=len(self._request_ids()),
            prompt_cache_entries=len(self.prompt_cache),
            prompt_cache_bytes=int(self.prompt_cache.nbytes),
        )
        held = held_prefix_stats(self._batch)  # the prefixes held once: not in the layers' nbytes
        stats = attrs.evolve(stats, **lane_stats(self._batch), **held, batch_kv_bytes=int(
            self._batch.prompt_cache_nbytes) + held["held_prefix_bytes"])
        return stats if self._disk is None else attrs.evolve(stats, **self._disk.stats())

    def close(self, reason: str = "the engine is shutting down") -> StepOutputs:
        """Fail whatever is still running and release the batch generator."""
        self._fail_all(reason, retryable=True, closing=True)
        outputs = self.step()
        if self._disk is not None:
            self._cache.spill(SPILL_SECONDS)
            self._disk.close()  # after the step that hands its writer the last entries
        return outputs
