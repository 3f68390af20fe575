"""A decoding batch's KV layers holding the prefix that its rows share once.

Owns ``hold_prefix_once`` (a decoding batch's mlx-lm ``BatchKVCache`` layers whose rows
all begin with the same tokens in; each layer left holding those tokens' keys and values
once, ``held_prefix``, and per row only what follows them), ``prefix_released`` (the
way back), ``PrefixHolding`` (a decoding batch's policy around each join, which
``install_prefix_holding`` gives a generator under ``--decode-shared-prefix-tokens``
and ``--decode-shared-prefix-budget-share``, ``shared_prefix_min_saving``),
``held_prefix_stats`` (what the held prefixes hold and save, for ``EngineStats``)
and ``row_span`` (positions of a finished row without the copy of its whole KV).
Receives the batches and their layers; emits nothing but log lines.

A layer so held answers mlx-lm's calls as it did: ``update_and_fetch``, ``make_mask``,
``filter`` and ``trim`` act on the rows' own keys (the prefix's positions count as each
row's left padding, so the mask hides them and RoPE's offsets stay each row's whole
length); ``extract`` gives a row's whole KV, the prefix first; ``extend`` takes only a
layer holding the same prefix. A decode step's attention over such a layer is our CUDA
kernel's variant over a held prefix (``runtime.cuda_masked_decode``) where it is
installed, else ``runtime.shared_prefix_attention``'s, which ``decode_attention``
(``runtime.cuda_decode_attention``) gives it.

Why: sixteen coding-agent sessions over one 24k-token system prompt hold it sixteen
times in a decoding batch (44 of about 50 GB on Qwen3-0.6B's shape), and each decode
step reads every copy. Held once, it is read once a step, the batch holds what the
sessions do not share, and the KV budget (``actors.scheduler``) counts it once.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

# The share of the KV budget a held prefix must save where its attention is operations
# (runtime.shared_prefix_attention; not measured on Metal): where the budget, not the
# step, limits how many sessions decode at once.
DEFAULT_BUDGET_SHARE = 0.5


def held_prefix(cache: Any) -> tuple[Any, Any] | None:
    """The keys and values ``(1, KV heads, prefix, head dim)`` that ``cache`` holds once
    for all its rows; None for a layer that holds none."""
    return getattr(cache, "held_prefix", None)


def hold_prefix_once(mx, caches: list, length: int, holders: list | None = None) -> None:
    """Hold the first ``length`` keys and values of every row of each layer in ``caches``
    once: the rows must all begin with the same ``length`` tokens (the caller's check,
    by their tokens) and hold more than that. Each layer's arrays are copied down to the
    rows' own keys and evaluated before the next layer is, so that the batch is never
    held twice. ``holders``: layers holding those tokens' prefix already (a batch the
    rows join), whose very arrays each layer takes instead of a copy of its own. Raises
    ValueError for a layer that is not a plain ``BatchKVCache`` with keys, that holds a
    prefix already, or whose rows are not all longer than ``length``.
    """
    from mlx_lm.models.cache import BatchKVCache

    if length <= 0:
        raise ValueError(f"a held prefix is at least one token, not {length}")
    for i, cache in enumerate(caches):
        if type(cache) is not BatchKVCache or cache.keys is None:
            raise ValueError("only a BatchKVCache layer holding keys can hold a prefix once")
        if held_prefix(cache) is not None:
            raise ValueError("this layer holds a prefix once already")
        padding = cache.left_padding.tolist()
        if cache._idx - max(padding) <= length:
            raise ValueError(f"every row must hold more than the {length}-token prefix")
        first = padding.index(min(padding))
        start = padding[first]
        if holders is not None:
            prefix_keys, prefix_values = holders[i].held_prefix
        else:
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
    own_keys, own_values = own.keys, own.values
    own.keys = mx.concatenate([prefix_keys, own_keys], axis=2)
    own.values = mx.concatenate([prefix_values, own_values], axis=2)
    own.offset = own.keys.shape[2]
    # The parts, for a reader of a few of its positions (``row_span``): the
    # concatenation, lazy, is then never computed.
    own.held_parts = (own.keys, own.values, prefix_keys, prefix_values, own_keys, own_values)
    return own


def row_span(layer: Any, start: int, end: int) -> tuple[Any, Any]:
    """Keys and values ``[start, end)`` of a finished row's KV layer (a ``KVCache``).
    Where ``extract`` gave it from a layer holding a prefix once (and nothing has
    replaced its arrays since), they are read from the held prefix and the row's own
    arrays, not from their concatenation: the prompt-cache store keeps only what follows
    the span it already holds (a session's previous turn, or the shared system prompt),
    and the whole row's copy (2.75 GB at 24k tokens on Qwen3-0.6B's shape) is then
    never made."""
    parts = getattr(layer, "held_parts", None)
    if parts is None or parts[0] is not layer.keys or parts[1] is not layer.values:
        return layer.keys[..., start:end, :], layer.values[..., start:end, :]
    _, _, prefix_keys, prefix_values, own_keys, own_values = parts
    return (_positions(prefix_keys, own_keys, start, end),
            _positions(prefix_values, own_values, start, end))


def _positions(prefix: Any, own: Any, start: int, end: int):
    """Positions ``[start, end)`` of ``prefix`` followed by ``own`` (along axis 2),
    copying only the positions asked for."""
    import mlx.core as mx

    length = prefix.shape[2]
    if end <= length:
        return prefix[..., start:end, :]
    if start >= length:
        return own[..., start - length:end - length, :]
    return mx.concatenate([prefix[..., start:, :], own[..., :end - length, :]], axis=2)


def _extend_holding_the_same(cache: Any, other: Any) -> None:
    """mlx-lm's ``BatchKVCache.extend`` for a layer holding a prefix once: ``other`` must
    hold the same prefix (the very arrays), or it would lose its rows' prefix."""
    from mlx_lm.models.cache import BatchKVCache

    theirs, ours = held_prefix(other), cache.held_prefix
    if theirs is None or theirs[0] is not ours[0] or theirs[1] is not ours[1]:
        raise ValueError("a layer holding a prefix once takes rows holding the same prefix only")
    BatchKVCache.extend(cache, other)


