"""The attention routes the engine installs on CUDA (runtime.cuda_attention), tested on
the CPU with CUDA's availability faked: which calls each route takes, and that every
route computes MLX's own attention."""

from __future__ import annotations

import pytest

import runtime.cuda_attention as cuda_attention
from runtime.cuda_attention import (
    KEY_ALIGNMENT,
    chunk_attention,
    in_place_chunk_limit,
    install_prefill_attention,
    unfused_prefill_attention,
)
from runtime.cuda_decode_attention import decode_attention, install_masked_decode


def _qkv(mx, batch, length, keys_length, dtype):
    """Grouped-query shapes as a prefill has them: 4 query heads over 2 KV heads."""
    mx.random.seed(3)
    q = mx.random.normal((batch, 4, length, 16)).astype(dtype)
    k = mx.random.normal((batch, 2, keys_length, 16)).astype(dtype)
    v = mx.random.normal((batch, 2, keys_length, 16)).astype(dtype)
    return q, k, v


def test_prefill_attention_goes_unfused_and_decoding_as_it_was():
    """Which calls the wrapper sends to MLX's unfused path (with ``scores="float32"``, a
    float32 query: cuDNN takes only half precision), which it passes on untouched, and
    that results keep their dtype."""
    import mlx.core as mx

    seen = []

    def fused(q, k, v, *, scale, mask=None):
        seen.append((q.dtype, q.shape[2], mask))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    attention = unfused_prefill_attention(fused, mx, limit=2 * 4 * 8 * 8, scores="float32")
    q, k, v = _qkv(mx, 2, 8, 8, mx.bfloat16)
    out = attention(q, k, v, scale=0.25, mask="causal")  # a prefill
    assert out.dtype == mx.bfloat16 and out.shape == q.shape
    assert seen.pop() == (mx.float32, 8, "causal")
    attention(q[:, :, :1], k, v, scale=0.25)  # a decode step
    assert seen.pop() == (mx.bfloat16, 1, None)
    q, k, v = _qkv(mx, 2, 9, 9, mx.bfloat16)  # scores over the limit: a long fresh prompt
    attention(q, k, v, scale=0.25, mask="causal")
    assert seen.pop() == (mx.bfloat16, 9, "causal")
    q, k, v = _qkv(mx, 1, 8, 8, mx.float32)  # not half precision: nothing to avoid
    attention(q, k, v, scale=0.25)
    assert seen.pop() == (mx.float32, 8, None)


