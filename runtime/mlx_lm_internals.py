"""Every use of mlx-lm's private ``BatchGenerator`` internals, in one place.

Owns the hook that tells a row-aware sampler which rows it is sampling. mlx-lm
0.32 calls a sampler as ``sampler(logprobs)``, with no row identity, from two
places: ``GenerationBatch._step`` (every decode step of the running batch) and
``PromptProcessingBatch.generate`` (whose freshly built ``GenerationBatch``
samples the first token of the rows that just finished their prompts, in its
``__init__``). Two subclasses wrap exactly those two methods so that, during
the call, the sampler knows the rows' uids and their ``inputs`` (the tokens fed
to the model this step: each row's previous sample, or, for a row's first
sample, its last prompt token). ``install_row_hooks`` puts them into a
``BatchGenerator`` right after construction.

The mlx-lm internals relied on (0.32.x), all checked by ``check_internals``
(called by ``install_row_hooks``; tests/test_batch_sampling.py calls it too):

- ``BatchGenerator`` instance attributes ``_prompt_batch``, ``_generation_batch``
  (created once in ``__init__`` and afterwards only ``extend``-ed, ``split``
  and ``filter``-ed, never replaced), ``_unprocessed_sequences``, ``model``,
  ``sampler`` (the fallback sampler every ``None`` row sampler becomes),
  ``prefill_step_size``.
- ``PromptProcessingBatch.empty(model, fallback_sampler, prefill_step_size)``,
  ``.generate(tokens)``; ``split`` copies through ``_copy``, which builds
  ``self.__class__`` (so a split keeps our subclass); ``extend`` keeps the
  receiver; instance attributes ``uids`` and ``fallback_sampler``.
- ``GenerationBatch.empty(model, fallback_sampler)``, ``._step()``, which reads
  the step's inputs from ``self._next_tokens`` and samples all rows in one call
  when every row has the same sampler object; instance attributes ``uids``,
  ``fallback_sampler``, ``_next_tokens``.

A sampler takes part by having ``sampling_rows(uids, inputs)``, a context
manager (see ``runtime.batch_sampling.BatchSampler``); any other sampler is
called exactly as mlx-lm calls it.
"""

from __future__ import annotations

import inspect
from typing import Any

import mlx_lm
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

TESTED_MLX_LM = "0.32."  # the release series these hooks were written against


class MlxLmInternalsChanged(RuntimeError):
    """mlx-lm no longer has the private shape these hooks rely on."""


def _row_hook(sampler: Any):
    return getattr(sampler, "sampling_rows", None)


class RowAwarePromptBatch(PromptProcessingBatch):
    """A prompt batch whose ``generate`` tells the sampler the rows of their first sample."""

    def generate(self, tokens):
        hook = _row_hook(self.fallback_sampler)
        if hook is None:
            return super().generate(tokens)
        # The GenerationBatch built here samples every one of ``self.uids`` once
        # in its __init__; their inputs are the last prompt tokens (not samples).
        with hook(list(self.uids), None):
            return super().generate(tokens)


class RowAwareGenerationBatch(GenerationBatch):
    """A generation batch whose ``_step`` tells the sampler its rows and their inputs."""

    def _step(self):
        hook = _row_hook(self.fallback_sampler)
        if hook is None:
            return super()._step()
        with hook(self.uids, self._next_tokens):
            return super()._step()


def _parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def check_internals(generator: BatchGenerator | None = None) -> None:
    """Raise ``MlxLmInternalsChanged`` naming every expectation mlx-lm no longer meets.

    With ``generator``, its instance attributes are checked too.
    """
    problems: list[str] = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    expect("sampler" in _parameters(BatchGenerator.__init__), "BatchGenerator(sampler=...)")
    expect(
        _parameters(PromptProcessingBatch.generate) == ["self", "tokens"],
        "PromptProcessingBatch.generate(self, tokens)",
    )
    expect(
        _parameters(PromptProcessingBatch.empty)[:3]
        == ["model", "fallback_sampler", "prefill_step_size"],
        "PromptProcessingBatch.empty(model, fallback_sampler, prefill_step_size)",
    )
    expect(
        "self.__class__" in _source(PromptProcessingBatch._copy),
        "PromptProcessingBatch._copy builds self.__class__ (split keeps the subclass)",
    )
    expect(
        "GenerationBatch(" in _source(PromptProcessingBatch.generate)
        and "self.fallback_sampler" in _source(PromptProcessingBatch.generate),
        "PromptProcessingBatch.generate builds a GenerationBatch with its fallback_sampler",
    )
    expect(_parameters(GenerationBatch._step) == ["self"], "GenerationBatch._step(self)")
    expect(
        _parameters(GenerationBatch.empty)[:2] == ["model", "fallback_sampler"],
        "GenerationBatch.empty(model, fallback_sampler)",
    )
    step = _source(GenerationBatch._step)
    expect(
        "self._next_tokens" in step and "self.fallback_sampler" in step,
        "GenerationBatch._step takes its inputs from self._next_tokens and "
        "samples with self.fallback_sampler",
    )
    init = _parameters(GenerationBatch.__init__)
    expect(
        "inputs" in init and "fallback_sampler" in init,
        "GenerationBatch.__init__(..., inputs, ..., fallback_sampler, ...)",
    )
    if generator is not None:
        for name in (
            "model",
            "sampler",
            "prefill_step_size",
            "_prompt_batch",
            "_generation_batch",
            "_unprocessed_sequences",
        ):
            expect(hasattr(generator, name), f"BatchGenerator instance attribute {name}")
        expect(
            isinstance(getattr(generator, "_prompt_batch", None), PromptProcessingBatch),
            "BatchGenerator._prompt_batch is a PromptProcessingBatch",
        )
        expect(
            isinstance(getattr(generator, "_generation_batch", None), GenerationBatch),
            "BatchGenerator._generation_batch is a GenerationBatch",
        )
        gen_batch = getattr(generator, "_generation_batch", None)
        for name in ("uids", "fallback_sampler", "_next_tokens"):
            expect(hasattr(gen_batch, name), f"GenerationBatch instance attribute {name}")
        prompt_batch = getattr(generator, "_prompt_batch", None)
        for name in ("uids", "fallback_sampler"):
            expect(hasattr(prompt_batch, name), f"PromptProcessingBatch instance attribute {name}")
    if problems:
        raise MlxLmInternalsChanged(
            f"mlx-lm {mlx_lm.__version__} (hooks written for {TESTED_MLX_LM}x) changed: "
            + "; ".join(problems)
        )


def install_row_hooks(generator: BatchGenerator) -> BatchGenerator:
    """Replace a new, empty generator's batches by the row-aware subclasses."""
    check_internals(generator)
    if (
        len(generator._prompt_batch)
        or len(generator._generation_batch)
        or generator._unprocessed_sequences
    ):
        raise ValueError("install_row_hooks needs a BatchGenerator that has no sequences yet")
    generator._prompt_batch = RowAwarePromptBatch.empty(
        generator.model, generator.sampler, prefill_step_size=generator.prefill_step_size
    )
    generator._generation_batch = RowAwareGenerationBatch.empty(generator.model, generator.sampler)
    return generator
