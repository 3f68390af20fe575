"""Decode lanes: sequences of very different lengths decode in batches of their own.

Owns ``DecodeLanes``, which ``install_decode_lanes`` puts in place of a
``BatchGenerator``'s generation batch, and ``choose_lane``, the rule that
places a sequence starting to decode. Receives the generator's calls on its
generation batch (``extend``, ``next``, ``filter``, ``extract_cache``, and the
rows' ``uids``, ``tokens`` and ``prompt_cache``); emits the lanes' responses,
as one batch would.

Why: mlx-lm's generation batch keeps its rows' KV caches in one array per
layer, each row left-padded to the longest, and a decode step attends over
the padding too. A 30,000-token sequence that joined 16 short streams on an
H200 made each of their steps 80 ms instead of 8, for as long as it decoded
(the padding also held 16 x 30,000 positions of KV memory); on the CPU, one
8,000-token sequence beside 16 short ones made a step 57 ms, against 11.5 and
3.9 ms for the two decoding apart and 15.6 as two lanes (``bench/decode_lanes.py``). Coding agents' sessions sit at every depth
from a fresh system prompt to a long conversation, beside short chat requests.

How: the rows decode in up to ``MAX_LANES`` batches ("lanes"), each an
ordinary generation batch with its own KV arrays, each stepped in turn within
the engine step (one forward pass each). A sequence that starts decoding joins
the lane whose padding it grows least (``added_padding``: rows times tokens of
padding, over the lane's rows and its own); when that exceeds
``padding_limit`` key positions, it opens a lane of its own instead, since a
pass costs about as much as attending over that much padding
(docs/performance.md). Lanes never merge: each empties as its rows finish,
and when the first lane (the one a step's prefill chunk shares its pass with,
``runtime.mixed_step``) empties, the next takes its place without a copy.
A generator whose caches are not all plain ``BatchKVCache`` layers keeps one
batch. Where lanes hold their sessions' shared prefix once (``runtime.held_prefix``),
rows that begin with a lane's prefix join that lane whatever the padding, and rows
that do not go to a lane holding none, so that a held prefix is not given back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

# At most this many lanes: every lane adds a forward pass to each engine step.
MAX_LANES = 4


def added_padding(lane_rows: int, lane_length: int, rows: int, length: int) -> int:
    """Key positions of padding that ``rows`` rows of ``length`` tokens and a lane of
    ``lane_rows`` rows ``lane_length`` long add by decoding as one batch."""
    longest = max(lane_length, length)
    return lane_rows * (longest - lane_length) + rows * (longest - length)


def choose_lane(lanes: Sequence[tuple[int, int]], rows: int, length: int, *,
                padding_limit: int, max_lanes: int = MAX_LANES) -> int | None:
    """The lane (an index into ``lanes``, each ``(rows, length)``) that ``rows`` rows
    of ``length`` tokens join, or None for a lane of their own.

    They join the lane whose padding they grow least, unless that adds more than
    ``padding_limit`` positions and fewer than ``max_lanes`` lanes are open.
    ``padding_limit`` 0: always one lane."""
    if not lanes:
        return None
    costs = [added_padding(lane_rows, lane_length, rows, length)
             for lane_rows, lane_length in lanes]
    best = min(range(len(lanes)), key=costs.__getitem__)
    if padding_limit <= 0 or costs[best] <= padding_limit or len(lanes) >= max_lanes:
        return best
    return None


def cache_length(caches: list) -> int | None:
    """The time axis of a batch's KV layers (its longest row with its padding), or None
    where a layer is not a plain ``BatchKVCache`` (those batches keep one lane)."""
    from mlx_lm.models.cache import BatchKVCache

    if not caches or not all(type(c) is BatchKVCache for c in caches):
        return None
    return int(caches[0]._idx)


class DecodeLanes:
    """A generator's generation batch as up to ``max_lanes`` batches (see the module's
    docstring). Rows are indexed across the lanes in order, as ``BatchGenerator``
    indexes one batch's rows (``uids``, ``tokens``, ``filter``, ``extract_cache``)."""

    def __init__(self, primary: Any, *, padding_limit: int, max_lanes: int = MAX_LANES):
        self.lanes: list[Any] = [primary]
        self.padding_limit = padding_limit
        self.max_lanes = max_lanes
        self.opened = 0  # lanes opened beside the first, in all (tests and the log)

    @property
    def primary(self) -> Any:
        """The first lane: never empty while another lane has rows."""
        return self.lanes[0]

    def __len__(self) -> int:
        return sum(len(lane) for lane in self.lanes)

    @property
    def uids(self) -> list[int]:
        return [uid for lane in self.lanes for uid in lane.uids]

    @property
    def tokens(self) -> list[list[int]]:
        return [tokens for lane in self.lanes for tokens in lane.tokens]

    @property
    def prompt_cache(self) -> list:
        """Every lane's KV layers (what they hold, for the generator's byte count)."""
        return [layer for lane in self.lanes for layer in lane.prompt_cache]

    @property
    def model(self) -> Any:
        return self.primary.model

    @model.setter
    def model(self, model: Any) -> None:
        for lane in self.lanes:
            lane.model = model

    @property
    def fallback_sampler(self) -> Any:
        return self.primary.fallback_sampler

    def extend(self, batch: Any) -> None:
        """Rows that start decoding (a generation batch), placed by ``choose_lane``."""
        length = cache_length(batch.prompt_cache)
        lengths = [cache_length(lane.prompt_cache) for lane in self.lanes]
        if not len(self.primary) or length is None or None in lengths:
            self.primary.extend(batch)
            return
        # A lane holding a prefix these rows begin with takes them: they join it without
        # that prefix, whatever the padding. Rows that do not begin with a lane's held
        # prefix would make it give the prefix back (a copy): they go elsewhere while
        # another lane may open (runtime.held_prefix).
        open_to = []
        for i, lane in enumerate(self.lanes):
            holding = getattr(lane, "prefix_holding", None)
            if holding is not None and holding.shares(batch.tokens):
                lane.extend(batch)
                return
            if holding is None or holding.tokens is None or self.padding_limit <= 0:
                open_to.append(i)
        chosen = choose_lane([(len(self.lanes[i]), lengths[i]) for i in open_to],
                             len(batch.uids), length, padding_limit=self.padding_limit,
                             max_lanes=self.max_lanes - len(self.lanes) + len(open_to))
        chosen = open_to[chosen] if chosen is not None else None
        if chosen is None and len(self.lanes) >= self.max_lanes:
            chosen = choose_lane([(len(lane), n) for lane, n in zip(self.lanes, lengths,
                                                                    strict=True)],
                                 len(batch.uids), length, padding_limit=0)
        if chosen is not None:
            self.lanes[chosen].extend(batch)
            return
        lane = type(self.primary).empty(self.primary.model, self.primary.fallback_sampler)
        reuse = getattr(self.primary, "row_reuse", None)  # runtime.vacant_rows
        if reuse is not None:
            lane.row_reuse = reuse.fresh()
        holding = getattr(self.primary, "prefix_holding", None)  # runtime.held_prefix
        if holding is not None:
            lane.prefix_holding = holding.fresh()
        lane.extend(batch)
        self.lanes.append(lane)
        self.opened += 1
        log.debug("a decode lane for %d rows of %d tokens beside %s", len(batch.uids),
                  length, [(len(lane), n) for lane, n in zip(self.lanes, lengths, strict=False)])

    def next(self) -> list:
        """One decode step of every lane, their responses together."""
        responses = []
        for lane in self.lanes:
            responses.extend(lane.next())
        self._settle()
        return responses

    def filter(self, keep: list[int]) -> None:
        """Keep the rows at ``keep`` (indices across the lanes)."""
        kept = set(keep)
        start = 0
        for lane, size in [(lane, len(lane)) for lane in self.lanes]:
            local = [i - start for i in range(start, start + size) if i in kept]
            if len(local) < size:
                lane.filter(local)
            start += size
        self._settle()

    def extract_cache(self, idx: int) -> list:
        for lane in self.lanes:
            if idx < len(lane):
                return lane.extract_cache(idx)
            idx -= len(lane)
        raise IndexError("no decoding row at that index")

    def _settle(self) -> None:
        """Drop empty lanes; an empty first lane takes the next one's rows (no copy)."""
        primary, others = self.lanes[0], [lane for lane in self.lanes[1:] if len(lane)]
        if not len(primary) and others:
            primary.extend(others.pop(0))
        self.lanes = [primary, *others]


def decoding_batch(generator: Any) -> Any:
    """The generation batch a step's prefill chunk may share its pass with: the first
    lane where there are lanes."""
    batch = generator._generation_batch
    return batch.primary if isinstance(batch, DecodeLanes) else batch


def lane_stats(generator: Any) -> dict[str, int]:
    """``EngineStats``' lane fields for ``generator``: the lanes decoding rows now, and the
    lanes opened beside the first since it was made (zeros without lanes)."""
    batch = getattr(generator, "_generation_batch", None)
    if not isinstance(batch, DecodeLanes):
        return {"decode_lanes": 0, "decode_lanes_opened": 0}
    return {"decode_lanes": sum(1 for lane in batch.lanes if len(lane)),
            "decode_lanes_opened": batch.opened}


def install_decode_lanes(generator: Any, padding_limit: int) -> bool:
    """Put ``DecodeLanes`` in place of a new, empty generator's generation batch (row
    hooks installed); ``padding_limit`` 0 leaves the one batch. Returns whether it did."""
    batch = generator._generation_batch
    if padding_limit <= 0 or len(batch) or isinstance(batch, DecodeLanes):
        return False
    generator._generation_batch = DecodeLanes(batch, padding_limit=padding_limit)
    return True
