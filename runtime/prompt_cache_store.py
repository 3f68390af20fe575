"""The engine's prompt cache: mlx-lm's ``LRUPromptCache`` with a reuse floor, and its ledger.

Owned by the engine (thread or process) like the rest of MLX: the KV arrays
are MLX arrays, which a lookup hands out as views or copies, trimmed. What to keep is not
decided here: the prompt-cache policy (``actors.prompt_cache``) keeps an index of
the entries from the events this module reports and sends ``EvictCache``
commands, which the engine applies between steps. So the store has no limits
of its own.

``PromptCacheStore``: ``LRUPromptCache`` without limits, with a reuse floor, and
with entries that share their common prefix's KV arrays.
``min_reuse_tokens``: a cached prefix shorter than this is not reused. A chat
template's opening tokens (``<|im_start|>user\\n``, a Llama header) are common
to almost every prompt, so without a floor nearly every request "hits" some
entry for a handful of tokens. mlx-lm then searches the whole trie below that
prefix for the shortest entry (about 1.5 ms a request with ten 250-token
entries, in pure Python), deep-copies that entry (hundreds of tokens in every
layer) and trims it, to skip a few tokens of prefill. With the floor, a walk
down the trie along the prompt (no copies, no subtree search) says how many
tokens any entry shares with it; below the floor the request is a miss at
once, at or above it mlx-lm's own fetch runs unchanged.

Shared prefixes. mlx-lm stores each entry as whole per-sequence KV arrays, so
sixteen agent sessions over one 20k-token system prompt hold sixteen copies of
its KV (about 2.6 GB each on an 8B model). Here an entry of plain ``KVCache``
layers is stored as a chain of ``SharedSpan``s (the KV of a run of tokens in
every layer, linked to the span before it): when a system or user segment is
stored, its end is remembered, and a later entry that repeats those tokens
links to that span and copies only what follows. A fetch gives a plain
``KVCache`` (``FetchedKVLayer``) made from the spans its reused prefix reaches,
when first read: where that is one span, its arrays as views, no copy.
Each ``CacheEntryStored`` names the spans its entry lies in (``entry_spans``),
so the prompt-cache policy counts a shared span once against
``--prompt-cache-bytes`` and knows what evicting an entry frees.

``CacheEntries``: the ledger ``EngineCore`` goes through. It gives every
stored entry an id, reports ``CacheEntryStored`` and ``CacheEntryRemoved``
(what mlx-lm's ``insert_cache`` drops by itself: an entry replaced by the same
tokens, or prefixes a longer trimmable entry covers), and removes entries by
id (``evict``). With a disk tier (``CacheEntries.disk``, ``--prompt-cache-dir``)
it tells it of every entry stored and of every entry it evicts, before the
arrays go. Ids are assigned in insertion order, so in a distributed
group, where every rank inserts the same entries in the same steps, every
rank gives the same ids and an ``EvictCache`` names the same entries on all.

Every entry is computed as it is stored: mlx-lm hands a sequence's KV cache
over lazily, as slices of the whole batch's arrays (``BatchKVCache.extract``),
and an unevaluated slice keeps the batch's arrays alive: stored as it comes,
each entry would hold a whole batch's KV cache (as it was at that step) while
counting only its own rows, until first used. The copies of all the entries a
step stores start together, in one ``mx.async_eval`` (``own_arrays``), when the
step's events are taken (or before any lookup or eviction): one pass of MLX's
evaluator per step instead of one per entry (at 64 rows these copies are the
largest part of what our engine adds to a step; docs/performance.md).
"""

from __future__ import annotations

import collections
import sys
import weakref
from collections.abc import Iterable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, LRUPromptCache, can_trim_prompt_cache

from runtime.fetched_kv import FetchedKVLayer, at_first_span
from runtime.held_prefix import row_span
from runtime.messages import CacheEntryRemoved, CacheEntryStored, CacheEvent
from runtime.mlx_lm_internals import (
    prompt_cache_entry,
    prompt_cache_has_entry,
    remove_prompt_cache_entry,
    shared_prefix_length,
    use_prompt_trie,
)
from runtime.prompt_trie import RadixPromptTrie
from runtime.token_runs import tokens_array

