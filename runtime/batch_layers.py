"""A batch's KV layers as rows join and leave it, or are aligned, each copied once.

Owns what ``runtime.mlx_lm_batches``' batches run around mlx-lm's ``filter``,
``extend`` and prompt processing: ``layers_filtered`` (the layers filtered by
``runtime.mlx_lm_internals.filter_layers``, which copies the kept rows as runs of
consecutive rows), ``layers_extended`` (a join that pads the batch's own rows
written into one new array per layer, ``extend_layers``) and ``rows_aligned_by_slices``
(a prompt batch's rows of different lengths aligned at their end by slices, not
mlx-lm's gather, ``rolled_rows``). Receives the batches, their prompts and their
layers' paddings read on the host (``layer_paddings``); emits nothing.

Why: mlx-lm's ``BatchKVCache.extend`` pads each side to the longer one's keys and
concatenates the two. Where the batch is the side padded (a joining row longer than
its rows, or with a longer buffer), the padded copy of the whole batch is made and
then copied again into the concatenation: the device holds the batch's KV three
times at once (the old arrays, which the step in flight still reads, the padded
copy and the result). Sixteen agent sessions of 14k tokens reached 77 GB of an H100's
80 in steps where rows joined, and 60-63 GB once joins were made this way
(docs/performance.md). Here each layer's result is allocated once and both sides are
written into it: held twice, copied once.

A large batch (``large_batch_bytes``) holds itself once and one layer more: its copies
are evaluated a layer at a time (``layers_evaluated_in_turn``), and a layer that would
grow in the next pass (mlx-lm concatenates a new block onto it inside the model's
pass, every layer's old and new arrays held until the pass ends) grows before it, a
layer at a time (``room_made``). MLX frees an array's inputs once it is evaluated, so
a layer's old arrays go before the next layer's new ones are made, where evaluated
together the copies hold the old arrays and the new at once: as a row joined 16 rows of
2,000 keys in Qwen3-0.6B's shape (3.67 GB), 1.76 GB beyond the batch on this
repository's CPU, and 0.14 GB a layer at a time (bench/batch_memory.py). With a 36 GB
KV budget, sixteen 24k-token first turns (a prompt batch holding the system prompt a
row) ran an 80 GB H100 out of memory.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

from runtime.mlx_environment import kv_bytes, large_batch_bytes
from runtime.mlx_lm_internals import filter_layers, joined_paddings


@contextlib.contextmanager
def layers_filtered(batch: Any, keep: list[int]) -> Iterator[None]:
    """Around mlx-lm's ``filter`` of a batch: the layers filtered by ``filter_layers``,
    mlx-lm's own loop over them given no layers (it keeps the rest of its work)."""
    caches = batch.prompt_cache
    if not keep:  # mlx-lm clears the list itself
        yield
        return
    rows = len(batch.uids)
    filter_layers(caches, keep)
    if len(keep) < rows:  # the kept rows copied
        layers_evaluated_in_turn(caches)
    batch.prompt_cache = []
    try:
        yield
    finally:
        batch.prompt_cache = caches


@contextlib.contextmanager
def layers_extended(batch: Any, joining: Any, mine: list, theirs: list) -> Iterator[None]:
    """Around mlx-lm's ``extend`` of a generation batch by ``joining``: where the batch's
    own rows would be padded, its layers extended by ``extend_layers`` and mlx-lm's
    loop over them given none of the joining batch's; otherwise mlx-lm's, with the
    paddings then made on the host (``joined_paddings``). ``mine``, ``theirs``: each
    side's ``layer_paddings`` before the join."""
    others = joining.prompt_cache
    if not extend_layers(batch.prompt_cache, others, mine, theirs):
        yield
        joined_paddings(batch.prompt_cache, mine, theirs)
        return
    joining.prompt_cache = []  # mlx-lm's _extend_cache keeps the batch's list as it is
    try:
        yield
    finally:
        joining.prompt_cache = others


