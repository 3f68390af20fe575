"""What the engine counts, how one sequence fails, and small helpers of its step.

Owns no state of its own: ``EngineCounters`` is the record an ``EngineCore``
keeps of its running totals (read into every ``EngineStats``);
``SequenceError`` is what a batch generator raises to fail one sequence
alone; ``EngineBroken`` what the core raises when its steps keep failing;
``token_event`` turns a generator's response into a ``TokenEvent``;
``token_logprobs`` and ``back_off_one_token`` work on MLX arrays for the
core's step and admission. Everything here runs on the engine thread.
"""

from __future__ import annotations

import bisect
import collections
import time
from typing import Any

import attrs

from runtime.messages import (
    BATCH_SIZE_BUCKETS,
    STEP_SECONDS_BUCKETS,
    EngineStats,
    FinishReason,
    TokenEvent,
)

RECENT_STEPS = 8  # step end times kept to count the steps an abort waited for
# Steps in a row that failed their whole batch: then the engine, not a request, is broken.
FAILED_STEPS_TO_RESTART = 3
# mlx-lm's finish reasons ("stop", "length") as ours, without an enum lookup per token.
_FINISH_REASONS = {reason.value: reason for reason in FinishReason}


class SequenceError(Exception):
    """A batch generator could not go on with one sequence: only its request fails.

    Raised from ``next()`` (``SerialGenerator`` does, for the sequence it
    serves); any other exception from a step fails every sequence in the batch.
    """

    def __init__(self, uid: int, message: str):
        super().__init__(message)
        self.uid = uid
        self.message = message


class EngineBroken(RuntimeError):
    """``FAILED_STEPS_TO_RESTART`` steps in a row failed every sequence they held.

    A step that raises fails its batch and the engine goes on with a new one,
    which is right when one batch was bad. When the batches that follow fail
    too, MLX itself is in a state no new batch mends (a sticky CUDA error, a
    cache past a limit): this ends the engine loop as a crash, so /health turns
    503 and the ModelLoader starts a fresh engine (a fresh process by default).
    """


def token_event(seq: Any, response: Any) -> TokenEvent:
    """The one place a generator's response becomes a ``TokenEvent`` (``seq``: the
    core's record of the sequence: ``request_id``, ``wants_logprobs``, ``top_logprobs``)."""
    token = int(response.token)
    logprob, top = None, ()
    if seq.wants_logprobs:
        logprob, top = token_logprobs(response.logprobs, token, seq.top_logprobs)
    reason = response.finish_reason  # mlx-lm: "stop", "length" or None
    return TokenEvent(
        request_id=seq.request_id,
        token=token,
        finish_reason=None if reason is None else _FINISH_REASONS.get(reason)
        or FinishReason(reason),
        logprob=logprob,
        top_logprobs=top,
    )


@attrs.define
class SequenceRecord:
    """What the engine core keeps of one sequence in its batch generator."""

    request_id: int
    uid: int  # the batch generator's id
    logprobs: bool
    top_logprobs: int
    segment_types: list[str]  # reversed: pop() gives the next segment's type
    save_final: bool = True  # its cache goes to the prompt cache when it finishes
    cache_key: Any = None  # its prompt-cache partition (the model's key, with a scope)
    # Read for every token: computed once.
    wants_logprobs: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.wants_logprobs = self.logprobs or self.top_logprobs > 0


def uncached_segments(segments, segment_types, cached: int) -> tuple[list[list[int]], list[str]]:
    """A prompt's segments and their types past its first ``cached`` tokens."""
    segments = [list(s) for s in segments]
    types = list(segment_types)
    skip = cached
    while skip > 0 and segments:
        if skip >= len(segments[0]):
            skip -= len(segments.pop(0))
            types.pop(0)
        else:
            segments[0] = segments[0][skip:]
            skip = 0
    return segments, types


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
            prompt_tokens=self.prompt_tokens,
            prompt_tokens_computed=self.prompt_tokens_computed,
            generated_tokens=self.generated_tokens,
            step_seconds_counts=tuple(self.step_seconds_counts),
            step_seconds_sum=self.step_seconds_sum,
            batch_size_counts=tuple(self.batch_size_counts),
            batch_size_sum=self.batch_size_sum,
        )



def back_off_one_token(cache: list, prompt: list[int]) -> tuple[list | None, list[int]]:
    """An exact prompt-cache hit leaves nothing to feed the model: give back its last token."""
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    if len(prompt) > 1 and can_trim_prompt_cache(cache):
        trim_prompt_cache(cache, 1)
        return cache, prompt[-1:]
    return None, prompt


def token_logprobs(lp: Any, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The sampled token's logprob and the top ``n`` (token, logprob), best first."""
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
