"""Our masked decode kernel (runtime.cuda_masked_decode) and its route
(``--decode-attention kernel``): which calls it takes and where ``decode_attention``
sends a step, on the CPU with CUDA's availability faked; what it computes, against MLX's
own attention, where CUDA is there to run it."""

from __future__ import annotations

import pytest

from runtime.cuda_attention import install_prefill_attention
from runtime.cuda_decode_attention import (
    decode_attention,
    install_masked_decode,
    warm_masked_decode,
)
from runtime.cuda_masked_decode import (
    MOST_PREFIX_QUERIES,
    SHARED_BYTES,
    THREADS,
    elements_per_lane,
    held_kernel_applies,
    held_prefix_decode_attention,
    held_rows_per_block,
    kernel_applies,
    masked_decode_attention,
)
from runtime.shared_prefix_attention import shared_prefix_attention


def _case(mx, rows, q_heads, kv_heads, dim, n_keys, buffer, dtype, seed=0):
    """Queries, key and value buffers of ``buffer`` keys whose keys past ``n_keys`` are
    huge (a read past the mask's end would show), and a mask with each row padded on the
    left by a different amount (the last row by none, the first by more than a split)."""
    mx.random.seed(seed)
    q = mx.random.normal((rows, q_heads, 1, dim)).astype(dtype)
    k = mx.random.normal((rows, kv_heads, buffer, dim))
    v = mx.random.normal((rows, kv_heads, buffer, dim))
    stale = (mx.arange(buffer) >= n_keys)[None, None, :, None]
    k = mx.where(stale, 1e4, k).astype(dtype)
    v = mx.where(stale, 1e4, v).astype(dtype)
    pads = mx.array([min(n_keys - 1, (rows - 1 - r) * 300 + r) for r in range(rows)])
    mask = (mx.arange(n_keys)[None, :] >= pads[:, None])[:, None, None, :]
    return q, k, v, mask


def _expected(mx, q, k, v, mask, scale):
    n_keys = mask.shape[-1]
    return mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32), k[..., :n_keys, :].astype(mx.float32),
        v[..., :n_keys, :].astype(mx.float32), scale=scale, mask=mask)


def test_the_kernel_takes_half_precision_decode_steps_of_the_head_sizes_it_was_built_for():
    import mlx.core as mx

    q, k, v, mask = _case(mx, 3, 8, 2, 128, 100, 256, mx.bfloat16)
    assert kernel_applies(mx, q, k, v, mask)
    assert kernel_applies(mx, q.astype(mx.float16), k.astype(mx.float16),
                          v.astype(mx.float16), mask)
    assert not kernel_applies(mx, q.astype(mx.float32), k, v, mask)  # dtypes differ
    assert not kernel_applies(mx, q, k, v, mask.astype(mx.float32))  # an additive mask
    assert not kernel_applies(mx, mx.concatenate([q, q], axis=2), k, v, mask)  # a chunk
    # The mask longer than the buffers.
    assert not kernel_applies(mx, q, k[..., :50, :], v[..., :50, :], mask)
    q, k, v, mask = _case(mx, 3, 8, 2, 96, 100, 256, mx.bfloat16)
    assert not kernel_applies(mx, q, k, v, mask)  # a head size it was not built for
    q, k, v, mask = _case(mx, 2, 32, 2, 64, 40, 64, mx.bfloat16)
    assert not kernel_applies(mx, q, k, v, mask)  # 16 query heads a KV head
    q, k, v, mask = _case(mx, 2, 6, 4, 64, 40, 64, mx.bfloat16)
    assert not kernel_applies(mx, q, k, v, mask)  # KV heads not a divisor


def test_a_key_is_read_by_fewer_lanes_the_fewer_query_heads_share_it():
    assert elements_per_lane(128, 2) == 16  # Qwen3-0.6B: eight lanes a key
    assert elements_per_lane(128, 4) == 8  # Llama-3-8B: sixteen
    assert elements_per_lane(128, 8) == 4  # a warp a key
    assert elements_per_lane(64, 1) == 16
    assert elements_per_lane(256, 8) == 8  # never more than 32 lanes a key
    for dim in (64, 128, 256):
        for rep in range(1, 9):
            lanes = dim // elements_per_lane(dim, rep)
            assert lanes * elements_per_lane(dim, rep) == dim and lanes <= 32
            assert lanes & (lanes - 1) == 0


