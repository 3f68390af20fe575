"""A decoding batch's layers as rows join and leave (runtime.batch_layers): the same
caches as mlx-lm's own extend and filter make, each copied once."""

from __future__ import annotations

import tempfile

import mlx.core as mx
import mlx_lm
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache

from runtime import batch_layers, mlx_lm_batches
from runtime.mlx_lm_internals import filter_layers, layer_paddings, row_runs
from runtime.tiny_model import build_tiny_model


def _layers(seed: int, paddings: list[int], length: int, *, count: int = 2,
            heads: int = 2, dim: int = 4) -> list:
    """``count`` batch KV layers, rows left-padded by ``paddings``, ``length`` keys of
    random values (mlx-lm's buffer: ``length`` rounded up to its step of 256)."""
    layers = []
    for i in range(count):
        layer = BatchKVCache(list(paddings))
        k1, k2 = mx.random.split(mx.random.key(seed * 10 + i))
        shape = (len(paddings), heads, length, dim)
        layer.update_and_fetch(mx.random.normal(shape, key=k1), mx.random.normal(shape, key=k2))
        layers.append(layer)
    mx.eval([c.state for c in layers])
    return layers


def _state(layer) -> tuple:
    return (layer.keys.shape, layer.keys.tolist(), layer.values.tolist(),
            layer.offset.tolist(), layer.left_padding.tolist(), layer._idx)


@pytest.mark.parametrize(("mine", "theirs"), [
    (([2, 0, 1], 6), ([1], 9)),  # the joining row is longer: the batch's rows padded left
    (([0, 3], 200), ([4], 300)),  # and its buffer longer too (512 against 256)
    (([0], 300), ([5, 0], 301)),  # two rows join one longer by a key
    (([1, 0], 250), ([2], 260)),  # the batch's buffer is shorter, its _idx too
])
def test_a_join_that_pads_the_batch_makes_mlx_lms_layers(mine, theirs):
    ours, joining = _layers(1, *mine), _layers(2, *theirs)
    reference, reference_joining = _layers(1, *mine), _layers(2, *theirs)
    for c, o in zip(reference, reference_joining, strict=True):
        c.extend(o)
    assert batch_layers.extend_layers(ours, joining, layer_paddings(ours),
                                      layer_paddings(joining))
    for got, want in zip(ours, reference, strict=True):
        assert _state(got) == _state(want)
        assert got.left_padding.dtype == want.left_padding.dtype
    # a decode step after the join sees the same cache
    step = [mx.ones((len(mine[0]) + len(theirs[0]), 2, 1, 4))] * 2
    for got, want in zip(ours, reference, strict=True):
        assert got.update_and_fetch(*step)[0].tolist() == want.update_and_fetch(*step)[0].tolist()
        assert got.make_mask(1).tolist() == want.make_mask(1).tolist()


def test_joins_that_do_not_pad_the_batch_are_left_to_mlx_lm():
    """A joining row no longer than the batch's (mlx-lm's concatenation copies the
    batch once), a side with no keys yet, or a layer of another kind: declined,
    the layers as they were."""
    batch = _layers(1, [2, 0], 9)
    before = [_state(c) for c in batch]
    for joining in (_layers(2, [1], 6), [BatchKVCache([0]) for _ in range(2)]):
        assert not batch_layers.extend_layers(batch, joining, layer_paddings(batch),
                                              layer_paddings(joining))
    rotating = _layers(3, [1], 12)[:1] + [BatchRotatingKVCache(8, [0])]
    assert not batch_layers.extend_layers(batch, rotating, layer_paddings(batch),
                                          layer_paddings(rotating))
    assert [_state(c) for c in batch] == before


def test_a_join_that_pads_the_batch_holds_it_twice_not_three_times():
    """mlx-lm's extend materialises the batch's padded copy before concatenating it:
    the old arrays, the copy and the result at once. Written into one new array a
    layer, the peak is the old arrays and the result."""
    def peak_over_result(extend) -> float:
        batch = _layers(1, [0] * 4, 1000, count=1, heads=8, dim=64)  # 4 MB a layer
        joining = _layers(2, [0], 1064, count=1, heads=8, dim=64)
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        extend(batch, joining)
        mx.eval([c.state for c in batch])
        result = sum(c.keys.nbytes + c.values.nbytes for c in batch)
        return (mx.get_peak_memory() - before) / result

    def mlx_lms(batch, joining):
        for c, o in zip(batch, joining, strict=True):
            c.extend(o)

    def ours(batch, joining):
        assert batch_layers.extend_layers(batch, joining, layer_paddings(batch),
                                          layer_paddings(joining))

    assert peak_over_result(mlx_lms) > 1.5
    assert peak_over_result(ours) < 1.2


