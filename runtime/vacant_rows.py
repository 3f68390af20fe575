"""Vacant rows: a large decoding batch keeps a leaving row's place for a joining one, so neither copies the batch.

Owns ``RowReuse`` (the setting and one batch's vacant rows) and what the generation
batch (``runtime.mlx_lm_batches.RowAwareGenerationBatch``) calls: ``vacate`` where
mlx-lm would filter leaving rows out, ``fill`` where it would concatenate a joining
batch's rows on (``margin_for_longer`` before a join that copies anyway),
``age_vacant`` once a step, and ``kept_rows`` before a filter that copies anyway. ``install_row_reuse`` gives a generator's decoding batch its
``RowReuse``. Receives the batches; emits nothing.

Why: mlx-lm keeps a decoding batch's KV cache in one array per layer for keys and
one for values, and copies all of them whenever a row leaves (``filter``) or joins
(``extend``). Coding agents' sessions leave the batch at the end of every turn and
join it again a moment later: sixteen sessions of 14k tokens on an H100 spent 45 %
of their decode steps' time in the steps that made those copies, 100-150 ms each
against a 14 ms step (27 GB copied; docs/performance.md).

How: a row that leaves a batch holding at least ``RowReuse.min_bytes`` of KV stays
in it, vacant: a negative uid, no sampler, processors or stop sequences of its own,
no limit on its tokens, its responses dropped. It decodes along (one more row's
step, no copy) for at most ``RowReuse.steps`` steps. A joining row that is no longer
than the batch's keys (``_idx``) is written into a vacant row's place, right-aligned
as mlx-lm's ``extend`` aligns it, its left padding and offset set on the host; the
rest of the row's old keys lie in its new padding, masked. A row longer than the
batch's keys joins as in mlx-lm, by a copy, and that copy leaves every row
``JOIN_MARGIN`` positions of room on the left for the next. A vacant row left too
long, or one in a batch that is copied anyway, is filtered out as mlx-lm does. Only
plain ``BatchKVCache`` layers take part; every other batch filters and extends as
mlx-lm does.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

from runtime.held_prefix import held_prefix
from runtime.mlx_environment import kv_bytes

# The per-row lists of mlx-lm's ``GenerationBatch`` a vacant row resets and a joining
# row takes over; a batch without all of them, one entry a row, filters and extends
# as mlx-lm does (``_rows_listed``; docs/upgrading-mlx-lm.md).
ROW_LISTS = ("uids", "tokens", "samplers", "logits_processors", "max_tokens",
             "stop_sequences", "_token_context", "_num_tokens", "_matchers")


class RowReuse:
    """One decoding batch's vacant rows and the setting they follow.

    ``steps``: how many steps a vacant row waits for a joining one (0: rows leave at
    once, as in mlx-lm). ``min_bytes``: batches holding less KV filter and extend as
    mlx-lm does (a copy of a small batch costs less than a row decoding for nothing).
    Vacant rows do not count towards the generator's ``completion_batch_size``
    (``runtime.engine_generator``), so they hold no prompt back."""

    def __init__(self, steps: int, min_bytes: int):
        self.steps, self.min_bytes = steps, min_bytes
        self.vacant: dict[int, int] = {}  # row index -> steps since it was vacated
        self.vacated = 0  # rows vacated, and rows filled, since the batch was made
        self.filled = 0

    def fresh(self) -> RowReuse:
        """The same setting for another batch (a new decode lane)."""
        return RowReuse(self.steps, self.min_bytes)


# Vacant rows' uids: negative (mlx-lm's count up from 0), each used once in the
# process, so that no two rows of a generator's lanes share one.
_vacant_uids = itertools.count(-1, -1)


def _plain(caches: list) -> bool:
    from mlx_lm.models.cache import BatchKVCache

    return bool(caches) and all(type(c) is BatchKVCache and c.keys is not None for c in caches)


def _rows_listed(batch: Any) -> bool:
    """Whether ``batch`` has every per-row list, one entry a row (an mlx-lm that
    changed them makes every batch filter and extend as mlx-lm does)."""
    rows = len(batch.uids)
    return all(len(getattr(batch, name, ())) == rows for name in ROW_LISTS)


def vacate(batch: Any, keep: list[int]) -> bool:
    """Instead of ``batch.filter(keep)``: the rows not in ``keep`` stay, vacant. Whether
    it did (if not, the caller filters)."""
    reuse: RowReuse | None = getattr(batch, "row_reuse", None)
    if reuse is None or reuse.steps <= 0:
        return False
    rows = len(batch.uids)
    kept = set(keep)
    leaving = [i for i in range(rows) if i not in kept and i not in reuse.vacant]
    if not leaving or not any(i not in reuse.vacant for i in keep):
        return False  # nothing leaves, or nothing real stays (the batch empties)
    if len(reuse.vacant) + len(leaving) > rows // 2:
        return False
    caches = batch.prompt_cache
    if not _plain(caches) or kv_bytes(caches) < reuse.min_bytes or not _rows_listed(batch):
        return False
    # mlx-lm's filter trims the padding every row shares; a vacated row trims nothing.
    # Past twice the room a longer row's join leaves, the rows that stay are filtered
    # (one copy, the padding trimmed) rather than read through it at every step.
    paddings = caches[0].left_padding.tolist()  # made on the host (joins, filters, fills)
    if min(paddings[i] for i in keep if i not in reuse.vacant) > 2 * JOIN_MARGIN:
        return False
    from mlx_lm.generate import StopSequences

    for i in leaving:
        batch.uids[i] = next(_vacant_uids)
        batch.tokens[i] = []
        batch.samplers[i] = None
        batch.logits_processors[i] = []
        batch.max_tokens[i] = sys.maxsize
        batch.stop_sequences[i] = StopSequences()
        batch._matchers[i] = batch.stop_sequences[i].matcher()
        batch._num_tokens[i] = 0
        reuse.vacant[i] = 0
    reuse.vacated += len(leaving)
    return True


def kept_rows(batch: Any, keep: list[int]) -> list[int]:
    """``keep`` without the vacant rows, before a filter that copies the batch anyway
    (the vacant rows go with it)."""
    reuse: RowReuse | None = getattr(batch, "row_reuse", None)
    if reuse is None or not reuse.vacant:
        return keep
    keep = [i for i in keep if i not in reuse.vacant]
    reuse.vacant.clear()
    return keep


def age_vacant(batch: Any) -> list[int] | None:
    """Once a step, before it: every vacant row a step older. Where one has waited
    ``steps`` steps (or no row is left but vacant ones), the rows that are not vacant:
    the caller filters the batch to them. Else None."""
    reuse: RowReuse | None = getattr(batch, "row_reuse", None)
    if reuse is None or not reuse.vacant:
        return None
    for i in reuse.vacant:
        reuse.vacant[i] += 1
    if len(reuse.vacant) < len(batch.uids) and max(reuse.vacant.values()) < reuse.steps:
        return None
    # One filter copies the batch: every vacant row goes with it.
    return [i for i in range(len(batch.uids)) if i not in reuse.vacant]


def joined_vacant(batch: Any, joining: Any, offset: int) -> None:
    """After an ``extend`` that appended ``joining``'s rows at ``offset``: its vacant rows
    are ``batch``'s (a decode lane moving up into the first)."""
    theirs: RowReuse | None = getattr(joining, "row_reuse", None)
    reuse: RowReuse | None = getattr(batch, "row_reuse", None)
    if theirs is None or not theirs.vacant:
        return
    if reuse is None:
        batch.row_reuse = reuse = theirs.fresh()
    reuse.vacant.update({offset + i: age for i, age in theirs.vacant.items()})
    theirs.vacant.clear()