def test_a_held_prefix_block_takes_several_rows_only_where_the_batch_has_them():
    """Four queries a block over a held prefix: two rows of Qwen3-0.6B's two query heads
    a KV head, one of Llama-3-8B's four; one row a block in a batch with fewer rows, and
    where the rows' merge would not fit a block's shared memory."""
    assert held_rows_per_block(128, 2, 16) == 2
    assert held_rows_per_block(128, 2, 2) == 2
    assert held_rows_per_block(128, 2, 1) == 1
    assert held_rows_per_block(128, 4, 16) == 1
    assert held_rows_per_block(128, 8, 16) == 1
    assert held_rows_per_block(64, 1, 16) == 4
    assert held_rows_per_block(64, 1, 3) == 1
    assert held_rows_per_block(256, 3, 16) == 1  # three query heads: one row
    for dim in (64, 128, 256):
        for rep in (1, 2, 4, 8):
            group = held_rows_per_block(dim, rep, 64)
            assert group & (group - 1) == 0 and group * rep <= MOST_PREFIX_QUERIES
            assert (2 + dim) * (THREADS // 32) * rep * group * 4 <= SHARED_BYTES


def test_each_kernel_reads_only_its_inputs_and_the_template_values_it_is_given():
    """What each kernel's source names (inputs' shapes and strides, template values)
    is what ``KERNELS`` and the calls give it, which only a GPU's build would tell
    otherwise: the own keys' kernel gets no ``ROWS`` or ``HELD_EPL``."""
    import re

    from runtime.cuda_masked_decode import KERNELS

    given = {"T", "D", "REP", "EPL", "SCALE_BITS", "THREADS", "KEYS_PER_LOAD",
             "KEYS_PER_SPLIT"}
    templates = {"split": given, "held_split": given | {"ROWS", "HELD_EPL"}, "merge": {"T"}}
    for kernel, arguments in KERNELS.items():
        source = arguments["source"]
        read = set(re.findall(r"\b([a-z_]+?)_(?:shape|strides)\b", source))
        assert read and read <= set(arguments["input_names"]), (kernel, read)
        named = set(re.findall(r"\b([A-Z][A-Z_]*)\b", source))
        assert named <= templates[kernel], (kernel, named - templates[kernel])


def test_a_layout_the_kernel_cannot_run_is_refused_before_it_is_built():
    import mlx.core as mx

    q, k, v, mask = _case(mx, 2, 4, 2, 128, 40, 64, mx.bfloat16)
    for lane_elements in (2, 3, 256):
        with pytest.raises(ValueError, match="lane_elements"):
            masked_decode_attention(mx, q, k, v, mask, scale=0.1,
                                    lane_elements=lane_elements)


def test_a_masked_step_goes_to_the_kernel_only_where_it_is_installed_and_applies(monkeypatch):
    """With CUDA's availability faked: installed as ``kernel``, a masked decode step
    below the grouped products' bound gets the kernel's attention over the cache's own
    buffers (here a stand-in that computes MLX's attention, the kernel itself needing
    CUDA) under mlx-lm's mask; at the bound the grouped products'; as ``grouped``, or
    where the kernel does not apply, not the kernel's."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import BatchKVCache

    import runtime.cuda_decode_attention as route

    calls = []

    def stand_in(mx_, queries, keys, values, mask, *, scale):
        calls.append((keys, values, mask.shape[-1]))
        return _expected(mx_, queries, keys, values, mask, scale).astype(queries.dtype)

    monkeypatch.setattr(route, "masked_decode_attention", stand_in)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        mx.fast.scaled_dot_product_attention)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert install_prefill_attention(mx)

    cache = BatchKVCache(left_padding=[5, 0])
    _, k, v, _ = _case(mx, 2, 4, 2, 64, 69, 69, mx.bfloat16)
    cache.update_and_fetch(k, v)
    q, k, v, _ = _case(mx, 2, 4, 2, 64, 1, 1, mx.bfloat16, seed=1)
    mask = create_attention_mask(q[:, 0, :, :1], cache)
    keys, values = cache.update_and_fetch(k, v)
    expected = _expected(mx, q, keys, values, mask, 0.125)

    assert install_masked_decode(mx, "grouped")
    assert decode_attention(mx, q, cache, scale=0.125, mask=mask) is None  # too shallow
    assert not calls
    assert install_masked_decode(mx, "kernel", min_bytes=0)  # every step deep enough
    grouped = decode_attention(mx, q, cache, scale=0.125, mask=mask)
    assert not calls
    assert install_masked_decode(mx, "kernel")
    got = decode_attention(mx, q, cache, scale=0.125, mask=mask)
    (buffers_keys, buffers_values, n_keys), = calls
    assert buffers_keys is cache.keys and buffers_values is cache.values and n_keys == 70
    for attended in (got, grouped):
        assert mx.allclose(attended.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()
    # Not half precision: neither route.
    assert decode_attention(mx, q.astype(mx.float32), cache, scale=0.125, mask=mask) is None
    assert len(calls) == 1
    with pytest.raises(ValueError, match="mode"):
        install_masked_decode(mx, "rows")


def test_a_kernel_that_cannot_build_turns_its_route_off_and_the_grouped_one_stays(
        monkeypatch, caplog):
    """Off CUDA (faked available) the kernel cannot run, as a kernel that fails to build
    on a GPU: warming it logs that, and masked decode steps go as ``grouped``."""
    import mlx.core as mx

    if _on_cuda():
        pytest.skip("the kernel builds here")
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        mx.fast.scaled_dot_product_attention)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert install_masked_decode(mx, "kernel")
    q, k, v, _ = _case(mx, 2, 4, 2, 64, 1, 1, mx.bfloat16)
    assert not warm_masked_decode(mx, q[:1], k[:1], v[:1], scale=0.125)  # one row: no mask
    assert mx.fast.scaled_dot_product_attention.decode_kernel
    with caplog.at_level("WARNING"):
        assert not warm_masked_decode(mx, q, k, v, scale=0.125)
    assert "did not build or run" in caplog.text
    installed = mx.fast.scaled_dot_product_attention
    assert installed.grouped_decode and not installed.decode_kernel
    assert not installed.held_kernel


def _on_cuda() -> bool:
    import mlx.core as mx

    return mx.cuda.is_available()


cuda = pytest.mark.skipif(not _on_cuda(), reason="the kernel runs on CUDA")


@cuda
@pytest.mark.parametrize(("rows", "q_heads", "kv_heads", "dim", "n_keys", "buffer"), [
    (2, 16, 8, 128, 12_000, 12_288),  # Qwen3-0.6B's shape at depth
    (4, 32, 8, 128, 257, 512),  # Llama-3-8B's: a split of one key
    (3, 8, 8, 64, 1, 256),  # one key, no grouping
    (5, 64, 8, 64, 3_000, 3_072),  # eight query heads a KV head
    (2, 8, 2, 256, 700, 768),  # the largest head size
])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_kernel_computes_mlx_s_masked_attention(rows, q_heads, kv_heads, dim, n_keys,
                                                   buffer, dtype):
    """In each layout: the default one, a warp a key, and four lanes a key."""
    import mlx.core as mx

    q, k, v, mask = _case(mx, rows, q_heads, kv_heads, dim, n_keys, buffer,
                          getattr(mx, dtype))
    scale = dim ** -0.5
    expected = _expected(mx, q, k, v, mask, scale)
    for lane_elements in (None, dim // 32, dim // 4):
        got = masked_decode_attention(mx, q, k, v, mask, scale=scale,
                                      lane_elements=lane_elements)
        assert got.dtype == q.dtype and got.shape == q.shape
        assert mx.allclose(got.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()


@cuda
def test_whatever_a_masked_key_holds_it_counts_for_nothing():
    """Keys and values that are NaN or infinite where the mask is False, within the
    blocks the kernel reads and in blocks wholly masked, change nothing."""
    import mlx.core as mx

    q, k, v, mask = _case(mx, 3, 16, 8, 128, 1_000, 1_024, mx.bfloat16)
    clean = masked_decode_attention(mx, q, k, v, mask, scale=0.1)
    masked = ~mask[:, 0, 0, :, None][:, None]  # (rows, 1, keys, 1)
    masked = mx.pad(masked, [(0, 0), (0, 0), (0, 24), (0, 0)])
    poisoned_k = mx.where(masked, mx.array(float("nan"), mx.bfloat16), k)
    poisoned_v = mx.where(masked, mx.array(float("inf"), mx.bfloat16), v)
    got = masked_decode_attention(mx, q, poisoned_k, poisoned_v, mask, scale=0.1)
    assert mx.array_equal(got, clean).item()


@cuda
def test_a_row_with_nothing_in_its_mask_gets_zeros_and_the_others_are_unchanged():
    import mlx.core as mx

    q, k, v, mask = _case(mx, 3, 4, 2, 128, 600, 768, mx.bfloat16)
    empty = mx.concatenate([mask[:1], mx.zeros_like(mask[1:2]), mask[2:]])
    got = masked_decode_attention(mx, q, k, v, empty, scale=0.1)
    assert mx.array_equal(got[1], mx.zeros_like(got[1])).item()
    kept = masked_decode_attention(mx, q, k, v, mask, scale=0.1)
    assert mx.array_equal(got[::2], kept[::2]).item()


@cuda
def test_the_kernel_reads_strided_buffers_and_a_broadcast_mask_as_they_lie():
    """Keys and values as views: a window of a longer buffer (the engine's trimmed
    caches), and keys stored with the head dimension outermost (no two of a lane's
    elements adjacent); the mask broadcast over the rows."""
    import mlx.core as mx

    q, k, v, _ = _case(mx, 3, 8, 4, 128, 1_100, 1_100, mx.bfloat16)
    window_k, window_v = k[..., 150:1_050, :], v[..., 150:1_050, :]
    one_mask = mx.broadcast_to((mx.arange(900) >= 333)[None, None, None, :], (3, 1, 1, 900))
    transposed_k = mx.contiguous(window_k.swapaxes(2, 3)).swapaxes(2, 3)
    expected = _expected(mx, q, window_k, window_v, one_mask, 0.09)
    for keys in (window_k, transposed_k):
        got = masked_decode_attention(mx, q, keys, window_v, one_mask, scale=0.09)
        assert mx.allclose(got.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()


def _held_case(mx, rows, q_heads, kv_heads, dim, prefix, own, dtype, seed=0):
    """Queries, a prefix of ``prefix`` keys held once, each row's own keys (a buffer of
    ``own`` keys plus 40 huge ones past the mask's end, each row padded on the left by a
    different amount) and their mask; and the same keys as each row would hold them,
    the prefix in front of its own, with the mask over both."""
    mx.random.seed(seed)
    q = mx.random.normal((rows, q_heads, 1, dim)).astype(dtype)
    prefix_k = mx.random.normal((1, kv_heads, prefix, dim)).astype(dtype)
    prefix_v = mx.random.normal((1, kv_heads, prefix, dim)).astype(dtype)
    stale = (mx.arange(own + 40) >= own)[None, None, :, None]
    k = mx.where(stale, 1e4, mx.random.normal((rows, kv_heads, own + 40, dim))).astype(dtype)
    v = mx.where(stale, 1e4, mx.random.normal((rows, kv_heads, own + 40, dim))).astype(dtype)
    pads = mx.array([min(own - 1, (r * 37) % own) for r in range(rows)])
    mask = (mx.arange(own)[None, :] >= pads[:, None])[:, None, None, :]
    whole_k = mx.concatenate([mx.broadcast_to(prefix_k, (rows, *prefix_k.shape[1:])),
                              k[..., :own, :]], axis=2)
    whole_v = mx.concatenate([mx.broadcast_to(prefix_v, (rows, *prefix_v.shape[1:])),
                              v[..., :own, :]], axis=2)
    whole_mask = mx.concatenate([mx.ones((rows, 1, 1, prefix), dtype=mx.bool_), mask], axis=3)
    return (q, prefix_k, prefix_v, k, v, mask), (whole_k, whole_v, whole_mask)


def test_the_held_prefix_kernel_takes_a_prefix_held_once_alike_the_rows_own_keys():
    import mlx.core as mx

    (q, pk, pv, k, v, mask), _ = _held_case(mx, 3, 8, 4, 128, 300, 50, mx.bfloat16)
    assert held_kernel_applies(mx, q, pk, pv, k, v, mask)
    assert not held_kernel_applies(mx, q, mx.concatenate([pk, pk]), pv, k, v, mask)  # 2 rows
    assert not held_kernel_applies(mx, q, pk[:, :2], pv[:, :2], k, v, mask)  # KV heads
    assert not held_kernel_applies(mx, q, pk[..., :64], pv[..., :64], k, v, mask)  # head size
    assert not held_kernel_applies(mx, q, pk.astype(mx.float16), pv, k, v, mask)  # dtype
    assert not held_kernel_applies(mx, q, pk[:, :, :0], pv[:, :, :0], k, v, mask)  # empty
    assert not held_kernel_applies(mx, q.astype(mx.float32), pk, pv, k, v, mask)


def test_a_held_layer_goes_to_the_held_kernel_where_it_is_installed_else_to_the_operations(
        monkeypatch):
    """With CUDA's availability faked and the held kernel a stand-in (it needs CUDA): a
    decode step over a layer holding its rows' prefix once (``hold_prefix_once``) gets
    the held kernel's attention over the prefix and the cache's own buffers under
    mlx-lm's mask, installed as ``kernel``; as ``grouped``, the operations'
    (``shared_prefix_attention``); both as the same layer holding the prefix in every row."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import BatchKVCache

    import runtime.cuda_decode_attention as route
    from runtime.held_prefix import hold_prefix_once

    calls = []

    def stand_in(mx_, queries, prefix_keys, prefix_values, keys, values, mask, *, scale):
        calls.append((prefix_keys, keys, values, mask.shape[-1]))
        return shared_prefix_attention(mx_, queries, prefix_keys, prefix_values,
                                       keys[..., :mask.shape[-1], :],
                                       values[..., :mask.shape[-1], :], scale=scale,
                                       mask=mask)

    monkeypatch.setattr(route, "held_prefix_decode_attention", stand_in)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        mx.fast.scaled_dot_product_attention)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert install_prefill_attention(mx)

    mx.random.seed(3)
    prefix_k, prefix_v = (mx.random.normal((1, 2, 40, 64)) for _ in range(2))
    own = [mx.random.normal((1, 2, n, 64)) for n in (24, 29, 24, 29)]

    def row(prefix, mine, pad):
        return mx.concatenate([mx.zeros((1, 2, pad, 64)), prefix, mine], axis=2)

    k = mx.concatenate([row(prefix_k, own[0], 5), row(prefix_k, own[1], 0)]).astype(mx.bfloat16)
    v = mx.concatenate([row(prefix_v, own[2], 5), row(prefix_v, own[3], 0)]).astype(mx.bfloat16)
    held, whole = BatchKVCache(left_padding=[5, 0]), BatchKVCache(left_padding=[5, 0])
    for cache in (held, whole):
        cache.update_and_fetch(k, v)
    hold_prefix_once(mx, [held], 40)
    q, new_k, new_v, _ = _case(mx, 2, 4, 2, 64, 1, 1, mx.bfloat16, seed=1)
    masks = {}
    for name, cache in (("held", held), ("whole", whole)):
        masks[name] = create_attention_mask(q[:, 0, :, :1], cache)
        cache.update_and_fetch(new_k, new_v)
    keys, values = whole.keys_and_values()
    expected = _expected(mx, q, keys, values, masks["whole"], 0.125)

    assert install_masked_decode(mx, "grouped")
    by_operations = decode_attention(mx, q, held, scale=0.125, mask=masks["held"])
    assert not calls
    assert install_masked_decode(mx, "kernel")
    by_kernel = decode_attention(mx, q, held, scale=0.125, mask=masks["held"])
    (prefix_keys, buffer_keys, buffer_values, n_keys), = calls
    assert prefix_keys is held.held_prefix[0]
    assert buffer_keys is held.keys and buffer_values is held.values and n_keys == 30
    for attended in (by_operations, by_kernel):
        assert mx.allclose(attended.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()


@cuda
@pytest.mark.parametrize(("rows", "q_heads", "kv_heads", "dim", "prefix", "own"), [
    (16, 16, 8, 128, 3_000, 700),  # Qwen3-0.6B's shape, a prefix not a whole split
    (4, 32, 8, 128, 256, 1),  # Llama-3-8B's: a prefix of one split, one own key
    (1, 8, 8, 64, 1, 300),  # one row, a one-key prefix
    (5, 64, 8, 64, 777, 257),  # eight query heads a KV head
    (3, 8, 2, 256, 513, 100),  # the largest head size
])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_held_kernel_computes_mlx_s_attention_over_each_row_holding_the_prefix(
        rows, q_heads, kv_heads, dim, prefix, own, dtype):
    import mlx.core as mx

    held, (whole_k, whole_v, whole_mask) = _held_case(
        mx, rows, q_heads, kv_heads, dim, prefix, own, getattr(mx, dtype))
    q = held[0]
    scale = dim ** -0.5
    expected = _expected(mx, q, whole_k, whole_v, whole_mask, scale)
    for lane_elements in (None, dim // 32):
        got = held_prefix_decode_attention(mx, *held, scale=scale,
                                           lane_elements=lane_elements)
        assert got.dtype == q.dtype and got.shape == q.shape
        assert mx.allclose(got.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()
    rep = q_heads // kv_heads
    for group in (1, 2, 4, 8, 16):  # a last group short of it where rows do not divide
        if group * rep > MOST_PREFIX_QUERIES or \
                (2 + dim) * (THREADS // 32) * rep * group * 4 > SHARED_BYTES:
            with pytest.raises(ValueError, match="rows_per_block"):
                held_prefix_decode_attention(mx, *held, scale=scale, rows_per_block=group)
            continue
        got = held_prefix_decode_attention(mx, *held, scale=scale, rows_per_block=group)
        assert mx.allclose(got.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item(), group


@cuda
def test_the_held_kernel_reads_a_prefix_view_and_ignores_what_masked_own_keys_hold():
    """The prefix as a window of a longer buffer (a slice, not copied), and NaN or
    infinite own keys and values where the mask is False: the same attention."""
    import mlx.core as mx

    (q, pk, pv, k, v, mask), _ = _held_case(mx, 4, 16, 8, 128, 1_000, 600, mx.bfloat16)
    clean = held_prefix_decode_attention(mx, q, pk[:, :, 100:900], pv[:, :, 100:900],
                                         k, v, mask, scale=0.1)
    copied = held_prefix_decode_attention(mx, q, mx.contiguous(pk[:, :, 100:900]),
                                          mx.contiguous(pv[:, :, 100:900]), k, v, mask,
                                          scale=0.1)
    assert mx.array_equal(clean, copied).item()
    masked = mx.pad(~mask[:, 0, 0, :, None][:, None], [(0, 0), (0, 0), (0, 40), (0, 0)])
    poisoned_k = mx.where(masked, mx.array(float("nan"), mx.bfloat16), k)
    poisoned_v = mx.where(masked, mx.array(float("inf"), mx.bfloat16), v)
    got = held_prefix_decode_attention(mx, q, pk[:, :, 100:900], pv[:, :, 100:900],
                                       poisoned_k, poisoned_v, mask, scale=0.1)
    assert mx.array_equal(got, clean).item()


def test_a_held_row_with_no_mask_goes_to_the_held_kernel_with_every_own_key_visible(
        monkeypatch):
    """One row with no padding decodes with no mask (``runtime.plain_masks``): over a
    layer holding its prefix once, the held kernel (a stand-in, as above) gets a mask
    with every own key visible, and the attention is that over the whole row."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    import runtime.cuda_decode_attention as route
    from runtime.held_prefix import hold_prefix_once

    masks = []

    def stand_in(mx_, queries, prefix_keys, prefix_values, keys, values, mask, *, scale):
        masks.append(mask)
        n_keys = mask.shape[-1]
        return shared_prefix_attention(mx_, queries, prefix_keys, prefix_values,
                                       keys[..., :n_keys, :], values[..., :n_keys, :],
                                       scale=scale, mask=mask)

    monkeypatch.setattr(route, "held_prefix_decode_attention", stand_in)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        mx.fast.scaled_dot_product_attention)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert install_prefill_attention(mx) and install_masked_decode(mx, "kernel")
    mx.random.seed(5)
    k, v = (mx.random.normal((1, 2, 69, 64)).astype(mx.bfloat16) for _ in range(2))
    held, whole = BatchKVCache(left_padding=[0]), BatchKVCache(left_padding=[0])
    for cache in (held, whole):
        cache.update_and_fetch(k, v)
    hold_prefix_once(mx, [held], 40)
    q, new_k, new_v, _ = _case(mx, 1, 4, 2, 64, 1, 1, mx.bfloat16, seed=2)
    for cache in (held, whole):
        cache.update_and_fetch(new_k, new_v)
    for mask in (None, "causal"):
        got = decode_attention(mx, q, held, scale=0.125, mask=mask)
        assert masks[-1].shape == (1, 1, 1, 30) and masks[-1].all().item()
        keys, values = whole.keys_and_values()
        expected = mx.fast.scaled_dot_product_attention(
            q.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32),
            scale=0.125)
        assert mx.allclose(got.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()
    assert len(masks) == 2
