"""Where the engine core's sequences take KV from the prompt cache and give it back.

``CacheHandoffs`` owns, for one ``EngineCore``: the prompt cache's ledger
(``runtime.prompt_cache_store.CacheEntries``, over the store the core is given),
the disk tier (``runtime.engine.disk_tier.DiskTier``, or None) and the floor
for keeping a prefill cut short. The core asks it for a request's cache key,
what the cache serves it now (``cached_now``), its lookup (``lookup``) and
whether it waits for a read from disk (``waits_for_disk``); it hands it a
sequence's KV at a segment end (``segment_end``), at its finish
(``finished``) and when it is aborted mid-prompt (``aborted``), and lets it
take the disk's finished reads at each step (``disk_step``); as the engine
stops, it writes the entries memory holds to disk (``spill``).

Receives ``SequenceRecord``s, ``Submit``s and KV caches (MLX arrays, on the
engine thread); emits the entries' events through the ledger and the aborted
prefills it keeps through the engine's counters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from runtime.engine.counters import EngineCounters
from runtime.engine.disk_tier import DiskTier
from runtime.engine.sequences import SequenceRecord, back_off_one_token
from runtime.messages import Submit
from runtime.prompt_cache_store import CacheEntries

log = logging.getLogger(__name__)

SPILL_SECONDS = 4.0  # how long a stopping engine writes its prompt cache's entries to disk


class CacheHandoffs:
    """The engine core's side of the prompt cache (see the module's docstring).

    ``store``: a ``PromptCacheStore`` (or a test double with its methods);
    ``max_entries``: the prompt-cache policy's count limit, for ``CacheEntries``;
    ``aborted_prefill_min_tokens`` (0: off): a sequence aborted while its prompt
    is prefilled, with at least that many of its uncached tokens computed, leaves
    them in the prompt cache; ``disk``: the disk tier (None: memory only)."""

    def __init__(
        self,
        store: Any,
        max_entries: int | None,
        model_key: Any,
        counters: EngineCounters,
        *,
        aborted_prefill_min_tokens: int = 0,
        disk: DiskTier | None = None,
    ):
        self.store = store
        self.entries = CacheEntries(store, max_entries)
        self.entries.disk = disk
        self.disk = disk
        self._model_key = model_key
        self._counters = counters
        self._aborted_floor = aborted_prefill_min_tokens

    def key(self, sub: Submit) -> Any:
        """The prompt cache's key for ``sub``'s entries: the model's, within its scope."""
        return (self._model_key, sub.cache_scope) if sub.cache_scope else self._model_key

    def cached_now(self, sub: Submit, tokens) -> int:
        """How many leading ``tokens`` the prompt cache could serve ``sub`` now."""
        self.entries.settle()  # entries queued in this step count
        shared_prefix = getattr(self.store, "shared_prefix", None)
        return shared_prefix(self.key(sub), list(tokens)) if shared_prefix else 0

    def lookup(self, sub: Submit, prompt: list[int]) -> tuple[list | None, list[int]]:
        """The nearest entry's KV cache for ``prompt`` (None: a miss), and the tokens it
        leaves to compute: at least the last one."""
        cache, rest = self.entries.fetch(self.key(sub), prompt)
        if cache is not None and not rest:
            # An exact hit leaves nothing to feed the model: give back one token.
            cache, rest = back_off_one_token(cache, prompt)
        return cache, rest

    def waits_for_disk(self, sub: Submit) -> bool:
        """Whether ``sub`` waits outside the batch for an entry read from disk."""
        return self.disk is not None and self.disk.hold(
            sub, lambda: self.cached_now(sub, sub.prompt)
        )

    def segment_end(self, seq: SequenceRecord, cache: list, tokens) -> None:
        """``seq``'s prompt reached the end of a segment: store its KV so far."""
        self.entries.insert(seq.cache_key, list(tokens), cache,
                            cache_type=seq.segment_types.pop(), request_id=seq.request_id)

    def finished(self, seq: SequenceRecord, response: Any) -> None:
        """``seq`` finished: store its prompt and reply (a generator's final response)."""
        if response.prompt_cache is not None and response.all_tokens is not None and seq.save_final:
            self.entries.insert(seq.cache_key, list(response.all_tokens), response.prompt_cache,
                                cache_type="assistant", request_id=seq.request_id)

    def aborted(self, batch: Any, seq: SequenceRecord, preempted: bool = False) -> None:
        """``seq`` is being aborted. Still in its prompt, with at least
        ``aborted_prefill_min_tokens`` tokens computed that the cache did not hold,
        its KV so far is stored: a client that timed out during a long prefill and
        sends the same request again (agents retry) resumes from there, and so do the
        requests that waited behind its prefix. ``preempted`` (the KV budget ran
        short; it resumes from its prompt and reply so far): whatever KV it holds
        once its prompt has begun, its reply's included, so that it resumes from it."""
        done, total = seq.prompt_progress
        if preempted:
            keep = done > 0
        else:
            floor = self._aborted_floor
            keep = floor and floor <= done < total
        if not keep or not seq.save_final:
            return
        extracted = batch.extract_cache([seq.uid]).get(seq.uid)
        if extracted is None:  # a generator that cannot hand it over (one at a time)
            return
        cache, tokens = extracted  # a decoding row's: its prompt and every token reported
        if done >= total:  # past its prompt: its reply
            cache_type = "assistant"
        else:  # the type of the segment it was in (segment_types is reversed)
            cache_type = seq.segment_types[-1] if seq.segment_types else "user"
        self.entries.insert(seq.cache_key, list(tokens), cache, cache_type=cache_type,
                            request_id=seq.request_id)
        if not preempted:
            self._counters.kept_aborted_prefill(done)

    def spill(self, seconds: float) -> int:
        """As the engine stops: write the entries memory holds to disk, the newest first,
        for at most ``seconds``, so that the sessions they hold outlive the restart.
        Returns how many were written."""
        if self.disk is None:
            return 0
        deadline = time.monotonic() + seconds
        written = 0
        for _, (model, tokens) in sorted(self.entries.held().items(), reverse=True):
            if time.monotonic() >= deadline:
                log.info("prompt cache: %.0f s passed; the older entries stay in memory", seconds)
                break
            stored = self.store.stored_entry(model, list(tokens))  # passed over: None
            try:
                written += stored is not None and self.disk.write_now(model, tokens, *stored)
            except Exception:  # the engine may be stopping because MLX failed
                log.warning("prompt cache: could not write entries to disk", exc_info=True)
                break
        return written

    def disk_step(self, submit: Callable[[Submit], None]) -> None:
        """The disk tier's part of a step: the entries noted for writing go to its
        writer; the entries read back are stored, and the requests that waited for
        them are inserted (``submit``: their lookup finds them)."""
        if self.disk is None:
            return
        self.disk.flush()
        for loaded in self.disk.finished():
            if loaded.cache is not None and loaded.waiting:
                self.entries.insert(self.key(loaded.waiting[0]), loaded.entry.tokens.tolist(),
                                    loaded.cache, cache_type=loaded.entry.cache_type,
                                    request_id=None)
            for sub in loaded.waiting:
                submit(sub)
