"""A fetched prompt-cache entry's KV layers, made from the spans its reused prefix reaches.

``runtime.prompt_cache_store`` stores an entry of plain ``KVCache`` layers as a chain
of ``SharedSpan``s; mlx-lm's fetch deep-copies the entry's layers and then trims the
copy to the prefix it reuses. Here that deep copy is a ``FetchedKVLayer``, whose
arrays are made when first read, after the trim, from the spans the prefix reaches;
``at_first_span`` trims a fetch that reaches a few tokens past its entry's first span
back to that span, so that its layers are views of it.

Receives a fetch's layers, tokens and rest; emits the layers and rest to prefill.
Runs on the engine's thread, like every MLX array it touches.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from runtime.token_runs import FIRST_SPAN_REACH


class FetchedKVLayer(KVCache):
    """A fetched entry's layer (``SharedKVLayer``'s deep copy): a plain ``KVCache`` whose
    arrays are made from the entry's spans when first read, after mlx-lm has trimmed
    the fetch to the prefix it reuses, and from the spans that prefix reaches only:
    one span's arrays as they are (views), several concatenated.

    A new session's first turn reuses the system prompt of another session's
    longer entry, trimmed: mlx-lm deep-copies the whole entry first (eight sessions
    starting from one 12k-token system prompt copied 11 GB at admission, 25 ms of an
    H200's time, for arrays a prompt batch copies in again). A view is safe: an MLX
    array changes by value (a write into this layer, ``update_and_fetch``, makes a new
    array of its object), and MLX writes a buffer in place only when nothing else
    holds it."""

    def __init__(self, spans: list, layer: int):
        """``spans``: the entry's chain of ``SharedSpan``s, first to last."""
        super().__init__()
        self._spans, self._layer = spans, layer
        self.offset = spans[-1].end

    def _made(self) -> None:
        spans = [s for s in self._spans if s.start < self.offset] or self._spans[:1]
        layer, self._spans = self._layer, None
        if len(spans) == 1:
            self._keys, self._values = spans[0].keys[layer][...], spans[0].values[layer][...]
        else:
            self._keys = mx.concatenate([s.keys[layer] for s in spans], axis=2)
            self._values = mx.concatenate([s.values[layer] for s in spans], axis=2)

    @property
    def keys(self):
        if self._spans is not None:
            self._made()
        return self._keys

    @keys.setter
    def keys(self, value) -> None:
        if getattr(self, "_spans", None) is not None:  # the other array made first, from the spans
            self._made()
        self._keys = value

    @property
    def values(self):
        if self._spans is not None:
            self._made()
        return self._values

    @values.setter
    def values(self, value) -> None:
        if getattr(self, "_spans", None) is not None:  # the other array made first, from the spans
            self._made()
        self._values = value

    def __deepcopy__(self, memo) -> KVCache:
        """A plain ``KVCache`` with copies of this layer's arrays (several choices of
        one prompt, each its own)."""
        cache = KVCache()
        cache.keys = copy.deepcopy(self.keys, memo)
        cache.values = copy.deepcopy(self.values, memo)
        cache.offset = self.offset
        return cache


def at_first_span(cache, tokens: list[int], rest: list[int]):
    """A fetch (``cache``, ``rest``) whose reused prefix ends at most
    ``FIRST_SPAN_REACH`` tokens past its entry's first span, a stored system
    segment (``SharedSpan.system``), trimmed to that span:
    its layers are then the span's arrays as views (``FetchedKVLayer``), where those
    few tokens more would have the span and the next one concatenated, a copy of the
    whole prefix. A chat template's opening of the user turn follows a stored system
    prompt in every session (``<|im_start|>user``), so a new session reuses the
    system prompt and those tokens from another session's entry; the tokens are
    recomputed with the user turn instead. A fetch whose first span is not a system
    segment (a session's own history: its earlier prompt, then its reply), that
    reuses its entry to the end of a span, or all of it (nothing left to prefill), is
    left as it is: a later turn reuses all it repeats."""
    if not cache or not rest or not all(
            type(c) is FetchedKVLayer and c._spans is not None for c in cache):
        return cache, rest
    spans = cache[0]._spans
    reused, first = len(tokens) - len(rest), spans[0].end
    if not spans[0].system or not first < reused <= first + FIRST_SPAN_REACH \
            or reused == spans[1].end:
        return cache, rest
    for c in cache:
        c.trim(reused - first)
    return cache, tokens[first:]