NO_LIMIT = sys.maxsize
# Segment ends at least this long are remembered for other entries to share.
MIN_SHARED_TOKENS = 256
# The segment types whose ends other entries may share (a system prompt; a conversation).
SHARED_TYPES = ("system", "user")


def _end_forgetter(ends: RadixPromptTrie, model: Any, tokens: list[int]):
    """A weak reference's callback that takes the end registered for ``tokens`` out of
    ``ends`` when its span goes (the entries that used it went): a session that ended
    leaves nothing behind. Only that registration: the same tokens may have ended a
    newer span since."""
    lasting, key = weakref.ref(ends), tokens_array(tokens)

    def forget(ref: weakref.ref) -> None:
        trie = lasting()
        if trie is not None and trie.value(model, key) is ref:
            trie.pop(model, key)

    return forget


class SharedSpan:
    """The KV of tokens ``[start, end)`` in every layer (``keys[i]``, ``values[i]``: the
    layer's arrays, batch 1), after the span ``prev`` (None: it starts at 0);
    ``system``: stored as a system segment's entry; ``span_id``: its number in the
    store (insertion order); ``nbytes``: its arrays' bytes."""

    __slots__ = ("keys", "values", "start", "end", "prev", "system", "span_id", "nbytes",
                 "__weakref__")

    def __init__(self, keys: list, values: list, start: int, end: int, prev: SharedSpan | None,
                 system: bool = False, span_id: int = 0):
        self.keys, self.values = keys, values
        self.start, self.end, self.prev, self.system = start, end, prev, system
        self.span_id = span_id
        self.nbytes = sum(int(a.nbytes) for a in keys) + sum(int(a.nbytes) for a in values)

    def chain(self) -> list[SharedSpan]:
        spans, span = [], self
        while span is not None:
            spans.append(span)
            span = span.prev
        return spans[::-1]


class SharedKVLayer:
    """One layer of a stored entry whose KV lies in a chain of ``SharedSpan``s.

    Lives only inside the store: ``copy.deepcopy`` (what a fetch does) gives a
    plain ``KVCache`` of the whole chain. ``nbytes`` is what the layer it was
    made from counted, as if unshared; ``state`` is this entry's own span, the
    arrays its store computes."""

    __slots__ = ("span", "layer", "nbytes")

    def __init__(self, span: SharedSpan, layer: int, nbytes: int):
        self.span, self.layer, self.nbytes = span, layer, nbytes

    @property
    def offset(self) -> int:
        return self.span.end

    @property
    def state(self) -> tuple:
        return self.span.keys[self.layer], self.span.values[self.layer]

    def is_trimmable(self) -> bool:
        return True

    def __deepcopy__(self, memo) -> KVCache:
        return FetchedKVLayer(self.span.chain(), self.layer)


