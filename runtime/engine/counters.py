"""The engine's running totals: what ``EngineStats`` reports of an ``EngineCore``.

``EngineCounters`` is the record an ``EngineCore`` keeps since it was built.
It receives the core's notes (``started`` for an admitted sequence,
``stepped`` for each ``step()``, ``aborted`` for an applied ``Abort``) and
emits an ``EngineStats`` (``stats``) for every ``StepOutputs``. Everything
here runs on the engine thread and touches no MLX arrays.
"""

from __future__ import annotations

import bisect
import collections
import time

import attrs

from runtime.messages import BATCH_SIZE_BUCKETS, STEP_SECONDS_BUCKETS, EngineStats

RECENT_STEPS = 8  # step end times kept to count the steps an abort waited for


@attrs.define
class EngineCounters:
    """The engine's running totals since it was built, read into every ``EngineStats``."""

    steps: int = 0
    prefill_steps: int = 0  # steps that processed prompt tokens
    busy_seconds: float = 0.0  # wall time inside step()
    cache_hits: int = 0  # requests that reused a prompt-cache entry
    cached_tokens: int = 0  # prompt tokens those entries covered
    aborts: int = 0  # aborts that removed a sequence
    abort_wait_ms_total: float = 0.0  # from Abort.posted_at to its removal
    abort_wait_ms_max: float = 0.0
    abort_wait_steps_max: int = 0  # steps finished while an abort waited
    aborted_prefills_kept: int = 0  # aborted prompts whose computed part was cached
    aborted_prefill_tokens_kept: int = 0  # the tokens they had computed
    recent_step_ends: collections.deque[float] = attrs.field(
        factory=lambda: collections.deque(maxlen=RECENT_STEPS)
    )
    prompt_tokens: int = 0  # of the sequences admitted, cached ones included
    prompt_tokens_computed: int = 0  # of those, given to the generator to compute
    generated_tokens: int = 0
    # Steps with sequences in the batch, per bucket (the bounds, then +Inf).
    step_seconds_counts: list[int] = attrs.field(
        factory=lambda: [0] * (len(STEP_SECONDS_BUCKETS) + 1)
    )
    step_seconds_sum: float = 0.0
    batch_size_counts: list[int] = attrs.field(
        factory=lambda: [0] * (len(BATCH_SIZE_BUCKETS) + 1)
    )
    batch_size_sum: int = 0

    def started(self, cached_tokens: int, prompt_tokens: int = 0) -> None:
        self.prompt_tokens += prompt_tokens
        if cached_tokens:
            self.cache_hits += 1
            self.cached_tokens += cached_tokens

    def stepped(
        self,
        seconds: float,
        *,
        prefill: bool,
        worked: bool,
        batch_size: int = 0,
        generated: int = 0,
    ) -> None:
        """One ``step()``; ``batch_size``: the sequences it ran (0: an empty step)."""
        self.steps += 1
        self.prefill_steps += prefill
        self.busy_seconds += seconds
        self.generated_tokens += generated
        if worked:
            self.recent_step_ends.append(time.monotonic())
        if batch_size:
            self.step_seconds_counts[bisect.bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1
            self.step_seconds_sum += seconds
            self.batch_size_counts[bisect.bisect_left(BATCH_SIZE_BUCKETS, batch_size)] += 1
            self.batch_size_sum += batch_size

    def aborted(self, posted_at: float) -> None:
        """An abort was applied: how long it waited, in ms and in engine steps finished."""
        wait_ms = max(0.0, (time.monotonic() - posted_at) * 1000)
        steps = sum(1 for finished in self.recent_step_ends if finished > posted_at)
        self.aborts += 1
        self.abort_wait_ms_total += wait_ms
        self.abort_wait_ms_max = max(self.abort_wait_ms_max, wait_ms)
        self.abort_wait_steps_max = max(self.abort_wait_steps_max, steps)

    def kept_aborted_prefill(self, tokens: int) -> None:
        """An aborted prompt's ``tokens`` computed so far went to the prompt cache."""
        self.aborted_prefills_kept += 1
        self.aborted_prefill_tokens_kept += tokens

    def stats(
        self, *, active_sequences: int, prompt_cache_entries: int, prompt_cache_bytes: int
    ) -> EngineStats:
        """The totals as an ``EngineStats``, with the figures the counters do not hold."""
        return EngineStats(
            active_sequences=active_sequences,
            steps=self.steps,
            prefill_steps=self.prefill_steps,
            busy_seconds=self.busy_seconds,
            prompt_cache_entries=prompt_cache_entries,
            prompt_cache_bytes=prompt_cache_bytes,
            prompt_cache_hits=self.cache_hits,
            prompt_cache_cached_tokens=self.cached_tokens,
            aborts=self.aborts,
            abort_wait_ms_total=self.abort_wait_ms_total,
            abort_wait_ms_max=self.abort_wait_ms_max,
            abort_wait_steps_max=self.abort_wait_steps_max,
            aborted_prefills_kept=self.aborted_prefills_kept,
            aborted_prefill_tokens_kept=self.aborted_prefill_tokens_kept,
            prompt_tokens=self.prompt_tokens,
            prompt_tokens_computed=self.prompt_tokens_computed,
            generated_tokens=self.generated_tokens,
            step_seconds_counts=tuple(self.step_seconds_counts),
            step_seconds_sum=self.step_seconds_sum,
            batch_size_counts=tuple(self.batch_size_counts),
            batch_size_sum=self.batch_size_sum,
        )