def let_go(caches: list) -> None:
    """Layers that held a prefix once answer as plain ``BatchKVCache``s again (their rows
    gone, or every row given the prefix back by ``prefix_released``)."""
    for cache in caches:
        for name in ("held_prefix", "extract", "extend"):
            cache.__dict__.pop(name, None)


def prefix_released(mx, caches: list) -> None:
    """Every row of each layer given its prefix back: the layers hold each row's whole KV
    again, as plain ``BatchKVCache``s, a layer at a time: each layer one prefix longer,
    row ``i``'s prefix right before its own keys, its left padding as it was."""
    for cache in caches:
        held = held_prefix(cache)
        if held is None:
            continue
        prefix_keys, prefix_values = held
        length = prefix_keys.shape[2]
        rows = cache.keys.shape[0]
        # Laid out as [prefix][own keys], row i's own keys begin at ``length + padding[i]``
        # and its prefix at 0: a gather moves each row's prefix up to its own keys.
        laid = [mx.concatenate([mx.broadcast_to(p, (rows, *p.shape[1:])), own], axis=2)
                for p, own in ((prefix_keys, cache.keys), (prefix_values, cache.values))]
        positions = mx.arange(laid[0].shape[2])[None]
        gap = cache.left_padding[:, None]
        moved = mx.where(positions < length + gap, mx.maximum(positions - gap, 0), positions)
        index = moved[:, None, :, None]
        cache.keys, cache.values = (mx.take_along_axis(a, index, axis=2) for a in laid)
        cache._idx += length
        mx.eval(cache.keys, cache.values, cache.left_padding)
    let_go(caches)


def shared_length(token_lists: list) -> int:
    """How many tokens every list in ``token_lists`` begins with alike."""
    if not token_lists:
        return 0
    first = token_lists[0]
    length = min(len(tokens) for tokens in token_lists)
    for tokens in token_lists[1:]:
        # Slices compared in C, halving the span (24k-token prompts, a row a join).
        if tokens[:length] == first[:length]:
            continue
        alike, differ = 0, length  # tokens[:alike] == first[:alike]; not so at differ
        while differ - alike > 1:
            middle = (alike + differ) // 2
            if tokens[:middle] == first[:middle]:
                alike = middle
            else:
                differ = middle
        length = alike
    return length