class PromptCacheStore(LRUPromptCache):
    """``LRUPromptCache`` that does not reuse prefixes shorter than ``min_reuse_tokens``
    and stores entries of plain ``KVCache`` layers as shared spans.

    Its limits default to none: the prompt-cache policy decides what to evict."""

    def __init__(
        self, max_size: int = NO_LIMIT, max_bytes: int = NO_LIMIT, *, min_reuse_tokens: int = 0
    ):
        super().__init__(max_size=max_size, max_bytes=max_bytes)
        use_prompt_trie(self, RadixPromptTrie())  # a few objects an entry, not one a token
        self.min_reuse_tokens = min_reuse_tokens
        # tokens[:end] -> the span ending there (a weak reference: alive while an entry
        # uses it); a radix trie, so that finding the longest that a new entry repeats
        # is one walk along it, however many sessions left their segments' ends.
        self._shared_ends = RadixPromptTrie()
        self._next_span_id = 1

    def insert_cache(
        self, model: Any, tokens: list[int], prompt_cache: list, *, cache_type: str = "assistant"
    ) -> list:
        """Store an entry (shared spans where it can); the layers stored."""
        layers = self._as_spans(model, tokens, prompt_cache, cache_type)
        super().insert_cache(model, tokens, layers, cache_type=cache_type)
        return layers

    def _as_spans(self, model: Any, tokens: list[int], cache: list, cache_type: str) -> list:
        n = len(tokens)
        if not cache or not all(
            type(layer) is KVCache and layer.keys is not None and layer.offset == n
            for layer in cache
        ):
            return cache
        ends = self._shared_ends
        before = None
        for end, ref in reversed(ends.prefix_values(model, tokens)):
            before = ref()
            if before is not None:
                break
            ends.pop(model, tokens[:end])  # no entry uses it any more
        start = before.end if before is not None else 0
        if start == n:
            last = before
        else:
            read = [row_span(layer, start, n) for layer in cache]
            last = SharedSpan(
                [mx.contiguous(keys) for keys, _ in read],
                [mx.contiguous(values) for _, values in read],
                start, n, before, system=cache_type == "system", span_id=self._next_span_id,
            )
            self._next_span_id += 1
        if cache_type in SHARED_TYPES and n >= MIN_SHARED_TOKENS:
            ends.add(model, tokens, weakref.ref(last, _end_forgetter(ends, model, tokens)))
        return [SharedKVLayer(last, i, layer.nbytes) for i, layer in enumerate(cache)]

    def shared_prefix(self, model: Any, tokens: list[int]) -> int:
        """How many leading ``tokens`` some cached entry shares: at most what a fetch reuses."""
        shared = shared_prefix_length(self, model, tokens)
        # Another mlx-lm layout (shared is None): no shortcut, let the fetch decide.
        return len(tokens) if shared is None else shared

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        if self.min_reuse_tokens > 0 and self.shared_prefix(model, tokens) < self.min_reuse_tokens:
            return None, tokens
        cache, rest = super().fetch_nearest_cache(model, tokens)
        return at_first_span(cache, tokens, rest)

    def has_entry(self, model: Any, tokens: list[int]) -> bool:
        return prompt_cache_has_entry(self, model, tokens)

    def stored_entry(self, model: Any, tokens: list[int]) -> tuple[list, str] | None:
        """The stored layers (not copies) and segment type of the entry for exactly
        ``tokens``, or None."""
        return prompt_cache_entry(self, model, tokens)

    def remove_entry(self, model: Any, tokens: list[int]) -> int | None:
        """Drop the entry for exactly ``tokens``; its bytes, or None if there was none."""
        return remove_prompt_cache_entry(self, model, tokens)


def entry_spans(layers: list | None) -> tuple[tuple[int, int], ...]:
    """The shared spans a stored entry's layers lie in, first to last, as ``(span_id,
    nbytes)``; () for an entry stored as whole arrays (it shares nothing)."""
    if not layers or type(layers[0]) is not SharedKVLayer:
        return ()
    return tuple((span.span_id, span.nbytes) for span in layers[0].span.chain())


def cache_arrays(cache: list) -> list:
    """The MLX arrays of a KV cache's layers (layers without ``state``, test doubles: none).

    A plain ``KVCache`` layer's state is its ``keys`` and ``values``, taken directly:
    ``tree_flatten`` of every layer's state was most of this function's time (32
    layers an entry, every finished sequence)."""
    arrays: list = []
    for layer in cache:
        if type(layer) is KVCache and layer.keys is not None:
            arrays += (layer.keys, layer.values)
        else:
            state = getattr(layer, "state", ())
            arrays += [leaf for _, leaf in tree_flatten(state) if isinstance(leaf, mx.array)]
    return arrays


def own_arrays(arrays: list) -> None:
    """Start computing KV cache arrays (``mx.async_eval``: nothing waits for them).

    A finished sequence's cache from mlx-lm's ``BatchGenerator`` is, per layer,
    ``contiguous(keys[row, :, start:end])`` of the batch's arrays, unevaluated
    (the bare engine drops it unused). Evaluated, it is a copy of its own rows
    and the batch's arrays of that step are freed as the batch moves on; left
    lazy, it holds them, and every stored entry pins another version of the
    whole batch's KV cache (tens of MB each on the CPU's test models, GBs at
    batch 64 on an 8B model) that no byte count sees. The copy is queued on
    the arrays' stream behind the step in flight, so the engine does not wait.
    ``arrays``: ``cache_arrays`` of one or more caches.
    """
    if arrays:
        mx.async_eval(arrays)


