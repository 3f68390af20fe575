"""The engine's side of the prompt cache's disk tier: what goes to disk, what comes back.

``DiskTier`` wraps a ``runtime.prompt_cache_disk.DiskPromptCache`` for one
``EngineCore``. What it keeps: a system prompt's entry as it is stored in
memory (the prefix coding agents' sessions share), and any entry the memory
limits evict (a session that went quiet), when either covers at least
``MIN_TOKENS``. ``CacheEntries`` calls ``kept`` and ``evicting``; the arrays
are handed to the writer at the start of the next step (``flush``), when the
step that made them has been queued.

What comes back: before the core inserts a request (``hold``), the disk's
longest entry for its prompt is compared with what memory serves; if the disk
gives at least ``MIN_TOKENS`` more, the request waits outside the batch while
the reader reads the entry, and other requests for the same entry wait on the
same read. Each step the core takes the finished reads (``finished``), stores
each entry in memory as an ordinary prompt-cache entry, and inserts the waiting
requests the ordinary way: their lookup finds it. A read that fails removes
the entry from the folder, and its requests go on without it. A request goes
through at most one read (``loaded``), so an entry the memory cache could not
keep does not loop.

Receives ``Submit``s and prompt-cache entries (MLX arrays, on the engine
thread); emits the ``Submit``s back and the loaded KV caches.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

import attrs

from runtime.messages import Submit
from runtime.prompt_cache_disk import DiskEntry, DiskPromptCache

log = logging.getLogger(__name__)

MIN_TOKENS = 256  # the least an entry covers, and the least a read must add, to use the disk
POLL_SECONDS = 0.005  # how often an idle engine looks for finished reads


@attrs.define
class _Read:
    entry: DiskEntry
    future: concurrent.futures.Future
    waiting: list[Submit]


@attrs.frozen
class LoadedEntry:
    """A finished read: the entry's tokens and KV cache (None: the read failed), and
    the requests that waited for it."""

    entry: DiskEntry
    cache: list | None
    waiting: list[Submit]


def scope_of(cache_key: Any) -> str:
    """The prompt-cache scope in an ``EngineCore`` cache key (the model's, or (model, scope))."""
    return cache_key[1] if isinstance(cache_key, tuple) else ""


def entry_spans(layers: list) -> list[list[tuple[Any, Any]]] | None:
    """A stored entry's KV as spans of every layer's (keys, values), or None for a cache
    the disk does not take (only plain KV caches: ``SharedKVLayer`` chains, or
    ``KVCache`` layers holding exactly their tokens)."""
    from mlx_lm.models.cache import KVCache

    from runtime.prompt_cache_store import SharedKVLayer

    if not layers:
        return None
    if all(type(layer) is SharedKVLayer for layer in layers):
        chain = layers[0].span.chain()
        if any(layer.span is not layers[0].span for layer in layers):
            return None
        return [list(zip(span.keys, span.values, strict=True)) for span in chain]
    if all(type(layer) is KVCache and layer.keys is not None
           and layer.keys.shape[2] == layer.offset for layer in layers):
        return [[(layer.keys, layer.values) for layer in layers]]
    return None


class DiskTier:
    """What an engine core keeps on disk and reads back (see the module's docstring)."""

    def __init__(self, disk: DiskPromptCache, min_tokens: int = MIN_TOKENS):
        self.disk = disk
        self.min_tokens = min_tokens
        self._to_write: list[tuple[str, tuple[int, ...], list, str]] = []
        self._reads: dict[str, _Read] = {}
        self._loaded: set[int] = set()  # request ids that went through a read
        self.loads = 0  # entries read back
        self.load_tokens = 0  # the tokens they held
        self.load_failures = 0

    # --------------------------------------------------------- writing

    def kept(self, cache_key: Any, tokens: tuple[int, ...], layers: list, cache_type: str) -> None:
        """An entry was stored in memory: a long system prompt goes to disk too."""
        if cache_type == "system" and len(tokens) >= self.min_tokens:
            self._to_write.append((scope_of(cache_key), tokens, layers, cache_type))

    def evicting(self, cache_key: Any, tokens: tuple[int, ...], layers: list,
                 cache_type: str) -> None:
        """An entry leaves memory to keep its limits: a long one goes to disk."""
        if len(tokens) >= self.min_tokens:
            self._to_write.append((scope_of(cache_key), tokens, layers, cache_type))

    def flush(self) -> None:
        """Hand the entries noted since the last step to the writer."""
        to_write, self._to_write = self._to_write, []
        for scope, tokens, layers, cache_type in to_write:
            spans = entry_spans(layers)
            if spans is not None:
                self.disk.keep(scope, tokens, spans, cache_type=cache_type)

    def write_now(self, cache_key: Any, tokens: tuple[int, ...], layers: list,
                  cache_type: str) -> bool:
        """Write a long entry at once (as the engine stops); whether it was written."""
        spans = entry_spans(layers) if len(tokens) >= self.min_tokens else None
        return spans is not None and self.disk.write_now(
            scope_of(cache_key), tokens, spans, cache_type=cache_type)

    # --------------------------------------------------------- reading

    def hold(self, sub: Submit, cached_now: Callable[[], int]) -> bool:
        """Whether ``sub`` waits for a read: the disk serves at least ``min_tokens``
        more of its prompt than memory does (``cached_now()``)."""
        if sub.request_id in self._loaded:
            self._loaded.discard(sub.request_id)
            return False
        found = self.disk.longest(sub.cache_scope, sub.prompt)
        if found is None:
            return False
        entry, shared = found
        shared = min(shared, len(sub.prompt) - 1)  # the last token is always computed
        if shared < self.min_tokens or shared < cached_now() + self.min_tokens:
            return False
        read = self._reads.get(entry.name)
        if read is None:
            read = self._reads[entry.name] = _Read(entry, self.disk.load(entry), [])
        read.waiting.append(sub)
        return True

    def finished(self) -> list[LoadedEntry]:
        """The reads that have finished, their entries made KV caches (engine thread)."""
        done = [name for name, read in self._reads.items() if read.future.done()]
        out = []
        for name in done:
            read = self._reads.pop(name)
            self._loaded.update(s.request_id for s in read.waiting)
            cache = None
            try:
                cache = self.disk.as_cache(read.entry, read.future.result())
                self.loads += 1
                self.load_tokens += read.entry.n_tokens
            except Exception as exc:
                self.load_failures += 1
                log.warning("could not read prompt-cache entry %s from disk (%s: %s); "
                            "removing it", name, type(exc).__name__, exc)
                self.disk.forget(read.entry)
            out.append(LoadedEntry(read.entry, cache, read.waiting))
        return out

    def drop(self, request_id: int) -> list[int]:
        """Stop ``request_id`` waiting for a read; the request ids that ended (itself and
        its further choices), or none if it was not waiting."""
        for read in self._reads.values():
            for sub in read.waiting:
                if sub.request_id == request_id:
                    read.waiting.remove(sub)
                    return list(sub.request_ids)
        return []

    def request_ids(self) -> list[int]:
        return [r for read in self._reads.values() for s in read.waiting for r in s.request_ids]

    def clear(self) -> list[Submit]:
        """Forget the reads in flight; the requests that waited for them."""
        waiting = [s for read in self._reads.values() for s in read.waiting]
        for read in self._reads.values():
            read.future.cancel()
        self._reads.clear()
        self._loaded.update(s.request_id for s in waiting)
        return waiting

    def stats(self) -> dict[str, int]:
        """The ``EngineStats`` fields of the disk tier."""
        return {
            "prompt_cache_disk_entries": self.disk.entries,
            "prompt_cache_disk_bytes": self.disk.nbytes,
            "prompt_cache_disk_writes": self.disk.writes,
            "prompt_cache_disk_reads": self.loads,
            "prompt_cache_disk_read_tokens": self.load_tokens,
        }

    def __bool__(self) -> bool:
        return bool(self._reads)

    def close(self) -> None:
        self.clear()
        self._to_write.clear()
        self.disk.close()