# Key positions of room a large batch keeps on the left when a longer row joins it
# (``margin_for_longer``): a later row up to this much longer than the batch's
# longest can still take a vacant place. An agent session's next turn is its last
# one plus a reply and a user turn or tool result, often the batch's new longest.
JOIN_MARGIN = 1024


def margin_for_longer(batch: Any, joining: Any) -> bool:
    """Before mlx-lm's ``extend`` of a large ``batch`` by a longer ``joining`` batch
    (which pads ``batch`` on the left, copying it, to the longer one's keys): the
    joining batch's layers padded on the left by ``JOIN_MARGIN`` first, so that the
    same copy leaves every row that much room. Whether it did."""
    reuse: RowReuse | None = getattr(batch, "row_reuse", None)
    caches, others = batch.prompt_cache, joining.prompt_cache
    if reuse is None or not len(batch.uids) or not (_plain(caches) and _plain(others)):
        return False
    if len(caches) != len(others) or kv_bytes(caches) < reuse.min_bytes:
        return False
    if not any(o._idx > c._idx for c, o in zip(caches, others, strict=True)):
        return False
    import mlx.core as mx

    for o in others:
        paddings = o.left_padding.tolist()  # made on the host as the prompt batch split
        o.keys = mx.pad(o.keys, [(0, 0), (0, 0), (JOIN_MARGIN, 0), (0, 0)])
        o.values = mx.pad(o.values, [(0, 0), (0, 0), (JOIN_MARGIN, 0), (0, 0)])
        o._idx += JOIN_MARGIN
        o.left_padding = mx.array([p + JOIN_MARGIN for p in paddings], dtype=o.left_padding.dtype)
    return True