def _generation_batch(layers, rows: int, first: int = 0):
    batch = mlx_lm_batches.RowAwareGenerationBatch.empty(None, None)
    batch.prompt_cache = layers
    for name in ("uids", "tokens", "samplers", "logits_processors", "max_tokens",
                 "stop_sequences", "_next_logprobs", "_token_context", "_num_tokens",
                 "_matchers"):
        setattr(batch, name, [f"{name}{first + i}" for i in range(rows)])
    batch._next_tokens = mx.array(list(range(first, first + rows)))
    return batch


@pytest.mark.parametrize("longer", [True, False])
def test_the_generation_batch_joins_a_row_through_it_where_the_batch_is_padded(
        monkeypatch, longer):
    """A longer row joins the generation batch without mlx-lm's layer ``extend``; a
    shorter one through it. Either way the batch holds mlx-lm's layers, its other
    lists joined, and the joined row leaves with its own keys."""
    theirs = ([1], 12) if longer else ([1], 4)
    batch = _generation_batch(_layers(3, [2, 0], 6), 2)
    joining = _generation_batch(_layers(4, *theirs), 1, first=2)
    reference = _layers(3, [2, 0], 6)
    for c, o in zip(reference, _layers(4, *theirs), strict=True):
        c.extend(o)
    its_keys = [c.keys[:, :, 1:theirs[1]].tolist() for c in joining.prompt_cache]
    extended = []
    real_extend = BatchKVCache.extend

    def extend(self, other):
        extended.append(self)
        real_extend(self, other)

    extend.__wrapped__ = real_extend
    monkeypatch.setattr(BatchKVCache, "extend", extend)
    batch.extend(joining)
    assert len(extended) == (0 if longer else 2)
    assert [_state(c) for c in batch.prompt_cache] == [_state(c) for c in reference]
    assert batch.uids == ["uids0", "uids1", "uids2"]
    assert batch._next_tokens.tolist() == [0, 1, 2]
    assert joining.prompt_cache and len(joining.prompt_cache) == 2  # given back
    assert [c.keys.tolist() for c in batch.extract_cache(2)] == its_keys


@pytest.mark.parametrize(("rows", "runs"), [
    ([0, 1, 2], [(0, 3)]),
    ([0, 2, 3, 5], [(0, 1), (2, 4), (5, 6)]),
    ([4], [(4, 5)]),
    ([], []),
])
def test_rows_as_runs(rows, runs):
    assert row_runs(rows) == runs


def test_a_leave_copies_the_kept_rows_into_one_contiguous_array():
    """Several runs of kept rows are concatenated into a fresh array, rows in order,
    and the next step writes its token into it in place."""
    layers = _layers(5, [0, 1, 0, 2, 0], 300, count=1, heads=8, dim=64)
    keys = layers[0].keys
    keep = [0, 2, 3]
    want = [keys[i].tolist() for i in keep]
    filter_layers(layers, keep)
    layer = layers[0]
    assert [layer.keys[i].tolist() for i in range(3)] == want
    mx.eval(layer.keys, layer.values)
    kept = layer.keys.nbytes + layer.values.nbytes
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    token = mx.ones((3, 8, 1, 64))
    mx.eval(token)
    layer.update_and_fetch(token, token)
    mx.eval(layer.keys, layer.values)
    assert mx.get_peak_memory() - before < kept // 4


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(1, 48))
def test_rows_rolled_by_slices_are_mlx_lms_dynamic_roll(shifts, length):
    from mlx_lm.models.cache import dynamic_roll

    array = mx.random.normal((len(shifts), 2, length, 3), key=mx.random.key(len(shifts)))
    want = dynamic_roll(array, mx.array(shifts)[:, None], axis=2)
    assert batch_layers.rolled_rows(mx, array, shifts).tolist() == want.tolist()


