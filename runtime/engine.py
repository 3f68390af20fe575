"""The engine: everything that touches MLX, run on one dedicated thread.

``EngineCore`` is a synchronous state machine around mlx-lm's
``BatchGenerator`` and ``LRUPromptCache``. It receives ``Submit`` / ``Abort``
commands and produces one ``StepOutputs`` per step; it never blocks and knows
nothing of trio, so tests drive it directly (with a fake batch generator where
determinism matters).

``run_engine_loop`` is the thread body: it loads the model, then alternates
draining the inbox (a ``queue.SimpleQueue``: thread-safe, sync ``put``, so even
a cancelled trio task can post an ``Abort``) and stepping. It blocks on the
inbox only when there is no work, and hands each step's outputs to ``emit``,
which blocks while the trio side is more than a step or two behind.
"""

from __future__ import annotations

import collections
import gc
import logging
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from runtime.messages import (
    Abort,
    EngineCommand,
    EngineStats,
    ModelHandle,
    PromptProgress,
    SequenceAborted,
    SequenceFailed,
    SequenceStarted,
    Shutdown,
    StepOutputs,
    Submit,
    TokenEvent,
)

log = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 0.05


@attrs.define
class _SerialRun:
    """A request served alone (speculative decoding, quantized KV cache)."""

    submit: Submit
    responses: Iterator[Any]
    cache: list
    tokens: list[int]


@attrs.define
class _Sequence:
    request_id: int
    logprobs: bool
    top_logprobs: int
    segment_types: list[str]  # reversed: pop() gives the next segment's type


