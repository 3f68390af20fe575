"""Attention over a shared prefix plus each row's own keys, against real MLX (CPU):
whatever the rows, heads, lengths, left padding and mask, it is MLX's own attention over
each row holding the prefix itself."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.shared_prefix_attention import shared_prefix_attention


def _arrays(seed: int, *, rows, heads, kv_heads, length, prefix, own, dim, dtype):
    keys = mx.random.split(mx.random.key(seed), 5)
    queries = mx.random.normal((rows, heads, length, dim), key=keys[0]).astype(dtype)
    prefix_keys = mx.random.normal((1, kv_heads, prefix, dim), key=keys[1]).astype(dtype)
    prefix_values = mx.random.normal((1, kv_heads, prefix, dim), key=keys[2]).astype(dtype)
    own_keys = mx.random.normal((rows, kv_heads, own, dim), key=keys[3]).astype(dtype)
    own_values = mx.random.normal((rows, kv_heads, own, dim), key=keys[4]).astype(dtype)
    return queries, prefix_keys, prefix_values, own_keys, own_values


def _held_whole(queries, prefix_keys, prefix_values, keys, values, *, scale, mask):
    """MLX's attention with the prefix copied into every row and the mask widened over
    it (all visible), the layout a decoding batch holds today."""
    rows = queries.shape[0]
    prefix = prefix_keys.shape[2]
    whole_keys = mx.concatenate([mx.repeat(prefix_keys, rows, axis=0), keys], axis=2)
    whole_values = mx.concatenate([mx.repeat(prefix_values, rows, axis=0), values], axis=2)
    if isinstance(mask, str):
        length, n_keys = queries.shape[2], whole_keys.shape[2]
        mask = mx.arange(n_keys - length, n_keys)[:, None] >= mx.arange(n_keys)[None]
    elif mask is not None:
        seen = mx.ones((*mask.shape[:-1], prefix), dtype=mx.bool_)
        mask = mx.concatenate([seen, mask], axis=-1)
    return mx.fast.scaled_dot_product_attention(
        queries, whole_keys, whole_values, scale=scale, mask=mask)


def _left_padded_mask(padding: list[int], length: int, own: int, heads: int | None):
    """mlx-lm's decoding mask: each row's first ``padding[i]`` own keys hidden, and a
    causal mask over the last ``length`` keys."""
    positions = mx.arange(own)
    query_at = mx.arange(own - length, own)
    visible = (positions[None, None, :] >= mx.array(padding)[:, None, None]) & (
        positions[None, None, :] <= query_at[None, :, None])
    visible = visible[:, None]
    if heads is not None:
        visible = mx.broadcast_to(visible, (len(padding), heads, length, own))
    return visible


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), kv_heads=st.sampled_from([1, 2, 4]),
       group=st.sampled_from([1, 2, 4]), length=st.integers(1, 6),
       prefix=st.integers(1, 70), extra=st.integers(0, 40), dim=st.sampled_from([8, 16]),
       mask_kind=st.sampled_from(["none", "causal", "padded", "padded-per-head"]),
       data=st.data())
def test_is_attention_over_each_row_holding_the_prefix(rows, kv_heads, group, length,
                                                       prefix, extra, dim, mask_kind, data):
    heads = kv_heads * group
    own = length + extra
    queries, pk, pv, keys, values = _arrays(
        rows * 131 + prefix, rows=rows, heads=heads, kv_heads=kv_heads, length=length,
        prefix=prefix, own=own, dim=dim, dtype=mx.float32)
    scale = dim ** -0.5
    if mask_kind == "none":
        mask = None
    elif mask_kind == "causal":
        mask = "causal"
    else:
        padding = data.draw(st.lists(st.integers(0, extra), min_size=rows, max_size=rows))
        mask = _left_padded_mask(padding, length, own,
                                 heads if mask_kind == "padded-per-head" else None)
    got = shared_prefix_attention(mx, queries, pk, pv, keys, values, scale=scale, mask=mask)
    want = _held_whole(queries, pk, pv, keys, values, scale=scale, mask=mask)
    assert got.shape == want.shape == (rows, heads, length, dim)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-4, atol=2e-5)


def test_a_decode_step_in_half_precision_matches_within_its_rounding():
    """The shape of a decode step (one query a row, left-padded rows), in bfloat16."""
    rows, heads, kv_heads, prefix, own, dim = 4, 8, 2, 300, 40, 64
    queries, pk, pv, keys, values = _arrays(
        7, rows=rows, heads=heads, kv_heads=kv_heads, length=1, prefix=prefix, own=own,
        dim=dim, dtype=mx.bfloat16)
    mask = _left_padded_mask([0, 5, 17, 39], 1, own, None)
    got = shared_prefix_attention(mx, queries, pk, pv, keys, values, scale=0.125, mask=mask)
    want = _held_whole(queries, pk, pv, keys, values, scale=0.125, mask=mask)
    assert got.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                               np.array(want.astype(mx.float32)), atol=2e-2)


def test_a_row_that_sees_none_of_its_own_keys_attends_over_the_prefix_alone():
    queries, pk, pv, keys, values = _arrays(
        3, rows=2, heads=2, kv_heads=1, length=1, prefix=12, own=5, dim=8, dtype=mx.float32)
    mask = mx.array([[False] * 5, [True] * 5])[:, None, None, :]
    got = shared_prefix_attention(mx, queries, pk, pv, keys, values, scale=0.3, mask=mask)
    assert not np.isnan(np.array(got)).any()
    prefix_only = mx.fast.scaled_dot_product_attention(
        queries[:1], pk, pv, scale=0.3, mask=None)
    np.testing.assert_allclose(np.array(got[:1]), np.array(prefix_only), rtol=1e-5, atol=1e-6)


def test_a_mask_it_cannot_read_is_refused():
    queries, pk, pv, keys, values = _arrays(
        1, rows=1, heads=2, kv_heads=1, length=1, prefix=4, own=2, dim=8, dtype=mx.float32)
    with pytest.raises(ValueError, match="causal"):
        shared_prefix_attention(mx, queries, pk, pv, keys, values, scale=1.0, mask="full")
    with pytest.raises(ValueError, match="boolean"):
        shared_prefix_attention(mx, queries, pk, pv, keys, values, scale=1.0,
                                mask=mx.zeros((1, 1, 1, 2)))
