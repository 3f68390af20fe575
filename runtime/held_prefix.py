"""A decoding batch's KV layers holding the prefix that its rows share once.

Owns ``hold_prefix_once``: a decoding batch's mlx-lm ``BatchKVCache`` layers whose rows
all begin with the same ``length`` tokens in; each layer left holding those tokens' keys
and values once (``held_prefix``) and, per row, only what follows them. Emits nothing.
A layer so held answers mlx-lm's calls as it did: ``update_and_fetch``, ``make_mask``,
``filter`` and ``trim`` act on the rows' own keys (the prefix's positions count as each
row's left padding, so the mask hides them and RoPE's offsets stay each row's whole
length); ``extract`` gives a row's whole KV, the prefix first; ``extend`` takes only a
layer holding the same prefix. A decode step's attention over such a layer is
``runtime.shared_prefix_attention``'s, which ``decode_attention``
(``runtime.cuda_decode_attention``) gives it, on every backend.

Why: sixteen coding-agent sessions over one 24k-token system prompt hold it sixteen
times in a decoding batch (44 of about 50 GB on Qwen3-0.6B's shape), and each decode
step reads every copy. Held once, it is read once a step, and the batch holds what the
sessions do not share.
"""

from __future__ import annotations

import types
from typing import Any


def held_prefix(cache: Any) -> tuple[Any, Any] | None:
    """The keys and values ``(1, KV heads, prefix, head dim)`` that ``cache`` holds once
    for all its rows; None for a layer that holds none."""
    return getattr(cache, "held_prefix", None)


def hold_prefix_once(mx, caches: list, length: int) -> None:
    """Hold the first ``length`` keys and values of every row of each layer in ``caches``
    once: the rows must all begin with the same ``length`` tokens (the caller's check,
    by their tokens) and hold more than that. Each layer's arrays are copied down to the
    rows' own keys and evaluated before the next layer is, so that the batch is never
    held twice. Raises ValueError for a layer that is not a plain ``BatchKVCache`` with
    keys, that holds a prefix already, or whose rows are not all longer than ``length``.
    """
    from mlx_lm.models.cache import BatchKVCache

    if length <= 0:
        raise ValueError(f"a held prefix is at least one token, not {length}")
    for cache in caches:
        if type(cache) is not BatchKVCache or cache.keys is None:
            raise ValueError("only a BatchKVCache layer holding keys can hold a prefix once")
        if held_prefix(cache) is not None:
            raise ValueError("this layer holds a prefix once already")
        padding = cache.left_padding.tolist()
        if cache._idx - max(padding) <= length:
            raise ValueError(f"every row must hold more than the {length}-token prefix")
        first = padding.index(min(padding))
        start = padding[first]
        prefix_keys = mx.contiguous(cache.keys[first:first + 1, :, start:start + length])
        prefix_values = mx.contiguous(cache.values[first:first + 1, :, start:start + length])
        # Every row's prefix becomes left padding; what all rows now have in front of
        # their own keys is cut, as is the buffer's room past them (the next key grows
        # it by a block, as mlx-lm grows it), and the rest copied (a slice would keep
        # the old buffer).
        cut = start + length
        cache.keys = mx.contiguous(cache.keys[..., cut:cache._idx, :])
        cache.values = mx.contiguous(cache.values[..., cut:cache._idx, :])
        cache.left_padding = cache.left_padding + length - cut
        cache._idx -= cut
        cache.held_prefix = (prefix_keys, prefix_values)
        cache.extract = types.MethodType(_extract_whole_row, cache)
        cache.extend = types.MethodType(_extend_holding_the_same, cache)
        mx.eval(cache.keys, cache.values, prefix_keys, prefix_values, cache.left_padding)


def _extract_whole_row(cache: Any, idx: int):
    """mlx-lm's ``BatchKVCache.extract`` for a layer holding a prefix once: row ``idx``'s
    whole KV, the prefix and then its own keys, as one ``KVCache``."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    own = BatchKVCache.extract(cache, idx)
    prefix_keys, prefix_values = cache.held_prefix
    own.keys = mx.concatenate([prefix_keys, own.keys], axis=2)
    own.values = mx.concatenate([prefix_values, own.values], axis=2)
    own.offset = own.keys.shape[2]
    return own


def _extend_holding_the_same(cache: Any, other: Any) -> None:
    """mlx-lm's ``BatchKVCache.extend`` for a layer holding a prefix once: ``other`` must
    hold the same prefix (the very arrays), or it would lose its rows' prefix."""
    from mlx_lm.models.cache import BatchKVCache

    theirs, ours = held_prefix(other), cache.held_prefix
    if theirs is None or theirs[0] is not ours[0] or theirs[1] is not ours[1]:
        raise ValueError("a layer holding a prefix once takes rows holding the same prefix only")
    BatchKVCache.extend(cache, other)