class EngineCore:
    """Sans-IO engine: commands in, one ``StepOutputs`` per ``step()`` out."""

    def __init__(
        self,
        handle: ModelHandle,
        *,
        batch_generator_factory: Callable[[], Any],
        prompt_cache: Any,
        prompt_cache_bytes: int | None = None,
        sampler_factory: Callable[[Any], Any] | None = None,
        logits_processors_factory: Callable[[Any], list] | None = None,
        stop_sequences: Any = None,
        serial_generate: Callable[[Submit, list[int], Any, Callable], tuple[Iterator, list]]
        | None = None,
        share_commands: Callable[[list | None], list] | None = None,
        admission_window: float = 0.0,
        admission_batch: int = 8,
    ):
        """``serial_generate(submit, prompt_rest, cache, progress) -> (responses, cache)``,
        when given, serves every request alone through mlx-lm's ``stream_generate``
        (one token per engine step, so aborts still land between tokens).

        ``share_commands`` (distributed serving) is the per-step collective that
        gives every rank rank 0's commands; the engine loops call it.

        ``admission_window`` (seconds; 0: off): while at least
        ``admission_batch`` sequences are decoding, a new request waits in the
        engine up to this long, or until ``admission_batch`` are waiting, so
        that arrivals a few milliseconds apart join the batch together. Each
        join rebuilds the whole batch's KV cache (mlx-lm's prompt batch extend,
        split and filter), so on a GPU one join per arrival costs more than the
        decoding itself (docs/performance.md); a small batch admits at once.
        Off when ``share_commands`` is given (distributed)."""
        self.handle = handle
        self.share_commands = share_commands
        self._serial_generate = serial_generate
        self._serial_waiting: collections.deque[Submit] = collections.deque()
        self._serial: _SerialRun | None = None
        self._serial_progress: list[PromptProgress] = []
        self._new_batch_generator = batch_generator_factory
        self._batch = batch_generator_factory()
        self.prompt_cache = prompt_cache
        self._prompt_cache_bytes = prompt_cache_bytes
        self._sampler_factory = sampler_factory or (lambda params: None)
        self._logits_processors_factory = logits_processors_factory or (lambda params: [])
        self._stop_sequences = stop_sequences
        # Distributed, every rank must run the same steps: a window that ends on
        # each rank's own clock would not, so it stays off there.
        self._admission_window = 0.0 if share_commands is not None else admission_window
        self._admission_batch = admission_batch
        self._held: collections.deque[tuple[float, Submit]] = collections.deque()
        self._by_uid: dict[int, _Sequence] = {}
        self._uid_of: dict[int, int] = {}
        self._started: list[SequenceStarted] = []
        self._aborted: list[SequenceAborted] = []
        self._failed: list[SequenceFailed] = []
        self._steps = 0
        self._prefill_steps = 0  # steps that processed prompt tokens
        self._busy_seconds = 0.0  # wall time inside step()
        self._cache_hits = 0
        self._cached_tokens = 0
        self._recent_step_ends: collections.deque[float] = collections.deque(maxlen=8)
        self._aborts = 0
        self._abort_wait_total = 0.0
        self._abort_wait_max = 0.0
        self._abort_steps_max = 0

    # ------------------------------------------------------------ commands

    @property
    def has_work(self) -> bool:
        return bool(self._by_uid or self._serial or self._serial_waiting or self._held)

    @property
    def active_request_ids(self) -> set[int]:
        ids = set(self._uid_of)
        ids.update(s.request_id for s in self._serial_waiting)
        ids.update(sub.request_id for _, sub in self._held)
        if self._serial is not None:
            ids.add(self._serial.submit.request_id)
        return ids

    def handle_command(self, command: EngineCommand) -> None:
        if isinstance(command, Submit):
            if (
                self._admission_window > 0
                and len(self._by_uid) >= self._admission_batch
                and self._serial_generate is None
            ):
                if command.request_id not in self.active_request_ids:
                    self._held.append((time.monotonic(), command))
                return
            self._submit(command)
        elif isinstance(command, Abort):
            if self._abort(command.request_id):
                self._record_abort_wait(command.posted_at)
        else:
            raise TypeError(f"unexpected engine command {command!r}")

    def _submit(self, sub: Submit) -> None:
        if sub.request_id in self.active_request_ids:
            return  # duplicate submit: the first one stands
        if self._serial_generate is not None:
            self._serial_waiting.append(sub)
            return
        try:
            uid, cached, segment_types = self._insert(sub)
        except Exception as exc:  # one bad request must not take the engine down
            log.exception("request %s could not be admitted", sub.request_id)
            self._failed.append(SequenceFailed(request_id=sub.request_id, message=str(exc)))
            return
        self._by_uid[uid] = _Sequence(
            request_id=sub.request_id,
            logprobs=sub.logprobs,
            top_logprobs=sub.top_logprobs,
            segment_types=segment_types[::-1],
        )
        self._uid_of[sub.request_id] = uid
        self._started_event(sub, cached)

    def _fetch_cache(self, prompt: list[int]) -> tuple[Any, list[int], int]:
        """(cache or None, tokens still to process, tokens the cache covers)."""
        cache, rest = self.prompt_cache.fetch_nearest_cache(self.handle.model_key, prompt)
        if cache is not None and not rest:
            # An exact hit leaves nothing to feed the model: give back one token.
            cache, rest = self._back_off_one_token(cache, prompt)
        return cache, rest, len(prompt) - len(rest)

    def _started_event(self, sub: Submit, cached: int) -> None:
        if cached:
            self._cache_hits += 1
            self._cached_tokens += cached
        self._started.append(
            SequenceStarted(
                request_id=sub.request_id, prompt_tokens=len(sub.prompt), cached_tokens=cached
            )
        )

    def _insert(self, sub: Submit) -> tuple[int, int, list[str]]:
        prompt = list(sub.prompt)
        cache, rest, cached = self._fetch_cache(prompt)

        segments = [list(s) for s in sub.segments]
        types = list(sub.segment_types)
        skip = cached
        while skip > 0 and segments:
            if skip >= len(segments[0]):
                skip -= len(segments.pop(0))
                types.pop(0)
            else:
                segments[0] = segments[0][skip:]
                skip = 0

        sampler = self._sampler_factory(sub.sampling)
        processors = self._logits_processors_factory(sub.sampling)
        (uid,) = self._batch.insert_segments(
            segments=[segments],
            max_tokens=[sub.max_tokens],
            caches=[cache],
            all_tokens=[prompt[:cached]],
            samplers=[sampler],
            logits_processors=[processors],
            stop_sequences=[self._stop_sequences] if self._stop_sequences is not None else None,
        )
        if self._prompt_cache_bytes is not None:
            active = self._batch.prompt_cache_nbytes
            self.prompt_cache.trim_to(n_bytes=self._prompt_cache_bytes - active)
        return uid, cached, types

    def _back_off_one_token(self, cache, prompt):
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if len(prompt) > 1 and can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, 1)
            return cache, prompt[-1:]
        return None, prompt

    def _admit_held(self) -> None:
        """Hand the held requests to the batch once the window is over (or it is full)."""
        if not self._held:
            return
        if (
            len(self._by_uid) >= self._admission_batch
            and len(self._held) < self._admission_batch
            and time.monotonic() - self._held[0][0] < self._admission_window
        ):
            return
        while self._held:
            self._submit(self._held.popleft()[1])

    def _abort(self, request_id: int) -> bool:
        """Remove a sequence now; returns whether there was one to remove."""
        for i, (_, sub) in enumerate(self._held):
            if sub.request_id == request_id:
                del self._held[i]
                self._aborted.append(SequenceAborted(request_id=request_id))
                return True
        if self._serial_generate is not None and self._abort_serial(request_id):
            self._aborted.append(SequenceAborted(request_id=request_id))
            return True
        uid = self._uid_of.pop(request_id, None)
        if uid is None:
            return False  # already finished: its terminal event has been emitted
        self._by_uid.pop(uid, None)
        self._batch.remove([uid])
        self._aborted.append(SequenceAborted(request_id=request_id))
        return True

    def _record_abort_wait(self, posted_at: float) -> None:
        """How long an abort waited to be applied, in ms and in engine steps finished meanwhile."""
        now = time.monotonic()
        wait_ms = max(0.0, (now - posted_at) * 1000)
        steps = sum(1 for finished in self._recent_step_ends if finished > posted_at)
        self._aborts += 1
        self._abort_wait_total += wait_ms
        self._abort_wait_max = max(self._abort_wait_max, wait_ms)
        self._abort_steps_max = max(self._abort_steps_max, steps)

    def _abort_serial(self, request_id: int) -> bool:
        for sub in self._serial_waiting:
            if sub.request_id == request_id:
                self._serial_waiting.remove(sub)
                return True
        run = self._serial
        if run is not None and run.submit.request_id == request_id:
            self._serial = None
            close = getattr(run.responses, "close", None)
            if close is not None:
                close()
            return True
        return False

    def _serial_step(self, progress: list, tokens: list) -> None:
        if self._serial is None:
            if not self._serial_waiting:
                return
            sub = self._serial_waiting.popleft()
            try:
                prompt = list(sub.prompt)
                cache, rest, cached = self._fetch_cache(prompt)

                def report(done, total, request_id=sub.request_id, cached=cached):
                    self._serial_progress.append(
                        PromptProgress(
                            request_id=request_id, done=cached + done, total=cached + total
                        )
                    )

                responses, cache = self._serial_generate(sub, rest, cache, report)
            except Exception as exc:
                log.exception("request %s could not be started", sub.request_id)
                self._failed.append(SequenceFailed(request_id=sub.request_id, message=str(exc)))
                return
            self._serial = _SerialRun(submit=sub, responses=responses, cache=cache, tokens=prompt)
            self._started_event(sub, cached)
        run = self._serial
        sub = run.submit
        try:
            r = next(run.responses)
        except Exception as exc:
            log.exception("request %s failed", sub.request_id)
            self._serial = None
            self._failed.append(SequenceFailed(request_id=sub.request_id, message=str(exc)))
            return
        run.tokens.append(int(r.token))
        logprob, top = None, ()
        if sub.logprobs or sub.top_logprobs > 0:
            logprob, top = self._token_logprobs(r.logprobs, int(r.token), sub.top_logprobs)
        tokens.append(
            TokenEvent(
                request_id=sub.request_id,
                token=int(r.token),
                finish_reason=r.finish_reason,
                logprob=logprob,
                top_logprobs=top,
            )
        )
        if r.finish_reason is not None:
            self._serial = None
            self._store_serial_cache(run)

    def _store_serial_cache(self, run: _SerialRun) -> None:
        """Save a finished serial run's cache under exactly the tokens it holds.

        ``stream_generate`` may or may not have fed the last token, and with a
        draft model the draft's cache can be a token apart from the model's: cut
        every layer to the shortest, and key the entry by that many tokens.
        """
        offsets = [getattr(c, "offset", None) for c in run.cache]
        if not run.cache or any(o is None for o in offsets):
            return
        held = min(min(offsets), len(run.tokens))
        for c, offset in zip(run.cache, offsets, strict=True):
            if offset > held:
                if not (hasattr(c, "is_trimmable") and c.is_trimmable()):
                    return
                c.trim(offset - held)
        if held > 0:
            self.prompt_cache.insert_cache(self.handle.model_key, run.tokens[:held], run.cache)

    # ---------------------------------------------------------------- steps

    def step(self) -> StepOutputs:
        """Run one engine step (if there is work) and collect everything since the last."""
        began = time.perf_counter()
        self._admit_held()
        progress: list[PromptProgress] = []
        tokens: list[TokenEvent] = []
        if self._by_uid:
            try:
                self._run_step(progress, tokens)
            except Exception as exc:
                log.exception("engine step failed; failing its %d sequences", len(self._by_uid))
                self._fail_all(f"engine step failed: {exc}")
        if self._serial_generate is not None:
            self._serial_step(progress, tokens)
            progress.extend(self._serial_progress)
            self._serial_progress.clear()
        self._steps += 1
        self._prefill_steps += bool(progress)
        self._busy_seconds += time.perf_counter() - began
        if self._by_uid or tokens or progress:
            self._recent_step_ends.append(time.monotonic())
        outputs = StepOutputs(
            started=tuple(self._started),
            progress=tuple(progress),
            tokens=tuple(tokens),
            aborted=tuple(self._aborted),
            failed=tuple(self._failed),
            stats=self.stats(),
        )
        self._started.clear()
        self._aborted.clear()
        self._failed.clear()
        return outputs

    def _run_step(self, progress: list, tokens: list) -> None:
        prompt_responses, generation_responses = self._batch.next()
        key = self.handle.model_key

        save = []
        for r in prompt_responses:
            seq = self._by_uid.get(r.uid)
            if seq is None:
                continue
            done, total = r.progress
            progress.append(PromptProgress(request_id=seq.request_id, done=done, total=total))
            if r.end_of_segment and not r.end_of_prompt and seq.segment_types:
                save.append(r.uid)
        if save:
            for uid, (cache, cache_tokens) in self._batch.extract_cache(save).items():
                self.prompt_cache.insert_cache(
                    key,
                    list(cache_tokens),
                    cache,
                    cache_type=self._by_uid[uid].segment_types.pop(),
                )

        want_logprobs = [r for r in generation_responses if self._wants_logprobs(r.uid)]
        logprob_info = self._logprobs(want_logprobs)

        for r in generation_responses:
            seq = self._by_uid.get(r.uid)
            if seq is None:
                continue
            logprob, top = logprob_info.get(r.uid, (None, ()))
            tokens.append(
                TokenEvent(
                    request_id=seq.request_id,
                    token=int(r.token),
                    finish_reason=r.finish_reason,
                    logprob=logprob,
                    top_logprobs=top,
                )
            )
            if r.finish_reason is not None:
                del self._by_uid[r.uid]
                self._uid_of.pop(seq.request_id, None)
                if r.prompt_cache is not None and r.all_tokens is not None:
                    self.prompt_cache.insert_cache(
                        key, list(r.all_tokens), r.prompt_cache, cache_type="assistant"
                    )

    def _wants_logprobs(self, uid: int) -> bool:
        seq = self._by_uid.get(uid)
        return seq is not None and (seq.logprobs or seq.top_logprobs > 0)

    def _logprobs(self, responses: list) -> dict[int, tuple[float, tuple]]:
        """The sampled token's logprob and the top-n, sorted, for the responses that ask."""
        if not responses:
            return {}
        return {
            r.uid: self._token_logprobs(r.logprobs, r.token, self._by_uid[r.uid].top_logprobs)
            for r in responses
        }

    @staticmethod
    def _token_logprobs(lp, token: int, n: int) -> tuple[float, tuple]:
        import mlx.core as mx

        lp = lp.reshape(-1)
        chosen = lp[token]
        if n <= 0:
            return chosen.item(), ()
        n = min(n, lp.shape[-1])
        idx = mx.argpartition(-lp, kth=n - 1)[:n]
        vals = lp[idx]
        order = mx.argsort(-vals)
        idx, vals = idx[order], vals[order]
        mx.eval(chosen, idx, vals)
        return chosen.item(), tuple(zip(idx.tolist(), vals.tolist(), strict=True))

    def _fail_all(self, message: str, *, retryable: bool = False, rebuild: bool = True) -> None:
        ids = [seq.request_id for seq in self._by_uid.values()]
        ids += [sub.request_id for sub in self._serial_waiting]
        if not rebuild:  # closing: the held requests go too (a failed step keeps them)
            ids += [sub.request_id for _, sub in self._held]
            self._held.clear()
        if self._serial is not None:
            ids.append(self._serial.submit.request_id)
        self._serial_waiting.clear()
        self._serial = None
        for request_id in ids:
            self._failed.append(
                SequenceFailed(request_id=request_id, message=message, retryable=retryable)
            )
        self._by_uid.clear()
        self._uid_of.clear()
        self._close_batch()
        if rebuild:
            self._batch = self._new_batch_generator()

    def _close_batch(self) -> None:
        close = getattr(self._batch, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                log.exception("closing the batch generator failed")

    def stats(self) -> EngineStats:
        return EngineStats(
            active_sequences=len(self._by_uid)
            + len(self._serial_waiting)
            + len(self._held)
            + (self._serial is not None),
            steps=self._steps,
            prefill_steps=self._prefill_steps,
            busy_seconds=self._busy_seconds,
            prompt_cache_entries=len(self.prompt_cache),
            prompt_cache_bytes=int(self.prompt_cache.nbytes),
            prompt_cache_hits=self._cache_hits,
            prompt_cache_cached_tokens=self._cached_tokens,
            aborts=self._aborts,
            abort_wait_ms_total=self._abort_wait_total,
            abort_wait_ms_max=self._abort_wait_max,
            abort_wait_steps_max=self._abort_steps_max,
        )

    def close(self, reason: str = "the engine is shutting down") -> StepOutputs:
        """Fail whatever is still running and release the batch generator."""
        self._fail_all(reason, retryable=True, rebuild=False)
        return self.step()


# ---------------------------------------------------------------- the thread


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
    heartbeat: float = 1.0,
) -> None:
    """The engine thread's body. Returns on ``Shutdown``; raises on cancellation.

    Distributed (``core.share_commands`` set), this is rank 0's loop: every
    step is preceded by one command exchange, which every other rank matches
    in ``run_follower_loop``; while idle an empty exchange goes out every
    ``heartbeat`` seconds, so a lost rank shows even without traffic.
    ``on_tick`` is called after every step or heartbeat (liveness).
    """
    core = make_core()
    share = core.share_commands
    reason = "the engine is shutting down"
    last_shared = time.monotonic()
    crashed = stopped = False
    try:
        on_ready(core)
        while True:
            check_cancelled()
            commands = _drain(inbox, block=not core.has_work, timeout=idle_wait)
            if share is not None:
                now = time.monotonic()
                if not (commands or core.has_work or now - last_shared >= heartbeat):
                    on_tick()
                    continue
                # Rank 0 never steps without an exchange, nor exchanges without
                # a step: every rank runs exactly the same sequence of steps.
                commands = share(commands)
                last_shared = now
            elif not (commands or core.has_work):
                on_tick()  # an idle wake-up (to see cancellation): no step
                continue
            for command in commands:
                if isinstance(command, Shutdown):
                    stopped = True
                    return
                core.handle_command(command)
            outputs = core.step()
            on_tick()
            if outputs:
                emit(outputs)
    except Exception as exc:
        crashed = True
        reason = f"the engine crashed ({type(exc).__name__}: {exc}); it is restarting"
        if share is not None:
            reason = f"the distributed engine failed ({type(exc).__name__}: {exc})"
        try:
            on_crash(reason)  # /health turns 503 before the failures go out
        except BaseException:
            log.debug("could not report the crash")
        raise
    finally:
        if share is not None and not crashed and not stopped:
            try:  # leaving without a Shutdown (cancelled): stop the other ranks too
                share([Shutdown()])
            except Exception:
                log.debug("could not tell the other ranks to stop")
        if share is not None:
            log.info("stopping after %d engine steps", core.stats().steps)
        leftover = core.close(reason)
        if leftover:
            try:
                emit(leftover)
            except BaseException:  # the trio side is gone: nobody to tell
                log.debug("could not deliver the engine's final outputs")
        # Free the model's arrays here, on the thread that made them: the trio
        # side keeps the handle (for its tokenizer) but must not keep the model.
        core.handle.model = None
        del core
        gc.collect()


def run_follower_loop(core: EngineCore) -> None:
    """A distributed rank other than 0: rank 0's commands in, identical steps, outputs dropped.

    Returns on ``Shutdown``; a lost peer raises from the collective.
    """
    try:
        while True:
            for command in core.share_commands(None):
                if isinstance(command, Shutdown):
                    return
                core.handle_command(command)
            core.step()
    finally:
        log.info("stopping after %d engine steps", core.stats().steps)
        core.close("this rank is stopping")
        core.handle.model = None
        gc.collect()


def _drain(inbox: queue.SimpleQueue, *, block: bool, timeout: float) -> list:
    commands = []
    try:
        commands.append(inbox.get(timeout=timeout) if block else inbox.get_nowait())
        while True:
            commands.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return commands