def fill(batch: Any, joining: Any, mine: list, theirs: list) -> bool:
    """Instead of ``batch.extend(joining)``: ``joining``'s rows written into vacant rows
    of ``batch``. ``mine`` and ``theirs``: each side's ``layer_paddings``. Whether it did
    (if not, the caller extends)."""
    reuse: RowReuse | None = getattr(batch, "row_reuse", None)
    rows = len(joining.uids)
    if reuse is None or not rows or rows > len(reuse.vacant):
        return False
    if getattr(batch.model, "pending", False):  # a mixed step ran the next decode already
        return False
    caches, others = batch.prompt_cache, joining.prompt_cache
    if not (_plain(caches) and _plain(others)) or len(caches) != len(others):
        return False
    if len(mine) != len(caches) or len(theirs) != len(others):
        return False
    if not (_rows_listed(batch) and _rows_listed(joining)) \
            or getattr(batch, "_next_tokens", None) is None \
            or len(getattr(batch, "_next_logprobs", ())) != len(batch.uids) \
            or len(getattr(joining, "_next_logprobs", ())) != rows:
        return False
    for c, o, (_, idx, _), (paddings, their_idx, _) in zip(caches, others, mine, theirs,
                                                          strict=True):
        if (c.keys.dtype != o.keys.dtype or c.keys.shape[1::2] != o.keys.shape[1::2]
                or c.values.shape[1::2] != o.values.shape[1::2]):
            return False
        if any(their_idx - p > idx for p in paddings):
            return False
    import mlx.core as mx

    slots = sorted(reuse.vacant)[:rows]
    for c, o, (paddings, idx, _), (their_paddings, their_idx, _) in zip(
            caches, others, mine, theirs, strict=True):
        paddings = list(paddings)
        for j, s in enumerate(slots):
            start = idx - (their_idx - their_paddings[j])
            c.keys[s:s + 1, :, start:idx, :] = o.keys[j:j + 1, :, their_paddings[j]:their_idx, :]
            c.values[s:s + 1, :, start:idx, :] = o.values[j:j + 1, :, their_paddings[j]:their_idx, :]
            paddings[s] = start
        # Made on the host, as every generation batch's paddings are (joined_paddings);
        # a BatchKVCache row's offset is its tokens: _idx less its left padding, plus a
        # prefix the layer holds once for its rows (runtime.held_prefix).
        held = held_prefix(c)
        shared = held[0].shape[2] if held is not None else 0
        c.left_padding = mx.array(paddings, dtype=c.left_padding.dtype)
        c.offset = mx.array([idx - p + shared for p in paddings], dtype=c.offset.dtype)
    for j, s in enumerate(slots):
        for name in ROW_LISTS:
            getattr(batch, name)[s] = getattr(joining, name)[j]
        batch._next_logprobs[s] = joining._next_logprobs[j]
        del reuse.vacant[s]
    at = mx.array(slots)
    batch._next_tokens[at] = joining._next_tokens
    if getattr(batch, "_current_tokens", None) is not None \
            and getattr(joining, "_current_tokens", None) is not None:
        batch._current_tokens[at] = joining._current_tokens
    reuse.filled += rows
    return True


def install_row_reuse(generator: Any, steps: int, min_bytes: int) -> bool:
    """Give ``generator``'s decoding batch (its first lane, where it has lanes) a
    ``RowReuse``; new lanes take the same setting. ``steps`` 0: none. Returns whether
    it did."""
    if steps <= 0:
        return False
    batch = generator._generation_batch
    first = batch.lanes[0] if hasattr(batch, "lanes") else batch
    first.row_reuse = RowReuse(steps, min_bytes)
    return True


def vacant_count(batch: Any) -> int:
    """How many of a generation batch's rows (all its lanes', where it has lanes) are
    vacant."""
    lanes = getattr(batch, "lanes", None) or ([batch] if batch is not None else [])
    return sum(len(reuse.vacant) for lane in lanes
               if (reuse := getattr(lane, "row_reuse", None)) is not None)