def rows_hold_more_than(caches: list, length: int) -> bool:
    """Whether every row of the first layer of ``caches`` holds more than ``length`` keys."""
    cache = caches[0] if caches else None
    if cache is None or cache.keys is None or not cache.keys.shape[0]:
        return False
    return cache._idx - max(cache.left_padding.tolist()) > length


class PrefixHolding:
    """One decoding batch's prefix held once, and the settings it follows.

    ``min_tokens``: the batch holds a prefix once when at least two of its rows and
    every row it has begin with that many tokens alike or more (0: never), and its
    sessions' copies of it less one come to at least ``min_saving_bytes``. ``tokens``:
    the prefix it holds, or None. The generation batch calls ``before_join`` and
    ``after_join`` around a join (``runtime.mlx_lm_batches.RowAwareGenerationBatch``);
    a lane opened beside it takes a ``fresh`` one."""

    def __init__(self, min_tokens: int, min_saving_bytes: int = 0):
        self.min_tokens = min_tokens
        self.min_saving_bytes = min_saving_bytes
        self.tokens: list[int] | None = None

    def fresh(self) -> PrefixHolding:
        return PrefixHolding(self.min_tokens, self.min_saving_bytes)

    def shares(self, token_lists: list) -> bool:
        """Whether rows of ``token_lists`` would join this batch without a release: it
        holds a prefix, and every one of them begins with it and goes on past it."""
        held = self.tokens
        return held is not None and all(
            len(tokens) > len(held) and tokens[:len(held)] == held for tokens in token_lists)

    def before_join(self, mx, batch: Any, joining: Any) -> None:
        """Make ``batch`` (a generation batch) and ``joining`` agree before the join: both
        holding the same prefix arrays (the joining rows stripped of this batch's
        prefix), or neither holding one (a prefix given back to every row)."""
        mine, theirs = batch.prompt_cache, joining.prompt_cache
        their_holding = getattr(joining, "prefix_holding", None)
        their_tokens = their_holding.tokens if their_holding is not None else None
        if their_tokens is not None and (not theirs or held_prefix(theirs[0]) is None):
            their_tokens = None
        if not mine:  # no rows: the batch takes the joining layers as they are
            self.tokens = their_tokens
            return
        if self.tokens is not None and held_prefix(mine[0]) is None:
            self.tokens = None  # the layers were cleared and remade
        if self.tokens is not None and their_tokens is not None and \
                held_prefix(theirs[0])[0] is held_prefix(mine[0])[0]:
            return
        if self.tokens is not None and theirs and self.shares(joining.tokens):
            if their_tokens is not None:
                prefix_released(mx, theirs)
            if rows_hold_more_than(theirs, len(self.tokens)):
                hold_prefix_once(mx, theirs, len(self.tokens), holders=mine)
                return
        if self.tokens is not None:
            log.info("a decode batch gives its %d-token prefix back to its %d rows: rows "
                     "without it join", len(self.tokens), len(batch.uids))
            prefix_released(mx, mine)
            self.tokens = None
        if their_tokens is not None:
            prefix_released(mx, theirs)
            their_holding.tokens = None

    def after_join(self, mx, batch: Any) -> None:
        """Hold the prefix that ``batch``'s rows now share once, where it holds none and
        they share at least ``min_tokens``."""
        caches = batch.prompt_cache
        if self.min_tokens <= 0 or self.tokens is not None or not caches:
            return
        from mlx_lm.models.cache import BatchKVCache

        if not all(type(c) is BatchKVCache and c.keys is not None for c in caches):
            return
        rows = [list(tokens) for uid, tokens in zip(batch.uids, batch.tokens, strict=True)
                if uid >= 0]
        # A vacant row (runtime.vacant_rows) has no tokens: its keys are cut as the
        # others' are, since its replies are dropped and a joining row overwrites it.
        if len(rows) < 2:
            return
        length = shared_length(rows)
        if length < self.min_tokens or not rows_hold_more_than(caches, length):
            return
        saving = (len(rows) - 1) * length * kv_bytes_per_token(caches)
        if saving < self.min_saving_bytes:
            return
        hold_prefix_once(mx, caches, length)
        self.tokens = rows[0][:length]
        log.info("a decode batch holds its %d rows' %d-token prefix once (%.2f GB saved)",
                 len(rows), length, saving / 1e9)