def _padded_sides(c: Any, o: Any) -> tuple[int, int, bool]:
    """mlx-lm's ``extend`` of layer ``c`` by ``o``: the longer ``_idx``, the longer
    buffer, and whether ``c``'s own keys would be padded (left or right)."""
    idx = max(c._idx, o._idx)
    size = max(c.keys.shape[2], o.keys.shape[2])
    left = idx - c._idx
    return idx, size, left > 0 or size - c.keys.shape[2] - left > 0


def extend_layers(caches: list, others: list, mine: list, theirs: list) -> bool:
    """Each of ``caches``' layers extended by ``others``' as mlx-lm's ``extend`` does it
    (right-aligned at the longer ``_idx``, the longer buffer's size, the joining rows
    last), each result allocated once; the paddings made on the host from ``mine``
    and ``theirs`` (``layer_paddings``). Only where every layer on both sides is a
    plain ``BatchKVCache`` holding keys, the paddings were read for all of them, and
    some layer would pad the batch's own rows (otherwise mlx-lm's concatenation
    copies the batch once anyway). Whether it did."""
    from mlx_lm.models.cache import BatchKVCache

    if not caches or len(caches) != len(others) or len(mine) != len(caches) \
            or len(theirs) != len(others):
        return False
    for c, o in zip(caches, others, strict=True):
        if type(c) is not BatchKVCache or type(o) is not BatchKVCache \
                or c.keys is None or o.keys is None or c.keys.dtype != o.keys.dtype \
                or c.keys.shape[1::2] != o.keys.shape[1::2] \
                or c.values.shape[1::2] != o.values.shape[1::2]:
            return False
    if not any(_padded_sides(c, o)[2] for c, o in zip(caches, others, strict=True)):
        return False
    import mlx.core as mx

    for c, o, (first, _, _), (second, _, _) in zip(caches, others, mine, theirs, strict=True):
        idx, size, _ = _padded_sides(c, o)
        rows = c.keys.shape[0]
        arrays = []
        for mine_array, their_array in ((c.keys, o.keys), (c.values, o.values)):
            shape = (rows + their_array.shape[0], mine_array.shape[1], size,
                     mine_array.shape[3])
            joined = mx.zeros(shape, dtype=mine_array.dtype)
            for part, layer, start in ((mine_array, c, 0), (their_array, o, rows)):
                left = idx - layer._idx
                part = part[..., : size - left, :]
                joined[start:start + part.shape[0], :, left:left + part.shape[2], :] = part
            arrays.append(joined)
        c.keys, c.values = arrays
        c.offset = mx.concatenate([c.offset, o.offset])
        c.left_padding = mx.array([p + idx - c._idx for p in first]
                                  + [p + idx - o._idx for p in second],
                                  dtype=c.left_padding.dtype)
        c._idx = idx
    return True


def layers_evaluated_in_turn(caches: list) -> bool:
    """Where ``caches`` hold a large batch's KV (at least ``large_batch_bytes``): each
    layer's keys and values evaluated in turn, so that a copy of the batch made lazily
    (a join, a leave, a roll) frees each layer's old arrays before the next layer's new
    ones are made. Whether it evaluated them (each evaluation waits for the device)."""
    import mlx.core as mx

    if kv_bytes(caches) < large_batch_bytes(mx):
        return False
    for c in caches:
        arrays = [a for a in (getattr(c, "keys", None), getattr(c, "values", None))
                  if a is not None]
        if arrays:
            mx.eval(arrays)
    return True


