"""PromptCachePolicy: the prompt cache's policy, its explanations and its statistics.

Not an actor: a sans-IO object with no task of its own, called synchronously
by the Scheduler (each step) and the Runtime (each request). The cache's data,
the KV arrays, stays with the engine (``runtime.prompt_cache_store``: mlx-lm's
``LRUPromptCache`` with a reuse floor), which looks entries up when a request
is admitted and stores them at segment ends and when a sequence finishes.
The policy decides the rest:

* an index of the engine's entries (tokens in a radix trie, bytes, segment
  type, the template arguments and conversation of the request that stored
  each), fed by the ``CacheEntryStored`` / ``CacheEntryRemoved`` events each
  ``StepOutputs`` carries;
* what to keep: the count limit (``--prompt-cache-size``) after every store,
  the byte limit (``--prompt-cache-bytes``) after every store and, shared with
  the running sequences, after every admission and every step, in mlx-lm's
  eviction order (``runtime.mlx_lm_internals.new_eviction_order``: one LRU per
  segment type, as ``LRUPromptCache`` evicts). The bytes are those the
  entries hold in memory: a span of KV that several entries lie in (a system
  prompt sixteen sessions share, ``CacheEntryStored.spans``) counts once, and
  evicting an entry frees only the spans no other entry uses. Evicted ids
  go back to the engine as one ``EvictCache`` command, applied between steps
  (distributed: on every rank alike);
* the explanation of each lookup (``PromptCacheOutlook``): predicted when a
  request is opened, from the index, for the response's header; and, when it
  starts, the reason it reused nothing (``SequenceStarted.miss_reason``, which
  the Detokenizer puts into ``Usage``). Evicted and lost entries are
  remembered (tokens only, bounded) to tell ``evicted`` from ``no_entry``;
* the statistics (``figures``, for ``/health`` and ``/metrics``), logged
  after a step at most every ``log_every`` seconds (30) when they changed.

Receives: synchronous calls from the Runtime (``open``, ``close``) and from
the Scheduler (``on_step``, ``engine_changed``). Returns: the entries to evict
(the Scheduler puts them into the engine's inbox as one ``EvictCache``), the
step's ``StepOutputs`` annotated, a ``PromptCacheOutlook`` per request, and
logs a line.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import attrs

from actors.prompt_cache_index import TokenTrie, Walk, tokens_array
from runtime.messages import (
    CacheEntryRemoved,
    CacheEntryStored,
    CacheMissReason,
    PromptCacheOutlook,
    StepOutputs,
)
from runtime.mlx_lm_internals import new_eviction_order
from runtime.token_runs import FIRST_SPAN_REACH

log = logging.getLogger(__name__)

# Evicted entries remembered (their tokens only), to explain misses: the most recent
# GHOST_ENTRIES of them within GHOST_TOKENS tokens. 4 bytes a token plus about 1.3 KB an
# entry for its index (measured: 6,990 entries of 150 tokens in 12.6 MB), so 1,024
# short entries take about 2 MB and a server's memory stops growing after as many
# evictions; long prompts are held to the token bound (about 4 MB).
GHOST_TOKENS = 1 << 20
GHOST_ENTRIES = 1024
CLOSED_KEPT = 1024  # requests closed before they started, still remembered


def predicted_reuse(walk: Walk, n: int, min_reuse: int) -> int:
    """The prompt tokens mlx-lm's lookup (and the engine's one-token back-off after
    an exact hit) reuses, given what the index shows for a prompt of ``n`` tokens."""
    if walk.depth == 0 or walk.depth < min_reuse:
        return 0
    if walk.exact is not None:
        return n - 1 if walk.exact and n > 1 else 0
    if walk.beyond and walk.depth > walk.prefix:
        return min(n - 1, walk.depth)
    return walk.prefix


def scoped(model: str, scope: str) -> str:
    """The index's key for a model's entries in one prompt-cache scope (``""``: shared)."""
    return f"{model}\x1f{scope}" if scope else model


@attrs.define
class _Entry:
    model: str
    nbytes: int  # its KV counted whole, as if it shared nothing
    cache_type: str
    template_key: str | None
    conversation_key: str | None
    spans: tuple[tuple[int, int], ...] = ()  # CacheEntryStored.spans


@attrs.define
class _Span:
    """A run of KV that stored entries lie in (``CacheEntryStored.spans``)."""
    users: int  # the entries that lie in it
    nbytes: int
    end: int  # the token it ends at (0: not known)
    system: bool  # a system segment's entry made it


@attrs.define
class _Ghost:
    """An entry that is gone: why, and what the explanation compares."""

    reason: CacheMissReason
    ntokens: int
    template_key: str | None
    conversation_key: str | None


@attrs.define
class _Request:
    model: str
    tokens: tuple[int, ...]
    template_key: str | None
    conversation_keys: tuple[str, ...]
    predicted: PromptCacheOutlook
    started: bool = False


@attrs.define
class PromptCacheStats:
    """Totals since the server started (``figures`` adds the index's size)."""

    hits: int = 0
    cached_tokens: int = 0  # prompt tokens the hits reused
    misses: collections.Counter = attrs.field(factory=collections.Counter)
    evictions: int = 0
    evicted_bytes: int = 0
    header_mismatches: int = 0  # the prediction at admission differed from the engine's lookup


class PromptCachePolicy:
    """Sans-IO: the index of the engine's entries, the keep/evict decisions, the explanations."""

    def __init__(
        self,
        *,
        max_entries: int,
        max_bytes: int | None = None,
        min_reuse: int = 0,
        ghost_tokens: int = GHOST_TOKENS,
        ghost_entries: int = GHOST_ENTRIES,
        log_every: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._configured_max_bytes = max_bytes  # None: the engine's default (device_budget)
        self.min_reuse = min_reuse
        self.model: str | None = None  # the engine whose entries the index holds
        # Held: a span several entries lie in counted once (the limits apply to it).
        self.bytes = 0
        self.entry_bytes = 0  # every entry counted whole, as mlx-lm would
        self._spans: dict[int, _Span] = {}
        # Spans freed in this step's events, kept to its end: an entry is reported after the
        # one it supersedes left, and lies in spans whose ends only that one's event told.
        self._freed_spans: dict[int, _Span] = {}
        self.stats = PromptCacheStats()
        self._live = TokenTrie()
        self._entries: dict[int, _Entry] = {}
        self._order = new_eviction_order()  # last use: when stored, per segment type
        self._by_conversation: dict[str, set[int]] = collections.defaultdict(set)
        self._ghost_limit = ghost_tokens
        self._ghost_entries = ghost_entries
        self._ghosts = TokenTrie()
        self._ghost_info: dict[int, _Ghost] = {}
        self._ghost_fifo: collections.deque[int] = collections.deque()
        self._ghost_tokens = 0
        self._next_ghost = 1
        self._ghosts_by_conversation: dict[str, set[int]] = collections.defaultdict(set)
        self._requests: dict[int, _Request] = {}
        self._closed: collections.deque[int] = collections.deque()
        self._log_every = log_every
        self._clock = clock
        self._logged_at = clock()
        self._logged = ""

    # ---------------------------------------------------------------- reading

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def remembered_requests(self) -> int:
        """Requests opened and not yet forgotten (ended, or closed and aged out)."""
        return len(self._requests)

    def entries(self) -> dict[int, tuple[tuple[int, ...], int, str]]:
        """The index: entry id -> (tokens, bytes, segment type)."""
        return {
            i: (tuple(self._live.tokens(i)), e.nbytes, e.cache_type)
            for i, e in self._entries.items()
        }

    def explain(
        self,
        model: str,
        tokens: tuple[int, ...],
        *,
        template_key: str | None = None,
        conversation_keys: tuple[str, ...] = (),
    ) -> PromptCacheOutlook:
        """What a lookup of ``tokens`` would reuse now, and if nothing, why."""
        if self.max_entries <= 0:
            return PromptCacheOutlook(reused_tokens=0, miss_reason=CacheMissReason.DISABLED)
        prompt = tokens_array(tokens)
        walk = self._live.walk(model, prompt)
        reused = predicted_reuse(walk, len(prompt), self.min_reuse)
        if reused and walk.exact is None and walk.beyond and walk.depth > walk.prefix:
            reused = self._at_first_span(walk.nearest, reused)
        if reused:
            return PromptCacheOutlook(
                reused_tokens=reused, miss_reason=None, shared_tokens=walk.depth
            )
        reason = self._miss_reason(model, prompt, walk, template_key, conversation_keys)
        return PromptCacheOutlook(reused_tokens=0, miss_reason=reason, shared_tokens=walk.depth)

    def _at_first_span(self, entry_id: int | None, reused: int) -> int:
        """What the engine's fetch reuses of a longer entry trimmed to ``reused`` tokens:
        where that is at most ``FIRST_SPAN_REACH`` tokens past the entry's first span, a
        stored system prompt, and does not end its second span, the span alone
        (``runtime.fetched_kv.at_first_span``: the few tokens after it are computed with
        the rest)."""
        entry = self._entries.get(entry_id) if entry_id is not None else None
        if entry is None or len(entry.spans) < 2:
            return reused
        first = self._spans[entry.spans[0][0]]
        second = self._spans[entry.spans[1][0]].end
        if first.system and first.end < reused <= first.end + FIRST_SPAN_REACH \
                and reused != second:
            return first.end
        return reused

    def _miss_reason(self, model, prompt, walk: Walk, template_key, conversation_keys):
        if template_key is not None:
            for key in conversation_keys:
                for i in self._by_conversation.get(key, ()):
                    if self._entries[i].template_key not in (None, template_key):
                        return CacheMissReason.TEMPLATE_ARGS
                for i in self._ghosts_by_conversation.get(key, ()):
                    if self._ghost_info[i].template_key not in (None, template_key):
                        return CacheMissReason.TEMPLATE_ARGS
        enough = max(self.min_reuse, 1)
        ghost = self._ghosts.walk(model, prompt)
        if ghost.depth >= enough and ghost.depth > walk.depth and ghost.nearest is not None:
            return self._ghost_info[ghost.nearest].reason
        if walk.depth >= enough:
            return CacheMissReason.NOT_REUSABLE
        return CacheMissReason.BELOW_FLOOR if walk.depth else CacheMissReason.NO_ENTRY

    def figures(self) -> dict:
        """The numbers ``/health`` shows under ``prompt_cache`` (and ``/metrics`` exports)."""
        s = self.stats
        return {
            "entries": len(self._entries),
            "bytes": self.bytes,
            "entry_bytes": self.entry_bytes,
            "hits": s.hits,
            "cached_tokens": s.cached_tokens,
            "misses": {reason.value: s.misses[reason] for reason in CacheMissReason},
            "evictions": s.evictions,
            "evicted_bytes": s.evicted_bytes,
            "header_mismatches": s.header_mismatches,
            "max_entries": self.max_entries,
            "max_bytes": self.max_bytes,
        }

    # --------------------------------------------------------------- requests

    def open(
        self,
        request_id: int,
        model: str,
        tokens: tuple[int, ...],
        *,
        template_key: str | None = None,
        conversation_keys: tuple[str, ...] = (),
        scope: str = "",
    ) -> PromptCacheOutlook:
        """A request is submitted: its predicted outlook; remembered until it ends.
        ``scope``: its prompt-cache partition (``Submit.cache_scope``), indexed apart."""
        model = scoped(model, scope)
        outlook = self.explain(
            model, tokens, template_key=template_key, conversation_keys=conversation_keys
        )
        self._requests[request_id] = _Request(
            model, tokens, template_key, conversation_keys, outlook
        )
        return outlook

    def close(self, request_id: int) -> None:
        """The request's Session left. One that never started (aborted while it
        waited, or about to start) is kept a while for a late ``SequenceStarted``."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.started:
            del self._requests[request_id]
            return
        self._closed.append(request_id)
        while len(self._closed) > CLOSED_KEPT:
            self._requests.pop(self._closed.popleft(), None)

    # ------------------------------------------------------------ the engine

    def engine_changed(self, model: str | None) -> None:
        """A new engine (empty cache), or none: every indexed entry is gone with the old one."""
        for entry_id in list(self._entries):
            self._remove(entry_id, ghost=CacheMissReason.ENGINE_RESTARTED)
        self._freed_spans.clear()
        self._order = new_eviction_order()
        self.model = model

    def device_budget(self, nbytes: int) -> None:
        """The byte limit an engine gives the cache by default (``ModelInfo``'s
        ``prompt_cache_budget``, 0: none), in force where none was configured."""
        if self._configured_max_bytes is None:
            self.max_bytes = nbytes or None

    def on_step(self, outputs: StepOutputs) -> tuple[StepOutputs, tuple[int, ...]]:
        """Account for one engine step; returns it with the miss reasons filled in,
        and the entries to evict (in order)."""
        evicted: list[int] = []
        started = []
        # Every lookup of this step happened before the trims below: explain them first.
        for event in outputs.started:
            reason = self._started(event.request_id, event.cached_tokens)
            started.append(attrs.evolve(event, miss_reason=reason) if reason else event)
        for event in outputs.started:
            if self.max_bytes is not None:  # the cache gives way to the running sequences
                evicted += self._evict_to(nbytes=self.max_bytes - event.batch_kv_bytes)
        for event in outputs.cache_events:
            if isinstance(event, CacheEntryStored):
                self._store(event)
                evicted += self._evict_to(entries=self.max_entries, nbytes=self.max_bytes)
            elif isinstance(event, CacheEntryRemoved) and event.entry_id in self._entries:
                self._remove(event.entry_id, ghost=None)
        if self.max_bytes is not None and outputs.stats.batch_kv_bytes:
            # Entries stored while the batch holds its KV caches give way to them too.
            evicted += self._evict_to(nbytes=self.max_bytes - outputs.stats.batch_kv_bytes)
        for request_id in outputs.terminal_ids():
            self._requests.pop(request_id, None)
        self._freed_spans.clear()
        if outputs.started:
            outputs = attrs.evolve(outputs, started=tuple(started))
        self._log_if_due()
        return outputs, tuple(evicted)

    def _started(self, request_id: int, cached: int) -> CacheMissReason | None:
        request = self._requests.get(request_id)
        reason = None
        if cached:
            self.stats.hits += 1
            self.stats.cached_tokens += cached
        elif request is None:  # closed long before it started: nothing left to compare
            reason = CacheMissReason.NO_ENTRY
            self.stats.misses[reason] += 1
        else:
            outlook = self.explain(
                request.model,
                request.tokens,
                template_key=request.template_key,
                conversation_keys=request.conversation_keys,
            )
            # No reason: the index saw a reusable entry that the engine could not use.
            reason = outlook.miss_reason or CacheMissReason.NOT_REUSABLE
            self.stats.misses[reason] += 1
        if request is not None:
            self.stats.header_mismatches += request.predicted.reused_tokens != cached
            request.started = True
            request.tokens = ()
        return reason

    def _store(self, event: CacheEntryStored) -> None:
        request = self._requests.get(event.request_id) if event.request_id is not None else None
        model = request.model if request is not None else self.model or ""
        conversation = None
        if request is not None and request.conversation_keys:
            conversation = request.conversation_keys[-1]
        self._entries[event.entry_id] = _Entry(
            model=model,
            nbytes=event.nbytes,
            cache_type=event.cache_type,
            template_key=request.template_key if request else None,
            conversation_key=conversation,
            spans=event.spans,
        )
        self._live.add(model, event.tokens, event.entry_id, event.trimmable)
        self._order.push(model, event.entry_id, event.cache_type)
        self.entry_bytes += event.nbytes
        if not event.spans:
            self.bytes += event.nbytes
        last = len(event.spans) - 1
        for i, (span_id, nbytes) in enumerate(event.spans):
            held = self._spans.get(span_id)
            if held is not None:
                held.users += 1
                continue
            if span_id in self._freed_spans:
                held = self._freed_spans.pop(span_id)
                held.users = 1
            elif i == last:  # new: it ends with the entry's tokens
                held = _Span(1, nbytes, len(event.tokens), event.cache_type == "system")
            else:
                held = _Span(1, nbytes, 0, False)
            self._spans[span_id] = held
            self.bytes += nbytes
        if conversation is not None:
            self._by_conversation[conversation].add(event.entry_id)

    def _evict_to(self, *, entries: int | None = None, nbytes: int | None = None) -> list[int]:
        """Evict in mlx-lm's order until at most ``entries`` entries and ``nbytes`` bytes remain."""
        evicted = []
        while self._entries and (
            (entries is not None and len(self._entries) > max(0, entries))
            or (nbytes is not None and self.bytes > max(0, nbytes))
        ):
            _, entry_id = self._order.pop()
            self._remove(entry_id, ghost=CacheMissReason.EVICTED, ordered=False)
            self.stats.evictions += 1
            evicted.append(entry_id)
        return evicted

    def _remove(
        self, entry_id: int, *, ghost: CacheMissReason | None, ordered: bool = True
    ) -> None:
        entry = self._entries.pop(entry_id)
        if ordered:
            self._order.remove(entry.model, entry_id)
        model, tokens = self._live.remove(entry_id)
        self.entry_bytes -= entry.nbytes
        freed = 0 if entry.spans else entry.nbytes
        for span_id, _ in entry.spans:
            held = self._spans[span_id]
            held.users -= 1
            if not held.users:
                freed += held.nbytes
                self._freed_spans[span_id] = self._spans.pop(span_id)
        self.bytes -= freed
        if ghost is CacheMissReason.EVICTED:
            self.stats.evicted_bytes += freed
        if entry.conversation_key is not None:
            keep = self._by_conversation[entry.conversation_key]
            keep.discard(entry_id)
            if not keep:
                del self._by_conversation[entry.conversation_key]
        if ghost is not None:
            info = _Ghost(ghost, len(tokens), entry.template_key, entry.conversation_key)
            self._remember(model, tokens, info)

    def _remember(self, model: str, tokens, ghost: _Ghost) -> None:
        """Keep a gone entry's tokens (oldest forgotten first, within ``ghost_tokens``
        and ``ghost_entries``)."""
        if ghost.ntokens > self._ghost_limit or self._ghost_entries < 1:
            return
        ghost_id = self._next_ghost
        self._next_ghost += 1
        self._ghosts.add(model, tokens, ghost_id, True)
        self._ghost_info[ghost_id] = ghost
        self._ghost_fifo.append(ghost_id)
        self._ghost_tokens += ghost.ntokens
        if ghost.conversation_key is not None:
            self._ghosts_by_conversation[ghost.conversation_key].add(ghost_id)
        while self._ghost_tokens > self._ghost_limit or len(self._ghost_fifo) > self._ghost_entries:
            old = self._ghost_fifo.popleft()
            self._ghosts.remove(old)
            info = self._ghost_info.pop(old)
            self._ghost_tokens -= info.ntokens
            if info.conversation_key is not None:
                keep = self._ghosts_by_conversation[info.conversation_key]
                keep.discard(old)
                if not keep:
                    del self._ghosts_by_conversation[info.conversation_key]

    def log_line(self) -> str:
        s = self.stats
        misses = ", ".join(f"{r} {n}" for r, n in sorted(s.misses.items()) if n) or "none"
        return (
            f"prompt cache: {len(self._entries)} entries, {self.bytes / 1e6:.1f} MB, "
            f"{s.hits} hits ({s.cached_tokens} tokens reused), misses: {misses}, "
            f"{s.evictions} evicted"
        )

    def _log_if_due(self) -> None:
        """The statistics' line, at most every ``log_every`` seconds, when it changed."""
        now = self._clock()
        if now - self._logged_at < self._log_every:
            return
        line = self.log_line()
        if line != self._logged:
            log.info(line)
            self._logged = line
        self._logged_at = now
