"""Attention of a batch's rows over one prefix they share plus each row's own keys.

Owns ``shared_prefix_attention``: a layer's queries (rows, query heads, length, head
dim), the shared prefix's keys and values (one row: ``(1, KV heads, prefix, head dim)``),
each row's own keys and values after it (``(rows, KV heads, keys, head dim)``, left-padded
as mlx-lm's ``BatchKVCache`` holds them) and the mask over those own keys in; the
attention over the prefix followed by the row's own keys out, as if each row held the
prefix itself. Nothing else: it reads no cache and keeps nothing between calls.

Why: coding agents' sessions share a system prompt of 10-30k tokens. A decoding batch
keeps each row's KV in one array per layer, so sixteen sessions over a 24k-token prompt
hold it sixteen times (44 of about 50 GB on Qwen3-0.6B's shape, docs/performance.md),
and every decode step reads all sixteen copies. Held once, the prefix is read once a step
for all rows, and the KV budget holds the sessions' own tokens only.

How: the two parts are two softmaxes merged by their log-sum-exps, as flash decoding
merges its splits (and FlashInfer's cascade attention a shared prefix). The prefix's
part folds every row's query heads of a KV head into one matrix product, so its keys
and values are read once for the whole batch; the rows' part folds each KV head's query
heads into its rows over each row's own keys under its mask, as the grouped products of
``runtime.cuda_attention`` do. Both compute their products in the inputs' precision and
their softmax in float32, as MLX's fallback does.
"""

from __future__ import annotations

from typing import Any


def shared_prefix_attention(mx, queries, prefix_keys, prefix_values, keys, values, *,
                            scale: float, mask: Any = None):
    """The attention of ``queries`` over ``prefix_keys`` / ``prefix_values`` (every row
    sees all of the prefix) followed by each row's ``keys`` / ``values`` under ``mask``:
    None (every own key visible), ``"causal"`` (aligned to the last key, as MLX's), or a
    boolean array that broadcasts to ``(rows, 1 or query heads, length, keys)`` (true:
    visible). A row that sees none of its own keys attends over the prefix alone.

    Returns ``(rows, query heads, length, value dim)`` in the queries' dtype."""
    rows, heads, length, dim = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    value_dim = values.shape[-1]
    per_head = group * length  # a KV head's query vectors in one row
    scaled = queries * scale

    # The prefix: every row's queries of a KV head against its keys in one product.
    folded = (scaled.reshape(rows, kv_heads, per_head, dim).swapaxes(0, 1)
              .reshape(kv_heads, rows * per_head, dim))
    scores = (folded @ prefix_keys[0].swapaxes(-1, -2)).astype(mx.float32)
    prefix_total = mx.logsumexp(scores, axis=-1, keepdims=True)
    weights = mx.exp(scores - prefix_total).astype(prefix_values.dtype)
    prefix_out = weights @ prefix_values[0]
    prefix_out = prefix_out.reshape(kv_heads, rows, per_head, value_dim).swapaxes(0, 1)
    prefix_total = prefix_total.reshape(kv_heads, rows, per_head, 1).swapaxes(0, 1)

    # Each row's own keys, under its mask.
    n_keys = keys.shape[2]
    scores = (scaled.reshape(rows, kv_heads, per_head, dim) @ keys.swapaxes(-1, -2))
    scores = scores.astype(mx.float32).reshape(rows, kv_heads, group, length, n_keys)
    visible = _visible(mx, mask, heads=heads, kv_heads=kv_heads, length=length,
                       n_keys=n_keys)
    if visible is not None:
        scores = mx.where(visible, scores, -mx.inf)
    own_total = mx.logsumexp(scores, axis=-1, keepdims=True)
    # A row that sees none of its own keys: -inf, its weights all zero (not NaN).
    seen = own_total > -mx.inf
    weights = mx.exp(scores - mx.where(seen, own_total, 0)).astype(values.dtype)
    own_out = weights.reshape(rows, kv_heads, per_head, n_keys) @ values
    own_total = own_total.reshape(rows, kv_heads, per_head, 1)

    total = mx.logaddexp(prefix_total, own_total)
    out = (prefix_out.astype(mx.float32) * mx.exp(prefix_total - total)
           + own_out.astype(mx.float32) * mx.exp(own_total - total))
    return out.astype(queries.dtype).reshape(rows, heads, length, value_dim)


def _visible(mx, mask, *, heads: int, kv_heads: int, length: int, n_keys: int):
    """``mask`` as a boolean array that broadcasts to ``(rows, KV heads, group, length,
    keys)``; None where every own key is visible."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or a boolean array, not {mask!r}")
        return mx.arange(n_keys - length, n_keys)[:, None] >= mx.arange(n_keys)[None]
    if mask.dtype != mx.bool_:
        raise ValueError(f"an array mask must be boolean, not {mask.dtype}")
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, *mask.shape[2:])