def room_made(caches: list, tokens: int) -> bool:
    """Where ``caches`` hold a large batch's KV: each plain ``BatchKVCache`` layer without
    room for ``tokens`` more keys grown now as mlx-lm's ``update_and_fetch`` would grow it
    in the next pass (its keys cut to ``_idx`` where that is not a whole block, then
    enough blocks of its ``step`` concatenated on), and evaluated before the next layer
    grows. Whether any layer grew."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    short = [c for c in caches if type(c) is BatchKVCache and c.keys is not None
             and c._idx + tokens > c.keys.shape[2]]
    if not short or kv_bytes(caches) < large_batch_bytes(mx):
        return False
    for c in short:
        blocks = (c.step + tokens - 1) // c.step
        grown = []
        for array in (c.keys, c.values):
            if c._idx % c.step:
                array = array[..., : c._idx, :]
            rows, heads, _, dim = array.shape
            block = mx.zeros((rows, heads, blocks * c.step, dim), dtype=array.dtype)
            grown.append(mx.concatenate([array, block], axis=2))
        del array, block  # the old layer goes with its evaluation
        c.keys, c.values = grown
        mx.eval(grown)
    return True


@contextlib.contextmanager
def rows_aligned_by_slices(caches: list, tokens: Sequence[Sequence[int]]) -> Iterator[None]:
    """Around mlx-lm's ``PromptProcessingBatch.prompt`` of ``tokens`` (one list a row):
    where the rows' chunks differ in length, each plain ``BatchKVCache`` layer's
    ``finalize`` rolls its rows by ``rolled_rows``.

    Why: mlx-lm pads the shorter chunks on the right, and after the prefill its
    ``finalize`` rolls each row by its padding so that all rows end together
    (``dynamic_roll``: ``take_along_axis`` over the whole cache, with an index array of
    the cache's own size). Sessions that share a cached system prompt join a prompt
    batch together, each with its own user turn, so every such batch is rolled
    whole. The same roll as runs of rows copied by slices, the same values: 8 rows of
    12.5k tokens on an H100 in 18 ms against 575 (bench/batch_copies.py), and the step
    where eight sessions' user turns joined after a shared 12k system prompt took 378
    ms against 930 (docs/performance.md); 3.6x faster on this repo's CPU (8 rows of
    2k)."""
    lengths = [len(t) for t in tokens]
    shifts = [max(lengths, default=0) - n for n in lengths]
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    plain = [c for c in caches if type(c) is BatchKVCache] if any(shifts) else []
    in_turn = bool(plain) and kv_bytes(caches) >= large_batch_bytes(mx)
    for c in plain:
        c.finalize = functools.partial(_finalize_rolled, c, shifts, in_turn)
    try:
        yield
    finally:
        for c in plain:
            c.__dict__.pop("finalize", None)


def _finalize_rolled(cache: Any, shifts: list[int], in_turn: bool) -> None:
    """mlx-lm's ``BatchKVCache.finalize`` with its rows rolled by ``rolled_rows``; the
    layer's rolled rows evaluated at once where ``in_turn`` (a large batch,
    ``layers_evaluated_in_turn``), mlx-lm finalizing its layers one after another."""
    padding = cache._right_padding
    if padding is None:
        return
    import mlx.core as mx

    if cache.keys is not None:
        cache.keys = rolled_rows(mx, cache.keys, shifts)
        cache.values = rolled_rows(mx, cache.values, shifts)
        if in_turn:
            mx.eval(cache.keys, cache.values)
    cache.offset = cache.offset - padding
    cache.left_padding += padding
    cache._right_padding = None


def rolled_rows(mx, array, shifts: list[int]):
    """Each row of ``array`` (rows, heads, positions, dim) rolled along its positions by
    its shift, as mlx-lm's ``dynamic_roll`` rolls them: one new array, each run of
    consecutive rows with one shift written into it by two slices."""
    n = array.shape[2]
    out = mx.zeros(array.shape, dtype=array.dtype)
    start = 0
    for row in range(1, len(shifts) + 1):
        if row < len(shifts) and shifts[row] == shifts[start]:
            continue
        shift = shifts[start] % n
        if shift:
            out[start:row, :, shift:] = array[start:row, :, : n - shift]
            out[start:row, :, :shift] = array[start:row, :, n - shift:]
        else:
            out[start:row] = array[start:row]
        start = row
    return out
