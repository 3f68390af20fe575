"""Every use of the private parts of mlx-lm's ``BatchGenerator`` and its batches.

As ``runtime.mlx_lm_internals`` for the rest of mlx-lm: each piece with the
reason and what it relies on, checked against the installed mlx-lm
(``check_internals``, at every generator's construction, and
``tests/test_batch_sampling.py``, ``tests/test_mlx_lm_internals.py``;
docs/upgrading-mlx-lm.md: what to do when an upgrade changes them).

* ``install_row_hooks`` (with ``RowAwarePromptBatch``,
  ``RowAwareGenerationBatch`` and ``check_internals``): tells a row-aware
  sampler which rows it samples (``runtime.batch_sampling``), and filters a
  batch's layers without waiting for the device (``runtime.mlx_lm_internals``'
  ``filter_layers``: what ``BatchKVCache.filter`` does, for all layers at once).
* ``RowAwarePromptBatch`` also grows its KV layers once for the rest of a
  lone prompt (``_room_reserved``) and, with ``queue_prefill_chunks``, queues
  its chunks while sequences decode. Both batches give one unpadded row's
  attention no mask array (``runtime.plain_masks``).
* ``runtime.mlx_lm_prefill`` reads the generator's prefill state between steps, checked
  here too; ``runtime.vacant_rows`` takes over ``RowAwareGenerationBatch``'s per-row lists
  where a large batch keeps a leaving row's place, and ``runtime.held_prefix`` holds its
  rows' shared prefix once around a join. Receives and emits nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache

from runtime import vacant_rows
from runtime.batch_layers import (
    layers_evaluated_in_turn,
    layers_extended,
    layers_filtered,
    room_made,
    rows_aligned_by_slices,
)
from runtime.held_prefix import prefix_kept
from runtime.mlx_environment import wait_before_batch_copy
from runtime.mlx_lm_internals import evals_queued, layer_paddings, queue_evals_in_generate
from runtime.mlx_lm_prefill import tokens_to_come
from runtime.plain_masks import plain_masks

# ------------------------------------------------- batch generator rows
# Every use of mlx-lm's private ``BatchGenerator`` internals, in one place.
# Owns the hook that tells a row-aware sampler which rows it is sampling. mlx-lm
# 0.32 calls a sampler as ``sampler(logprobs)``, with no row identity, from two
# places: ``GenerationBatch._step`` (every decode step of the running batch) and
# ``PromptProcessingBatch.generate`` (whose freshly built ``GenerationBatch``
# samples the first token of the rows that just finished their prompts, in its
# ``__init__``). Two subclasses wrap exactly those two methods so that, during
# the call, the sampler knows the rows' uids and their ``inputs`` (the tokens fed
# to the model this step: each row's previous sample, or, for a row's first
# sample, its last prompt token). ``install_row_hooks`` puts them into a
# ``BatchGenerator`` right after construction.
#
# The mlx-lm internals relied on (0.32.x), all checked by ``check_internals``
# (called by ``install_row_hooks``; tests/test_batch_sampling.py calls it too):
#
# - ``BatchGenerator`` instance attributes ``_prompt_batch``, ``_generation_batch``
#   (created once in ``__init__`` and afterwards only ``extend``-ed, ``split``
#   and ``filter``-ed; mlx-lm never replaces them, and the prompt batch is swapped
#   between steps only by ``runtime.short_prompts_first``, with a shallow copy of
#   itself that keeps these hooks), ``_unprocessed_sequences``, ``model``,
#   ``sampler`` (the fallback sampler every ``None`` row sampler becomes),
#   ``prefill_step_size``.
# - ``PromptProcessingBatch.empty(model, fallback_sampler, prefill_step_size)``,
#   ``.generate(tokens)``; ``split`` copies through ``_copy``, which builds
#   ``self.__class__`` (so a split keeps our subclass); ``extend`` keeps the
#   receiver; instance attributes ``uids`` and ``fallback_sampler``.
# - ``GenerationBatch.empty(model, fallback_sampler)``, ``._step()``, which reads
#   the step's inputs from ``self._next_tokens`` and samples all rows in one call
#   when every row has the same sampler object; instance attributes ``uids``,
#   ``fallback_sampler``, ``_next_tokens``.
#
# A sampler takes part by having ``sampling_rows(uids, inputs)``, a context
# manager (see ``runtime.batch_sampling.BatchSampler``); any other sampler is
# called exactly as mlx-lm calls it.


TESTED_MLX_LM = "0.32."  # the release series these hooks were written against


class MlxLmInternalsChanged(RuntimeError):
    """mlx-lm no longer has the private shape these hooks rely on."""


def _row_hook(sampler: Any):
    return getattr(sampler, "sampling_rows", None)


class RowAwarePromptBatch(PromptProcessingBatch):
    """A prompt batch whose ``generate`` tells the sampler the rows of their first
    sample, whose ``filter`` (of a ``split``) reads the layers' paddings at once, and
    whose layers, while it prefills one prompt, grow once for the rest of it
    (``tokens_to_come`` set, ``_room_reserved``) and, its rows unpadded, give the mask
    as ``"causal"`` (``runtime.plain_masks``).

    The generator's lasting prompt batch may also queue its chunks (``decoding`` set,
    ``queue_prefill_chunks``): while ``decoding()`` says sequences are generating,
    ``prompt`` evaluates the chunk without waiting for the device, so the next step's
    decode is built while the device runs the chunk (mlx-lm waits, and the device then
    idles while the host builds). The decode step's own wait for its tokens, queued
    before the chunk, bounds what is in flight to one chunk; with nothing decoding,
    chunks are waited for as mlx-lm does."""

    decoding = None  # a callable, on the generator's lasting prompt batch only
    # On the lasting prompt batch: its member's tokens to prefill after this chunk.
    tokens_to_come = None

    def prompt(self, tokens):
        decoding = self.decoding
        queued = decoding is not None and decoding()
        # Unqueued, mlx-lm waits for each chunk to its end, so reading the rows' paddings
        # adds no wait of its own: several unpadded rows attend under "causal" too.
        with _room_reserved(self.prompt_cache, tokens, self.tokens_to_come), \
                plain_masks(self.prompt_cache, len(tokens), several=not queued), \
                rows_aligned_by_slices(self.prompt_cache, tokens):
            if tokens:  # a large batch grows before the pass, a layer at a time
                room_made(self.prompt_cache, max(len(t) for t in tokens))
            if not queued:
                return super().prompt(tokens)
            with evals_queued():
                return super().prompt(tokens)

    def filter(self, keep):
        _chunk_settled(self)
        with layers_filtered(self, keep):
            super().filter(keep)

    def extract_cache(self, idx):
        _chunk_settled(self)
        return super().extract_cache(idx)

    def split(self, indices):
        _chunk_settled(self)
        return super().split(indices)

    def extend(self, batch):
        _chunk_settled(self)
        # A reserved room stays with its one prompt: a prompt that joins would be padded
        # to it (copied, rolled and filtered with it), and would take it along when it
        # leaves into the generation batch, which pads every row to its longest layer.
        # (A lone prompt's room is its own size when it leaves.)
        _room_given_back(self.prompt_cache)
        copied = len(self.uids) > 0
        super().extend(batch)
        if copied:
            layers_evaluated_in_turn(self.prompt_cache)

    def generate(self, tokens):
        with plain_masks(self.prompt_cache, len(tokens)):
            hook = _row_hook(self.fallback_sampler)
            if hook is None:
                return super().generate(tokens)
            # The GenerationBatch built here samples every one of ``self.uids`` once
            # in its __init__; their inputs are the last prompt tokens (not samples).
            with hook(list(self.uids), None):
                return super().generate(tokens)


def _chunk_settled(batch: PromptProcessingBatch) -> None:
    """A chunk whose later layers wait for the next step (``runtime.mixed_step``'s
    ``ChunkInFlight``) run to its end, before the batch's caches are read or changed."""
    settle = getattr(batch.model, "settle", None)
    if settle is not None:
        settle()