def kv_bytes_per_token(caches: list) -> int:
    """One row's bytes of keys and values a token over the layers ``caches``."""
    return sum(c.keys.shape[1] * (c.keys.shape[3] * c.keys.dtype.size
                                  + c.values.shape[3] * c.values.dtype.size) for c in caches)


@contextlib.contextmanager
def prefix_kept(mx, batch: Any, joining: Any) -> Iterator[None]:
    """Around a generation batch's join of ``joining``: its ``PrefixHolding``'s
    ``before_join`` and ``after_join`` (nothing for a batch without one)."""
    holding = getattr(batch, "prefix_holding", None)
    if holding is not None:
        holding.before_join(mx, batch, joining)
    yield
    if holding is not None:
        holding.after_join(mx, batch)


def install_prefix_holding(generator: Any, min_tokens: int, min_saving_bytes: int = 0) -> bool:
    """Give ``generator``'s decoding batch (its first lane, where it has lanes) a
    ``PrefixHolding`` (``min_tokens``, ``min_saving_bytes``); new lanes take a fresh
    one. ``min_tokens`` 0: none. Call it only where every layer of the model takes the
    compiled decode path, whose attention (``decode_attention``) reads a held prefix.
    Returns whether it did."""
    if min_tokens <= 0:
        return False
    batch = generator._generation_batch
    first = batch.lanes[0] if hasattr(batch, "lanes") else batch
    first.prefix_holding = PrefixHolding(min_tokens, min_saving_bytes)
    return True


def shared_prefix_min_saving(config: Any, info: Any) -> int:
    """The bytes a batch's held prefix must save at least under ``config``'s
    ``decode_shared_prefix_budget_share`` of the KV budget the Scheduler admits by:
    ``kv_cache_budget_bytes``, else the model's default (``info``, a ``ModelInfo``;
    none where its bytes per token are unknown). The share left unset is 0 where our
    CUDA kernel reads a held prefix (installed by ``install_masked_decode``; on an H100
    holding made 0.93-2.01x the agent sessions' tokens/s there, its attention 0.76-0.84x
    the time), else ``DEFAULT_BUDGET_SHARE``."""
    import mlx.core as mx

    share = config.decode_shared_prefix_budget_share
    if share is None:
        kernel = getattr(mx.fast.scaled_dot_product_attention, "held_kernel", False)
        share = 0.0 if kernel else DEFAULT_BUDGET_SHARE
    budget = config.kv_cache_budget_bytes or (
        info.kv_budget if info.kv_bytes_per_token else 0)
    return int(share * budget)


def held_prefix_stats(generator: Any) -> dict[str, int]:
    """``EngineStats``' held-prefix fields for ``generator``'s decoding batch (each of
    its lanes): ``held_prefix_bytes``, the prefixes' keys and values held once, and
    ``shared_kv_bytes``, what holding them once saves against each of their sessions
    holding its own copy (a prefix's bytes times its batch's sessions less one; vacant
    rows are no session's)."""
    batch = getattr(generator, "_generation_batch", None)
    lanes = getattr(batch, "lanes", None) or ([batch] if batch is not None else [])
    held = saved = 0
    for lane in lanes:
        caches = getattr(lane, "prompt_cache", None) or []
        if not caches or held_prefix(caches[0]) is None:
            continue
        nbytes = sum(k.nbytes + v.nbytes for k, v in filter(None, map(held_prefix, caches)))
        sessions = sum(1 for uid in lane.uids if uid >= 0)
        held += nbytes
        saved += nbytes * max(0, sessions - 1)
    return {"held_prefix_bytes": held, "shared_kv_bytes": saved}
