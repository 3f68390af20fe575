"""How a ``Submit`` becomes one sequence of the batch generator: its sampling and its insert.

``SequenceInserts`` holds what an ``EngineCore`` was built with for its
sequences (``runtime.engine.loading`` makes these from mlx-lm parts):
samplers, logits processors, the batch sampler, structured-output
constraints, stop sequences and the generator's further per-sequence
options. It receives a ``Submit``: ``sampling_of`` emits the sequence's
sampler, logits processors and constraint (and raises for one that cannot
run, before anything is inserted, so that the request fails alone);
``insert`` makes the one ``insert_segments`` call and registers the new uid
with the ``BatchSampler``; ``forget`` and ``clear`` end registrations. The
prompt cache (what the sequence starts from) stays the core's. Runs on the
engine thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.messages import Submit


class SequenceInserts:
    """The per-sequence arguments of ``insert_segments``, and the batch sampler's rows.

    Sampling: with a ``batch_sampler`` (``BatchSampler``: ``register(uid,
    params, constraint)``, ``forget(uid)``) every sequence is inserted with
    ``samplers=[None]`` (the generator's fallback, that sampler) and
    registered under its uid; without one, ``sampler_factory(params)`` gives
    each sequence its own sampler (``None``: the generator's).
    ``logits_processors_factory(params)``: a sequence's processors.
    ``constraint_factory(spec)`` turns a ``Submit.constraint`` into the
    sequence's constraint: with a ``batch_sampler``, its ``RowConstraint``;
    without, a logits processor added to the sequence's. Without a
    ``constraint_factory`` a constrained request fails alone.

    ``insert_options(submit)``: further per-sequence arguments of the
    generator's ``insert_segments`` (``SerialGenerator`` takes
    ``num_draft_tokens``), one value each. ``stop_sequences``: every
    sequence's (None: the generator's own).
    """

    def __init__(
        self,
        *,
        sampler_factory: Callable[[Any], Any] | None = None,
        logits_processors_factory: Callable[[Any], list] | None = None,
        batch_sampler: Any = None,
        constraint_factory: Callable[[Any], Any] | None = None,
        insert_options: Callable[[Submit], dict[str, Any]] | None = None,
        stop_sequences: Any = None,
    ):
        self._sampler_factory = sampler_factory or (lambda params: None)
        self._logits_processors_factory = logits_processors_factory or (lambda params: [])
        self.batch_sampler = batch_sampler
        self._constraint_factory = constraint_factory
        self._insert_options = insert_options or (lambda submit: {})
        self._stop_sequences = stop_sequences

    def sampling_of(self, sub: Submit) -> tuple[Any, list, Any]:
        """(sampler, logits processors, constraint) of a new sequence; raises if it cannot run."""
        constraint = None
        if sub.constraint is not None:
            if self._constraint_factory is None:
                raise ValueError("this engine cannot enforce structured outputs or tool_choice")
            constraint = self._constraint_factory(sub.constraint)
        processors = self._logits_processors_factory(sub.sampling)
        if self.batch_sampler is not None:
            from runtime.batch_sampling import validate_params

            validate_params(sub.sampling)  # before inserting: a bad request fails alone
            return None, processors, constraint
        if constraint is not None:
            processors = [*processors, constraint]
        return self._sampler_factory(sub.sampling), processors, None

    def insert(
        self,
        batch: Any,
        sub: Submit,
        sampling: tuple[Any, list, Any],
        *,
        segments: list[list[int]],
        cache: list | None,
        cached_tokens: list[int],
    ) -> int:
        """Insert ``sub`` into ``batch`` with its ``sampling`` (``sampling_of``):
        ``segments``, the prompt past ``cached_tokens``, computed after ``cache``
        (None: from the start). Returns the generator's uid."""
        sampler, processors, constraint = sampling
        options = {name: [value] for name, value in self._insert_options(sub).items()}
        (uid,) = batch.insert_segments(
            segments=[segments],
            max_tokens=[sub.max_tokens],
            caches=[cache],
            all_tokens=[cached_tokens],
            samplers=[sampler],
            logits_processors=[processors],
            stop_sequences=[self._stop_sequences] if self._stop_sequences is not None else None,
            **options,
        )
        if self.batch_sampler is not None:
            try:
                self.batch_sampler.register(uid, sub.sampling, constraint)
            except Exception:
                batch.remove([uid])
                raise
        return uid

    def forget(self, uid: int) -> None:
        """A sequence left the generator: the batch sampler drops its row."""
        if self.batch_sampler is not None:
            self.batch_sampler.forget(uid)

    def clear(self) -> None:
        """The generator is replaced: a new one's uids start again at 0."""
        if self.batch_sampler is not None:
            self.batch_sampler.clear()