@contextlib.contextmanager
def _room_reserved(caches: list, tokens: Sequence[Sequence[int]], tokens_to_come) -> Iterator[None]:
    """Around a prompt batch's ``prompt`` of one prompt: a ``BatchKVCache`` layer that
    grows in it grows once to hold the whole rest of the prompt, not by mlx-lm's 256
    tokens. Batches of several prompts grow as mlx-lm grows them.

    mlx-lm grows a batch cache by concatenating a new block onto all it holds: with
    paced 64-token chunks, every fourth step of a 30k-token prompt copied the whole
    cache into a new buffer (an H200 step 15 ms longer, sixteen streams waiting on
    it), and a full-chunk prefill copies it at every chunk. The room is what the
    prompt will hold in the end anyway; the class's ``step`` is set on the layers for
    the call and taken back after it, so nothing else grows by it."""
    if tokens_to_come is None or len(tokens) != 1:
        yield
        return
    needed = len(tokens[0]) + tokens_to_come()
    step = BatchKVCache.step
    if needed <= step:
        yield
        return
    reserved = [c for c in caches if type(c) is BatchKVCache]
    for c in reserved:
        c.step = -(-needed // step) * step
    try:
        yield
    finally:
        for c in reserved:
            c.__dict__.pop("step", None)


def _room_given_back(caches: list) -> None:
    """Each ``BatchKVCache`` layer cut to what it holds (views, no copy)."""
    for c in caches:
        if type(c) is BatchKVCache and c.keys is not None and c.keys.shape[2] > c._idx:
            c.keys, c.values = c.keys[..., : c._idx, :], c.values[..., : c._idx, :]


class RowAwareGenerationBatch(GenerationBatch):
    """A generation batch whose ``_step`` tells the sampler its rows and their inputs,
    and whose ``filter`` reads the layers' paddings at once. A large batch keeps a leaving
    row's place for a joining one (``runtime.vacant_rows``), waits for the device before a
    copy of its layers (``wait_before_batch_copy``), evaluates that copy a layer at a
    time, and grows before a pass, not in it (``runtime.batch_layers``). Its rows'
    shared prefix may be held once (``runtime.held_prefix``)."""

    def _step(self):
        with plain_masks(self.prompt_cache, len(self.uids)):
            hook = _row_hook(self.fallback_sampler)
            if hook is None:
                return super()._step()
            with hook(self.uids, self._next_tokens):
                return super()._step()

    # mlx-lm leaves the rows' next inputs lazy when rows join (a concatenation) or leave
    # (a selection); evaluated at the next step, they would wait behind this step's
    # prefill chunk on the device. A step with constrained rows reads them before building
    # its own graph (the masks need them), so they are queued at once: it then waits for
    # the decode tokens only, not for the prefill.
    # The joined layers' paddings, which a row's leave reads, are made on the host
    # (``joined_paddings``). Reading both sides' first waits for nothing: this batch's are
    # the host's (a filter's or an earlier join's), and a joining batch's were read as its
    # prompt batch was split (``filter_layers``). (A prompt batch's own may be a padded
    # chunk's still in flight, so it extends as mlx-lm does.)

    row_reuse = None  # runtime.vacant_rows: a large batch's leaving rows kept for joining ones
    prefix_holding = None  # runtime.held_prefix: the rows' shared prefix held once

    def next(self):
        if (keep := vacant_rows.age_vacant(self)) is not None:
            self.filter(keep)
        responses = super().next()
        return responses if self.row_reuse is None else [r for r in responses if r.uid >= 0]

    def extend(self, batch):
        with prefix_kept(mx, self, batch):
            mine, theirs = layer_paddings(self.prompt_cache), layer_paddings(batch.prompt_cache)
            if not vacant_rows.fill(self, batch, mine, theirs):
                rows = len(self.uids)
                if vacant_rows.margin_for_longer(self, batch):
                    theirs = layer_paddings(batch.prompt_cache)
                wait_before_batch_copy(mx, self.prompt_cache)  # an empty batch holds nothing
                with layers_extended(self, batch, mine, theirs):
                    super().extend(batch)
                if rows:
                    layers_evaluated_in_turn(self.prompt_cache)
                vacant_rows.joined_vacant(self, batch, rows)
        # This step's prefill chunk may carry the batch's next decode (runtime.mixed_step).
        room_made(self.prompt_cache, 1)
        self._queue_next_tokens()

    def filter(self, keep):
        if vacant_rows.vacate(self, keep):
            return
        keep = vacant_rows.kept_rows(self, keep)
        if keep and len(keep) < len(self.uids):
            wait_before_batch_copy(mx, self.prompt_cache)
        with layers_filtered(self, keep):
            super().filter(keep)
        rows_kept = getattr(self.model, "rows_kept", None)  # runtime.mixed_step
        if rows_kept is not None:
            rows_kept(self, keep, self._next_tokens)
        self._queue_next_tokens()

    def extract_cache(self, idx):
        caches = super().extract_cache(idx)
        trim_pending = getattr(self.model, "trim_pending", None)  # runtime.mixed_step
        return caches if trim_pending is None else trim_pending(self, caches)

    def _queue_next_tokens(self) -> None:
        if self._next_tokens is not None and _row_hook(self.fallback_sampler) is not None:
            mx.async_eval(self._next_tokens)


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
    next_source = _source(BatchGenerator._next)
    expect(
        "self.prefill_batch_size - len(self._prompt_batch)" in next_source
        and next_source.find("prefill_batch_size")
        < next_source.find("_currently_processing")
        < next_source.find(".split("),
        "BatchGenerator._next takes prefill_batch_size - len(_prompt_batch) waiting "
        "sequences before it splits the done members off _currently_processing",
    )
    # runtime.mlx_lm_prefill: a waiting sequence's segments and caches (its depth).
    expect(
        "pending.append((uid, seq, m, c," in _source(BatchGenerator.insert_segments),
        "BatchGenerator.insert_segments queues (uid, segments, max_tokens, caches, ...) entries",
    )
    # runtime.mixed_step: the generation batch's next decode runs in the prompt chunk's
    # pass, which follows every change to the generation batch within a step.
    expect(
        -1 < next_source.find("self._generation_batch.extend(")
        < next_source.find("self._prompt_batch.prompt("),
        "BatchGenerator._next extends the generation batch before it prefills the step's chunk",
    )
    # runtime.engine_generator.ChunkGoesFirst: a step's decode is its generation batch's one
    # next() call, made before anything else, with mlx-lm's counters of it.
    expect(
        next_source.find("self._generation_batch.next()") > -1
        and next_source.find("self._generation_batch.next()")
        < next_source.find("self._make_batch(")
        and "self._counters.decode_time" in next_source,
        "BatchGenerator._next decodes first, with one self._generation_batch.next() call "
        "counted in self._counters",
    )
    expect(
        "self.model(inputs[:, None], cache=self.prompt_cache)" in step,
        "GenerationBatch._step calls self.model(inputs[:, None], cache=self.prompt_cache)",
    )
    expect(
        "self.model(tokens[:, :n_to_process], cache=self.prompt_cache)"
        in _source(PromptProcessingBatch.prompt),
        "PromptProcessingBatch.prompt calls self.model(chunk, cache=self.prompt_cache)",
    )
    for cls in (PromptProcessingBatch, GenerationBatch):
        filtering = _source(cls.filter).replace(" ", "")
        expect(
            "forcinself.prompt_cache:\nc.filter(keep)" in filtering
            and "self.prompt_cache.clear()" in filtering,
            f"{cls.__name__}.filter(keep) calls each of self.prompt_cache's filter(keep) "
            "(or clears the list when nothing is kept)",
        )
    filtering = _source(BatchKVCache.filter)
    expect(
        all(part in filtering for part in (
            "self.keys[batch_indices]", "self.offset[batch_indices]",
            "self.left_padding[batch_indices]", "min(self.left_padding.tolist())",
            "self._idx -= min_left_pad", "self.left_padding -= min_left_pad")),
        "BatchKVCache.filter selects keys, values, offset and left_padding and trims the "
        "shared left padding from keys, values, _idx and left_padding",
    )
    # joined_paddings: what BatchKVCache.extend makes of the two sides' paddings.
    extending = _source(BatchKVCache.extend)
    expect(
        all(part in extending for part in (
            "mx.concatenate([self.left_padding, other.left_padding])",
            "max_idx = max(self._idx, other._idx)", "left = max_idx - c._idx",
            "left_padding = c.left_padding + left")),
        "BatchKVCache.extend shifts each side's left padding by max_idx - its _idx "
        "(two empty sides: concatenated as they are)",
    )
    # _room_reserved: a layer grows by whole blocks of its ``step`` tokens.
    growing = _source(BatchKVCache.update_and_fetch)
    expect(
        "(self.step + keys.shape[2] - 1) // self.step" in growing,
        "BatchKVCache.update_and_fetch grows the cache by whole blocks of self.step tokens",
    )
    # runtime.cuda_attention.ChunkAttention: a layer's keys are its buffer's first _idx,
    # the buffer zero-filled where it grows, and its mask is causal from _idx with
    # left_padding.
    expect(
        "mx.zeros(k_shape" in growing
        and "self.keys[..., : self._idx, :]" in _source(BatchKVCache.keys_and_values)
        and "offset=self._idx, left_padding=self.left_padding"
        in _source(BatchKVCache.make_mask).replace("\n", " ").replace("  ", ""),
        "BatchKVCache grows its buffer with zeros, fetches its first _idx keys and masks "
        "causally from _idx with its left_padding",
    )
    # runtime.plain_masks: a model's mask comes from the cache instance's make_mask.
    from mlx_lm.models import base
    expect(
        "cache.make_mask(" in _source(base.create_attention_mask),
        "mlx_lm.models.base.create_attention_mask asks the cache's make_mask for the mask",
    )
    if generator is not None:
        for name in (
            "model",
            "sampler",
            "prefill_step_size",
            "prefill_batch_size",
            "completion_batch_size",
            "_prompt_batch",
            "_generation_batch",
            "_unprocessed_sequences",
            "_currently_processing",
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
    generator._prompt_batch.tokens_to_come = tokens_to_come(generator)
    return generator


def queue_prefill_chunks(generator: BatchGenerator) -> bool:
    """Let ``generator``'s prompt batch (row hooks installed) queue its chunks while
    sequences decode (``RowAwarePromptBatch``); whether it can."""
    if not isinstance(generator._prompt_batch, RowAwarePromptBatch) or not queue_evals_in_generate():
        return False
    lasting = weakref.ref(generator)  # no cycle: a replaced generator's caches go at once

    def decoding() -> bool:
        owner = lasting()
        return owner is not None and len(owner._generation_batch) > 0

    generator._prompt_batch.decoding = decoding
    return True