@pytest.mark.parametrize("large", [False, True])
def test_a_prompt_batch_of_rows_of_different_lengths_rolls_them_by_slices(monkeypatch, large):
    """Rows that join a prompt batch with cached prefixes and chunks of different
    lengths: the batch's layers after the prompt are mlx-lm's, with no gather of the
    whole cache (``dynamic_roll``) on the way, a large batch's grown and rolled a layer
    at a time; a batch of equal chunks rolls nothing."""
    import mlx_lm.models.cache as cache_module
    from mlx_lm.generate import PromptProcessingBatch

    if large:
        monkeypatch.setattr(batch_layers, "large_batch_bytes", lambda mx_: 0)
    evaluated = []  # the arrays of each evaluation
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (evaluated.append(len(tree_flatten(a))),
                                                real_eval(*a))[1])

    with tempfile.TemporaryDirectory() as folder:
        model, _ = mlx_lm.load(str(build_tiny_model(folder)))

    def batch(cls, prefixes):
        caches = []
        for i, n in enumerate(prefixes):
            cache = [KVCache() for _ in model.layers]
            model(mx.array([[5 + i + j % 7 for j in range(n)]]), cache=cache)
            caches.append(cache)
        return cls(model=model, uids=list(range(len(prefixes))), caches=caches,
                   tokens=[[1] * n for n in prefixes], prefill_step_size=64, samplers=None,
                   fallback_sampler=lambda x: mx.argmax(x, axis=-1),
                   logits_processors=None, stop_sequences=None, max_tokens=[8] * len(prefixes))

    chunks = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]
    reference = batch(PromptProcessingBatch, [30, 24, 40])
    reference.prompt(chunks)
    ours = batch(mlx_lm_batches.RowAwarePromptBatch, [30, 24, 40])
    rolls = []
    real_roll = cache_module.dynamic_roll
    monkeypatch.setattr(cache_module, "dynamic_roll",
                        lambda *a, **k: (rolls.append(a), real_roll(*a, **k))[1])
    evaluated.clear()
    ours.prompt(chunks)
    assert not rolls
    # each layer's keys and values grown (its prefix at 40 keys, the chunk padded to 7)
    # and rolled on their own
    assert evaluated.count(2) == (2 * len(model.layers) if large else 0)
    for got, want in zip(ours.prompt_cache, reference.prompt_cache, strict=True):
        assert _state(got) == _state(want)
        assert "finalize" not in got.__dict__  # the class's own again
    equal = batch(mlx_lm_batches.RowAwarePromptBatch, [30, 24])
    equal.prompt([[1, 2], [3, 4]])
    assert all(type(c).finalize is BatchKVCache.finalize for c in equal.prompt_cache)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=4), st.integers(1, 300),
       st.lists(st.integers(0, 6), min_size=1, max_size=3), st.integers(1, 300))
def test_any_join_extend_layers_takes_is_mlx_lms(paddings, length, their_paddings, their_length):
    """Whatever the two sides' rows, lengths and buffers: where ``extend_layers`` takes a
    join it leaves the layers mlx-lm's ``extend`` leaves; where it declines, nothing
    changed."""
    paddings = [min(p, length - 1) for p in paddings]
    their_paddings = [min(p, their_length - 1) for p in their_paddings]
    ours, joining = _layers(1, paddings, length), _layers(2, their_paddings, their_length)
    before = [_state(c) for c in ours]
    reference, reference_joining = _layers(1, paddings, length), _layers(2, their_paddings, their_length)
    for c, o in zip(reference, reference_joining, strict=True):
        c.extend(o)
    if batch_layers.extend_layers(ours, joining, layer_paddings(ours), layer_paddings(joining)):
        assert [_state(c) for c in ours] == [_state(c) for c in reference]
    else:
        assert [_state(c) for c in ours] == before
        assert length >= their_length  # declined: mlx-lm would not pad the batch's rows
        assert -(-length // 256) >= -(-their_length // 256)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=2, max_size=6), st.data())
def test_any_leave_filters_as_mlx_lm_does(paddings, data):
    """Any rows kept, as runs of consecutive rows: the layers mlx-lm's ``filter`` leaves."""
    keep = sorted(data.draw(st.sets(st.integers(0, len(paddings) - 1), min_size=1)))
    ours, reference = _layers(3, paddings, 9), _layers(3, paddings, 9)
    filter_layers(ours, keep)
    for c in reference:
        c.filter(keep)
    assert [_state(c) for c in ours] == [_state(c) for c in reference]