@pytest.mark.parametrize("buffer_slack", [0, 3, 200])
def test_a_decode_step_s_attention_read_aligned_from_its_cache_matches_mlx(
        monkeypatch, buffer_slack):
    """Two rows decoding (one left-padded by 5) in a batch cache whose buffer ends
    ``buffer_slack`` keys after its last: with the grouped decode installed, the step's
    attention over the buffer up to an aligned length (grown where it is shorter) is
    MLX's attention over the cache's keys under mlx-lm's mask."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import BatchKVCache

    cache = BatchKVCache(left_padding=[5, 0])
    _, k, v = _qkv(mx, 2, 1, 69 + buffer_slack, mx.bfloat16)
    cache.update_and_fetch(k, v)
    cache.keys, cache.values = k, v  # the buffer exactly as long as written
    cache.trim(buffer_slack + 1)  # 69 - 1 keys kept, the rest stale past the end
    q, k, v = _qkv(mx, 2, 1, 1, mx.bfloat16)
    mask = create_attention_mask(q[:, 0, :, :1], cache)
    assert decode_attention(mx, q, cache, scale=0.25, mask=mask) is None  # not installed
    keys, values = cache.update_and_fetch(k, v)
    expected = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32),
        scale=0.25, mask=mask)
    _installed(monkeypatch)
    assert install_masked_decode(mx, "grouped")
    # Two rows of 69 keys are far below what pays at a real model's depth.
    assert decode_attention(mx, q, cache, scale=0.25, mask=mask) is None
    assert install_masked_decode(mx, "grouped", min_bytes=0)
    assert decode_attention(mx, q, cache, scale=0.25, mask=None) is None
    assert decode_attention(mx, q.astype(mx.float32), cache, scale=0.25, mask=mask) is None
    got = decode_attention(mx, q, cache, scale=0.25, mask=mask)
    assert got.dtype == mx.bfloat16 and got.shape == q.shape
    assert mx.allclose(got.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()
    assert cache.keys.shape[2] >= 128 and cache._idx == 69  # grown to the aligned length
    assert mx.array_equal(cache.keys[..., :69, :], keys).item()


def test_grouped_decode_installs_on_cuda_alone_or_beside_the_prefill_route(monkeypatch):
    import mlx.core as mx

    original = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", original)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert not install_masked_decode(mx, "grouped")
    assert mx.fast.scaled_dot_product_attention is original
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert install_masked_decode(mx, "grouped")
    installed = mx.fast.scaled_dot_product_attention
    # Decode alone: a prefill keeps MLX's way, and no chunk reads its keys in place.
    assert installed.grouped_decode and not installed.prefill and not installed.grouped
    assert install_prefill_attention(mx, full_chunk=64) and install_masked_decode(mx, "grouped")
    assert mx.fast.scaled_dot_product_attention is installed
    assert installed.prefill and installed.grouped and installed.grouped_decode
    assert installed.full_chunk == 64


def test_unfused_prefill_attention_computes_the_same_attention():
    """Against MLX's own attention, with a causal mask over a cached prefix and with an
    additive mask as a padded prefill group has; bfloat16's precision."""
    import mlx.core as mx

    fused = mx.fast.scaled_dot_product_attention
    q, k, v = _qkv(mx, 2, 6, 10, mx.bfloat16)
    padding = mx.where(mx.arange(10) < 2, -mx.inf, 0.0).astype(mx.bfloat16)
    for scores in ("half", "float32"):
        attention = unfused_prefill_attention(fused, mx, scores=scores)
        for mask in ("causal", padding[None, None, None, :]):
            expected = fused(q, k, v, scale=0.25, mask=mask).astype(mx.float32)
            got = attention(q, k, v, scale=0.25, mask=mask)
            assert got.dtype == mx.bfloat16
            assert mx.allclose(got.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()


@pytest.mark.parametrize("n_keys", [10, 64])  # padded to 64 keys, and aligned already
def test_grouped_attention_matches_mlx_for_every_mask_a_prefill_has(n_keys):
    """Causal over a cached prefix, a padded group's boolean mask (one for all heads and
    one per head), a row-only mask and an additive one: the same attention as MLX's in
    float32, within bfloat16's precision; values may have a head size of their own."""
    import mlx.core as mx

    from runtime.cuda_attention import grouped_attention

    reference = mx.fast.scaled_dot_product_attention
    q, k, v = _qkv(mx, 2, 6, n_keys, mx.bfloat16)
    wide = mx.concatenate([v, v[..., :8]], axis=-1)  # 24 value dimensions, 16 query
    causal = mx.arange(n_keys)[None, :] <= (mx.arange(6)[:, None] + n_keys - 6)
    padding = mx.arange(n_keys) >= 2
    per_row = mx.stack([causal & padding, causal])[:, None]  # the first row padded by 2
    masks = ("causal", None, per_row, mx.broadcast_to(per_row, (2, 4, 6, n_keys)),
             padding[None, None, None, :], causal,
             mx.where(padding, 0.0, -mx.inf)[None, None, None, :].astype(mx.bfloat16))
    for values in (v, wide):
        for mask in masks:
            additive = isinstance(mask, mx.array) and mask.dtype == mx.bfloat16
            as_float = mask.astype(mx.float32) if additive else mask
            expected = reference(q.astype(mx.float32), k.astype(mx.float32),
                                 values.astype(mx.float32), scale=0.25, mask=as_float)
            got = grouped_attention(mx, q, k, values, scale=0.25, mask=mask)
            assert got.dtype == mx.bfloat16 and got.shape == expected.shape
            assert mx.allclose(got.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()


def test_grouped_attention_pads_the_keys_to_the_alignment():
    """Keys of another length than a multiple of ``KEY_ALIGNMENT`` are padded to one
    (the GPU's fast matrix kernels need it); aligned ones are not copied."""
    import mlx.core as mx

    from runtime.cuda_attention import KEY_ALIGNMENT, grouped_attention

    class Padding:
        def __init__(self):
            self.shapes = []

        def __getattr__(self, name):
            return getattr(mx, name)

        def pad(self, array, widths, **kwargs):
            out = mx.pad(array, widths, **kwargs)
            self.shapes.append(out.shape)
            return out

    for n_keys, padded in ((10, KEY_ALIGNMENT), (KEY_ALIGNMENT + 3, 2 * KEY_ALIGNMENT),
                           (KEY_ALIGNMENT, None)):
        q, k, v = _qkv(mx, 1, 6, n_keys, mx.bfloat16)
        spy = Padding()
        grouped_attention(spy, q, k, v, scale=0.25, mask="causal")
        if padded is None:
            assert spy.shapes == []
        else:
            assert (1, 2, padded, 16) in spy.shapes  # keys and values


def test_grouped_attention_keeps_a_row_that_sees_no_key_finite():
    """A padded group's padding rows see no key at all: their output must stay finite,
    since the next layer's keys at those positions meet zero weights (0 x NaN is NaN)."""
    import mlx.core as mx

    from runtime.cuda_attention import grouped_attention

    q, k, v = _qkv(mx, 1, 6, 10, mx.bfloat16)
    nothing = mx.zeros((1, 1, 6, 10), dtype=mx.bool_)
    assert not mx.isnan(grouped_attention(mx, q, k, v, scale=0.25, mask=nothing)).any().item()
    assert grouped_attention(mx, q, k, v, scale=0.25, mask=nothing[0]) is None  # (B, L, S)


def test_attention_sinks_keep_mlx_s_path(monkeypatch):
    """grouped_attention takes no sinks: such a call goes through MLX's fallback."""
    import mlx.core as mx

    seen = []

    def fused(q, k, v, *, scale, mask=None, sinks=None):
        seen.append((q.dtype, sinks is not None))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    monkeypatch.setattr(cuda_attention, "grouped_attention", lambda *a, **k: seen.append("grouped"))
    attention = unfused_prefill_attention(fused, mx)
    q, k, v = _qkv(mx, 1, 6, 6, mx.bfloat16)
    attention(q, k, v, scale=0.25, mask="causal", sinks=mx.zeros((4,)))
    assert seen == [(mx.float32, True)]


def test_install_prefill_attention_only_on_cuda(monkeypatch):
    import mlx.core as mx

    original = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert install_prefill_attention(mx) is False
    assert mx.fast.scaled_dot_product_attention is original
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", original)  # restored after
    assert install_prefill_attention(mx) is True
    wrapped = mx.fast.scaled_dot_product_attention
    assert wrapped.fused is original
    assert install_prefill_attention(mx) is True  # a second engine in the process: once
    assert mx.fast.scaled_dot_product_attention is wrapped


def test_mlx_lm_models_reach_the_installed_attention(monkeypatch, tiny_model_path):
    """mlx-lm's models look ``mx.fast.scaled_dot_product_attention`` up at each call: a
    prefill through a real model goes through the wrapper (were a model to bind the
    function at import, the server would silently keep cuDNN's per-shape graphs)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    original = mx.fast.scaled_dot_product_attention
    queries = []

    def counting(q, *args, **kwargs):
        queries.append((q.dtype, q.shape[2]))
        return original(q, *args, **kwargs)

    grouped = cuda_attention.grouped_attention

    def counting_grouped(mx_, q, *args, **kwargs):
        queries.append(("grouped", q.shape[2]))
        return grouped(mx_, q, *args, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counting)
    monkeypatch.setattr(cuda_attention, "grouped_attention", counting_grouped)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert install_prefill_attention(mx)
    model, _ = load(tiny_model_path)
    model.set_dtype(mx.bfloat16)  # as served models are
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5, 6, 7, 8]]), cache=cache))  # a prefill
    mx.eval(model(mx.array([[9]]), cache=cache))  # a decode step
    layers = len(model.layers)
    assert queries == [("grouped", 4)] * layers + [(mx.bfloat16, 1)] * layers


def _installed(monkeypatch):
    """The server's prefill attention installed as on CUDA, undone after the test."""
    import mlx.core as mx

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", mx.fast.scaled_dot_product_attention)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert install_prefill_attention(mx)


def test_a_real_model_computes_the_same_logits_through_grouped_attention(monkeypatch, tiny_model_path):
    """A padded prefill group of two prompts, then a chunk after each one's cached
    prefix and a decode step, through mlx-lm's batch caches and the tiny model in
    bfloat16: the logits with the server's attention routes installed match MLX's own
    attention."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import BatchKVCache

    from runtime.compiled_decode import install_compiled_decode

    model, _ = load(tiny_model_path)
    model.set_dtype(mx.bfloat16)
    layers = len(model.layers)
    first = mx.array([[0, 0, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]])
    then = mx.array([[19, 20, 21], [22, 23, 24]])

    def logits():
        cache = [BatchKVCache(left_padding=[2, 0]) for _ in range(layers)]
        out = [model(first, cache=cache), model(then, cache=cache)]
        out.append(model(mx.array([[25], [26]]), cache=cache))  # a decode step, masked
        mx.eval(out)
        return [o.astype(mx.float32) for o in out]

    install_compiled_decode(model)  # the engine's decode path, which reads the route
    expected = logits()
    _installed(monkeypatch)
    assert install_masked_decode(mx, "grouped", min_bytes=0)  # a tiny model's step
    got = logits()
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape
        assert mx.allclose(g, e, atol=0.1, rtol=0.05).item()
        assert (mx.argmax(g, axis=-1) == mx.argmax(e, axis=-1)).mean().item() > 0.9


def test_a_pass_s_layers_share_one_mask_and_another_source_gets_its_own():
    """Each layer of a forward pass calls the attention with the same mask: it is
    brought to the products' layout (and padded) once; a new mask of the same shape,
    as the next pass has, is made anew, and each gives MLX's attention."""
    import mlx.core as mx

    from runtime.cuda_attention import _key_mask, grouped_attention

    q, k, v = _qkv(mx, 2, 6, 10, mx.bfloat16)
    first = (mx.arange(10)[None, :] <= (mx.arange(6)[:, None] + 4))[None, None]
    second = mx.broadcast_to(mx.arange(10) >= 3, (1, 1, 6, 10))
    shape = dict(heads=4, kv_heads=2, length=6, n_keys=10, padding=54, dtype=mx.bfloat16)
    made = _key_mask(mx, first, **shape)
    assert _key_mask(mx, first, **shape) is made
    assert _key_mask(mx, second, **shape) is not made
    for mask in (first, second, first):
        expected = mx.fast.scaled_dot_product_attention(
            q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32),
            scale=0.25, mask=mask)
        got = grouped_attention(mx, q, k, v, scale=0.25, mask=mask)
        assert mx.allclose(got.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()


@pytest.mark.parametrize("prefix", [61, 64, 250])
@pytest.mark.parametrize("left_padding", [[2, 0], [0]])
def test_a_chunk_s_attention_read_from_its_cache_matches_mlx(monkeypatch, prefix, left_padding):
    """A chunk of 5 tokens after a cached prefix, in a batch cache of two rows (one
    left-padded by 2) or of one: read in place from the cache's buffer up to the
    aligned length, the same attention as MLX's over the cache's keys with mlx-lm's
    mask. One row without padding sees its whole prefix, so only the scores from the
    aligned block the chunk starts in are masked."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import BatchKVCache

    _installed(monkeypatch)
    rows = len(left_padding)
    cache = BatchKVCache(left_padding=left_padding)
    _, k, v = _qkv(mx, rows, 1, prefix, mx.bfloat16)
    cache.update_and_fetch(k, v)
    q, k, v = _qkv(mx, rows, 5, 5, mx.bfloat16)
    attention = chunk_attention(mx, cache, length=5, heads=4, dtype=mx.bfloat16)
    mask = create_attention_mask(q[:, 0, :, :1], cache)  # mlx-lm's, before the update
    keys, values = cache.update_and_fetch(k, v)
    assert attention.n_keys % KEY_ALIGNMENT == 0 and attention.n_keys >= prefix + 5
    assert attention.visible_keys == (prefix // KEY_ALIGNMENT * KEY_ALIGNMENT if rows == 1 else 0)
    got = attention(q, cache, scale=0.25)
    expected = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32),
        scale=0.25, mask=mask)
    assert got.dtype == mx.bfloat16 and got.shape == q.shape
    assert mx.allclose(got.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()
    cache.keys, cache.values = keys, values  # a buffer no longer than the keys
    if keys.shape[2] % KEY_ALIGNMENT:
        assert attention(q, cache, scale=0.25) is None


def test_a_chunk_s_attention_in_place_only_where_the_grouped_attention_is_installed(monkeypatch):
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    cache = BatchKVCache(left_padding=[0])
    cache.update_and_fetch(*_qkv(mx, 1, 1, 100, mx.bfloat16)[1:])
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", mx.fast.scaled_dot_product_attention)
    assert chunk_attention(mx, cache, length=8, heads=4, dtype=mx.bfloat16) is None
    _installed(monkeypatch)
    assert chunk_attention(mx, cache, length=8, heads=4, dtype=mx.bfloat16) is not None
    assert chunk_attention(mx, cache, length=8, heads=4, dtype=mx.float32) is None
    assert chunk_attention(mx, cache, length=1, heads=4, dtype=mx.bfloat16) is None
    # Scores past the block limit keep the installed path (its blocks).
    assert chunk_attention(mx, cache, length=1 << 13, heads=1 << 10, dtype=mx.bfloat16) is None


def test_a_chunk_after_a_cached_prefix_goes_unfused_in_blocks():
    """Past the scores limit, a chunk with more keys than queries goes to the unfused
    path in blocks of queries (each within the block limit) and computes the same
    attention, causal or with an array mask; a fresh prompt past the limit does not."""
    import mlx.core as mx

    seen = []

    def fused(q, k, v, *, scale, mask=None):
        seen.append((q.dtype, q.shape[2], k.shape[2]))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    reference = mx.fast.scaled_dot_product_attention
    # 2 x 4 rows of scores: blocks of 3 queries against 20 keys stay within 2*4*3*20
    attention = unfused_prefill_attention(fused, mx, limit=2 * 4 * 7, block_limit=2 * 4 * 3 * 20,
                                          scores="float32")
    q, k, v = _qkv(mx, 2, 7, 20, mx.bfloat16)  # 7 new tokens after 13 cached
    causal = mx.arange(20)[None, :] <= (mx.arange(7)[:, None] + 13)
    padding = mx.arange(20) >= 2  # the first two keys are a padded row's
    masks = ("causal", (causal & padding)[None, None], padding[None, None, None, :])
    for mask in masks:
        seen.clear()
        got = attention(q, k, v, scale=0.25, mask=mask)
        assert got.dtype == mx.bfloat16 and got.shape == q.shape
        assert [s[0] for s in seen] == [mx.float32] * 3 and [s[1] for s in seen] == [3, 3, 1]
        if isinstance(mask, str):  # each block meets the keys up to its last query
            assert [s[2] for s in seen] == [16, 19, 20]
        expected = reference(q, k, v, scale=0.25, mask=mask).astype(mx.float32)
        assert mx.allclose(got.astype(mx.float32), expected, atol=2e-2, rtol=2e-2).item()
    seen.clear()
    q, k, v = _qkv(mx, 2, 20, 20, mx.bfloat16)  # a fresh prompt past the limit
    attention(q, k, v, scale=0.25, mask="causal")
    assert seen == [(mx.bfloat16, 20, 20)]
    seen.clear()  # a chunk longer than a paced one keeps MLX's choice
    attention = unfused_prefill_attention(fused, mx, limit=2 * 4 * 7, block_queries=6,
                                          scores="float32")
    q, k, v = _qkv(mx, 2, 7, 20, mx.bfloat16)
    attention(q, k, v, scale=0.25, mask="causal")
    assert seen == [(mx.bfloat16, 7, 20)]


class _ContiguousCalls:
    """``mlx.core`` with ``contiguous`` counted: which arrays the wrapper made contiguous."""

    def __init__(self):
        import mlx.core as mx
        self._mx, self.shapes = mx, []

    def __getattr__(self, name):
        return getattr(self._mx, name)

    def contiguous(self, a):
        self.shapes.append(tuple(a.shape))
        return self._mx.contiguous(a)


def test_a_fresh_prompt_s_full_chunks_reach_cudnn_with_contiguous_keys():
    """A chunk of more than ``recurring_queries`` queries whose prefix is a whole number
    of chunks goes to the fused attention (cuDNN on CUDA), not in blocks; every prefill
    call sent there gets its keys and values contiguous (sliced from a longer buffer,
    as a prompt batch's are), and the result is MLX's attention. Decoding is untouched."""
    import mlx.core as mx

    seen = []

    def fused(q, k, v, *, scale, mask=None):
        seen.append((q.shape[2], k.shape[2]))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    counted = _ContiguousCalls()
    attention = unfused_prefill_attention(fused, counted, limit=2 * 4 * 7, recurring_queries=4)
    q, k_buffer, v_buffer = _qkv(mx, 2, 8, 40, mx.bfloat16)
    k, v = k_buffer[:, :, :24], v_buffer[:, :, :24]  # a 40-token buffer holding 24
    got = attention(q, k, v, scale=0.25, mask="causal")  # the third 8-token chunk
    assert seen == [(8, 24)] and counted.shapes == [(2, 4, 8, 16)] + [(2, 2, 24, 16)] * 2
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert mx.allclose(got.astype(mx.float32), expected.astype(mx.float32), atol=2e-2).item()
    seen.clear(), counted.shapes.clear()
    attention(q, k_buffer[:, :, :8], v_buffer[:, :, :8], scale=0.25, mask="causal")  # the first
    assert seen == [(8, 8)] and counted.shapes == [(2, 4, 8, 16)] + [(2, 2, 8, 16)] * 2
    seen.clear(), counted.shapes.clear()
    attention(q, k_buffer[:, :, :20], v_buffer[:, :, :20], scale=0.25, mask="causal")
    assert seen == [] and counted.shapes == []  # after 12 cached: grouped, in blocks
    attention(q[:, :, :4], k_buffer[:, :, :12], v_buffer[:, :, :12], scale=0.25, mask="causal")
    assert seen == [] and counted.shapes == []  # 4 queries, not over recurring_queries
    attention(q[:, :, :1], k, v, scale=0.25)  # a decode step
    assert seen[-1] == (1, 24) and counted.shapes == []


def test_a_lone_prompt_s_odd_chunk_on_the_grid_reaches_cudnn_padded_to_a_full_chunk():
    """Under the causal mask, a chunk of more than a quarter of ``full_chunk`` queries
    after a whole number of full chunks (a lone prompt's last, odd-sized chunk, or a
    fresh prompt shorter than one chunk: padded at the end) or ending at one (a chunk
    that brings the prefix back to the grid: padded at the front) reaches the fused
    attention as a full chunk, the shape a full chunk has there; the real queries'
    outputs are MLX's attention of the unpadded chunk. Shorter chunks, array masks and
    chunks off the grid at both ends keep their paths, and without ``full_chunk``
    nothing is padded."""
    import mlx.core as mx

    seen = []

    def fused(q, k, v, *, scale, mask=None):
        seen.append((q.shape[2], k.shape[2]))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    attention = unfused_prefill_attention(fused, mx, limit=2 * 4 * 7, recurring_queries=4,
                                          full_chunk=8)
    q, k_buffer, v_buffer = _qkv(mx, 2, 8, 40, mx.bfloat16)
    for prefix, length in ((16, 6), (0, 7), (8, 3), (11, 5), (19, 5)):
        k, v = k_buffer[:, :, :prefix + length], v_buffer[:, :, :prefix + length]
        got = attention(q[:, :, :length], k, v, scale=0.25, mask="causal")
        # At the end (keys padded too) where the prefix is on the grid, else at the front.
        assert seen.pop() == (8, prefix + 8 if prefix % 8 == 0 else prefix + length)
        expected = mx.fast.scaled_dot_product_attention(q[:, :, :length], k, v, scale=0.25,
                                                        mask="causal")
        assert got.shape == expected.shape
        assert mx.allclose(got.astype(mx.float32), expected.astype(mx.float32),
                           atol=2e-2).item()
    attention(q[:, :, :2], k_buffer[:, :, :18], v_buffer[:, :, :18], scale=0.25,
              mask="causal")  # a quarter of a chunk or less: grouped, in blocks
    attention(q[:, :, :5], k_buffer[:, :, :18], v_buffer[:, :, :18], scale=0.25,
              mask="causal")  # after 13 cached, off the grid of full chunks
    array_mask = mx.arange(16, 22)[:, None] >= mx.arange(22)[None]
    attention(q[:, :, :6], k_buffer[:, :, :22], v_buffer[:, :, :22], scale=0.25,
              mask=array_mask)  # several prompts padded together
    assert seen == []
    attention.full_chunk = None
    attention(q[:, :, :6], k_buffer[:, :, :22], v_buffer[:, :, :22], scale=0.25, mask="causal")
    assert seen == []


@pytest.mark.parametrize("rows,heads,prefix", [(1, 16, 0), (1, 16, 16_000), (1, 16, 30_000),
                                               (4, 32, 12_000), (1, 64, 120_000)])
def test_the_in_place_limit_is_the_longest_chunk_read_in_place(monkeypatch, rows, heads, prefix):
    """``in_place_chunk_limit`` gives the longest chunk that ``chunk_attention`` takes in
    place after ``prefix`` keys; none without the grouped attention installed."""
    from types import SimpleNamespace

    import mlx.core as mx

    original = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", original)  # restored after
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert in_place_chunk_limit(mx, heads=heads, rows=rows, prefix=prefix) is None
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert install_prefill_attention(mx)
    limit = in_place_chunk_limit(mx, heads=heads, rows=rows, prefix=prefix)
    cache = SimpleNamespace(_idx=prefix, left_padding=mx.zeros((rows,), dtype=mx.int32))

    def in_place(length):
        return chunk_attention(mx, cache, length=length, heads=heads, dtype=mx.bfloat16)

    assert in_place(limit) is not None and in_place(limit + 1) is None
    if prefix >= 16_000 and heads == 16 and rows == 1:  # a 30k prompt's paced chunks
        assert 256 <= limit < 512


class _PadCalls:
    """``mlx.core`` with ``pad`` counted by the padded array's shape."""

    def __init__(self):
        import mlx.core as mx
        self._mx, self.shapes = mx, []

    def __getattr__(self, name):
        return getattr(self._mx, name)

    def pad(self, a, *args, **kwargs):
        self.shapes.append(tuple(a.shape))
        return self._mx.pad(a, *args, **kwargs)


@pytest.mark.parametrize("masked", ["array", "padding-row", "none"])
def test_blocks_that_meet_every_key_align_the_keys_once(masked):
    """Past the scores limit, a chunk under an array mask (or none) goes in blocks of
    queries that all meet every key: the keys and values are padded to the alignment
    once for all blocks, not once a block, and each block's output is what
    ``grouped_attention`` gives it on its own."""
    import mlx.core as mx

    from runtime.cuda_attention import grouped_attention

    counted = _PadCalls()
    attention = unfused_prefill_attention(lambda *a, **k: None, counted, limit=2 * 4 * 7,
                                          block_limit=2 * 4 * 3 * 20)
    q, k, v = _qkv(mx, 2, 7, 20, mx.bfloat16)  # 7 queries after 13 cached: 20 keys, not aligned
    causal = mx.arange(20)[None, :] <= (mx.arange(7)[:, None] + 13)
    rows = mx.array([2, 0])[:, None, None, None] <= mx.arange(20)  # row 0 padded by 2
    mask = {"array": causal[None, None] & rows, "padding-row": rows,
            "none": None}[masked]
    got = attention(q, k, v, scale=0.25, mask=mask)
    keys_padded = [s for s in counted.shapes if s == k.shape]
    assert len(keys_padded) == 2  # the keys and the values, once
    blocks = [grouped_attention(mx, q[:, :, start:start + 3], k, v, scale=0.25,
                                mask=None if mask is None else (
                                    mask[..., start:start + 3, :] if mask.shape[-2] > 1 else mask))
              for start in range(0, 7, 3)]
    assert mx.array_equal(got, mx.concatenate(blocks, axis=2)).item()
    reference = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert mx.allclose(got.astype(mx.float32), reference.astype(mx.float32),
                       atol=2e-2, rtol=2e-2).item()


@pytest.mark.parametrize("rows", [1, 3])
def test_causal_blocks_align_the_keys_once(rows):
    """Past the scores limit, a chunk under ``"causal"`` after a cached prefix (a lone
    prompt's, or several unpadded rows', ``runtime.plain_masks``) goes in blocks of
    queries (here five of 18) with the keys and values padded to the alignment once,
    not once a block, and the attention is MLX's causal one."""
    import mlx.core as mx

    counted = _PadCalls()
    attention = unfused_prefill_attention(lambda *a, **k: None, counted, limit=rows * 4 * 7,
                                          block_limit=rows * 4 * 18 * 150)
    q, k, v = _qkv(mx, rows, 90, 150, mx.bfloat16)  # 90 queries after 60 cached: 150 keys
    got = attention(q, k, v, scale=0.25, mask="causal")
    assert counted.shapes == [k.shape, v.shape]  # to 192 keys, once
    reference = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert got.shape == q.shape and got.dtype == mx.bfloat16
    assert mx.allclose(got.astype(mx.float32), reference.astype(mx.float32),
                       atol=2e-2, rtol=2e-2).item()


def test_causal_in_blocks_is_mlx_s_causal_attention_for_any_block():
    """``causal_in_blocks`` at any block size, key count and alignment: MLX's attention
    under ``"causal"``, queries past a prefix or a fresh prompt (as many queries as keys),
    a KV head shared by several query heads."""
    import mlx.core as mx

    from runtime.cuda_attention import causal_in_blocks

    for batch, length, n_keys, block in ((2, 7, 20, 3), (3, 130, 200, 50), (1, 64, 64, 16),
                                         (2, 100, 700, 33), (2, 5, 5, 1)):
        q, k, v = _qkv(mx, batch, length, n_keys, mx.bfloat16)
        got = causal_in_blocks(mx, q, k, v, scale=0.25, block=block)
        reference = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
        assert mx.allclose(got.astype(mx.float32), reference.astype(mx.float32),
                           atol=2e-2, rtol=2e-2).item(), (batch, length, n_keys, block)