def _lasting(keys: list[tuple[int, ...]], caches: list[list]) -> list[bool]:
    """For entries stored in this order: whether each stays past the later ones (none
    of them has its tokens, and no trimmable one extends them, as mlx-lm's
    ``insert_cache`` then drops it)."""
    trimmable = [can_trim_prompt_cache(cache) for cache in caches]
    lasting = [True] * len(keys)
    for i, key in enumerate(keys):
        n = len(key)
        for j in range(i + 1, len(keys)):
            other = keys[j]
            if other == key or (
                trimmable[j] and n < len(other) and other[n - 1] == key[-1] and other[:n] == key
            ):
                lasting[i] = False
                break
    return lasting


class CacheEntries:
    """The engine's record of its prompt-cache entries, by id, and what changed.

    ``store`` is a ``PromptCacheStore`` (or a test double with the same
    methods: ``fetch_nearest_cache``, ``insert_cache``, ``has_entry``,
    ``remove_entry``, ``len`` and ``nbytes``)."""

    def __init__(self, store: Any, max_entries: int | None = None):
        self.store = store
        # The prompt-cache policy's count limit (None: not known here, every entry is stored).
        self.max_entries = max_entries
        self._next_id = 1
        self._keys: dict[int, tuple[Any, tuple[int, ...]]] = {}  # id -> (model, tokens)
        self._ids: dict[Any, dict[tuple[int, ...], int]] = {}  # model -> tokens -> id
        self._passed_over: set[int] = set()  # ids reported stored, never stored: doomed
        self._queued: list[tuple] = []  # inserts since the last lookup, eviction or step end
        self._events: list[CacheEvent] = []
        self._unowned: list = []  # arrays of entries stored since the last ``settle``
        # The disk tier (``runtime.engine.disk_tier.DiskTier``): told of entries stored
        # and evicted (None: memory only).
        self.disk: Any = None

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def passed_over(self) -> set[int]:
        """Ids reported stored but never stored, until their ``EvictCache`` comes."""
        return set(self._passed_over)

    def held(self) -> dict[int, tuple[Any, tuple[int, ...]]]:
        """The entries held now: id -> (model, tokens)."""
        return dict(self._keys)

    def settle(self) -> None:
        """Store what is queued, then start the copies of every entry stored since the
        last call, in one evaluation."""
        if self._queued:
            self._store_queued()
        if self._unowned:
            arrays, self._unowned = self._unowned, []
            own_arrays(arrays)

    def fetch(self, model: Any, tokens: list[int]):
        self.settle()
        return self.store.fetch_nearest_cache(model, tokens)

    def insert(
        self, model: Any, tokens: list[int], cache: list, *, cache_type: str, request_id: int | None
    ) -> None:
        """Store an entry: at once without a count limit, else queued until the next
        lookup, eviction or ``take_events`` (``_store_queued``)."""
        if self.max_entries is None:
            self._store(model, tokens, cache, cache_type, request_id, doomed=False)
        else:
            self._queued.append((model, tokens, cache, cache_type, request_id))

    def _store_queued(self) -> None:
        """Store the queued entries, in order, passing over those the count limit evicts
        before anything could look them up.

        The prompt-cache policy applies the count limit after every stored entry, in
        mlx-lm's order: one LRU per segment type, each oldest first. So of the entries
        of one type stored in a row, with no lookup between them, an entry followed
        by ``max_entries`` of its type that stay (none of the row replaces or
        supersedes them) cannot outlive the row: it is evicted when the actor
        takes the step's events. Such an entry (a wave of 64 finishing
        sequences, a cache of 10) is reported stored as before, so the actor's
        index, statistics and explanations are unchanged, and what it does to the
        store is done (the entries it replaces or supersedes go), but it is not
        stored: no copy of its KV arrays, no trie insert, no removal when the
        ``EvictCache`` that names it comes."""
        queued, self._queued = self._queued, []
        doomed = [False] * len(queued)
        types = collections.Counter(entry[3] for entry in queued)
        if any(n > self.max_entries for n in types.values()):
            # Only later entries that stay count: none replaces or supersedes them here.
            lasting = _lasting([tuple(e[1]) for e in queued], [e[2] for e in queued])
            later: collections.Counter[str] = collections.Counter()
            for i in range(len(queued) - 1, -1, -1):
                cache_type = queued[i][3]
                doomed[i] = later[cache_type] >= self.max_entries
                later[cache_type] += lasting[i]
        for entry, passed_over in zip(queued, doomed, strict=True):
            self._store(*entry, doomed=passed_over)

    def _store(
        self,
        model: Any,
        tokens: list[int],
        cache: list,
        cache_type: str,
        request_id: int | None,
        *,
        doomed: bool,
    ) -> None:
        key = tuple(tokens)
        by_tokens = self._ids.setdefault(model, {})
        replaced = by_tokens.pop(key, None)
        if replaced is not None:
            self._forget(replaced, keep_tokens=True)
            if doomed:  # its replacement would have been evicted: neither stays
                self.store.remove_entry(model, list(key))
            self._events.append(CacheEntryRemoved(entry_id=replaced, reason="replaced"))
        trimmable = can_trim_prompt_cache(cache)
        spans: tuple[tuple[int, int], ...] = ()
        if not doomed:
            stored = self.store.insert_cache(model, list(tokens), cache, cache_type=cache_type)
            spans = entry_spans(stored)
            self._unowned.extend(cache_arrays(stored if stored is not None else cache))
            if self.disk is not None:
                self.disk.kept(model, key, stored if stored is not None else cache, cache_type)
        if trimmable:  # mlx-lm drops the entries such a cache covers (its strict prefixes)
            for other, entry_id in list(by_tokens.items()):
                n = len(other)
                if 0 < n < len(key) and other[-1] == key[n - 1] and key[:n] == other:
                    if doomed:
                        self.store.remove_entry(model, list(other))
                    elif self.store.has_entry(model, list(other)):
                        continue
                    self._forget(entry_id)
                    self._events.append(CacheEntryRemoved(entry_id=entry_id, reason="superseded"))
        entry_id = self._next_id
        self._next_id += 1
        self._keys[entry_id] = (model, key)
        by_tokens[key] = entry_id
        if doomed:
            self._passed_over.add(entry_id)
        self._events.append(
            CacheEntryStored(
                entry_id=entry_id,
                request_id=request_id,
                tokens=key,
                nbytes=sum(int(layer.nbytes) for layer in cache),
                cache_type=cache_type,
                trimmable=trimmable,
                spans=spans,
            )
        )

    def evict(self, entry_ids: Iterable[int]) -> int:
        """Drop the entries still held under these ids; returns how many bytes that freed.

        An id already gone (replaced or superseded since) is skipped: the
        prompt-cache policy learns of that from the events."""
        self.settle()
        freed = 0
        for entry_id in entry_ids:
            key = self._keys.get(entry_id)
            if key is None:
                continue
            passed_over = entry_id in self._passed_over
            self._forget(entry_id)
            if not passed_over:
                stored = (self.store.stored_entry(key[0], list(key[1]))
                          if self.disk is not None else None)
                if stored is not None:
                    self.disk.evicting(key[0], key[1], *stored)
                freed += self.store.remove_entry(key[0], list(key[1])) or 0
        return freed

    def _forget(self, entry_id: int, *, keep_tokens: bool = False) -> None:
        """Drop ``entry_id`` from the ledger (``keep_tokens``: its tokens' slot is
        already taken by another id)."""
        model, tokens = self._keys.pop(entry_id)
        self._passed_over.discard(entry_id)
        if not keep_tokens:
            del self._ids[model][tokens]

    def take_events(self) -> tuple[CacheEvent, ...]:
        """What changed since the last call; the entries stored since then start their copies."""
        self.settle()
        events, self._events = tuple(self._events), []
        return events
