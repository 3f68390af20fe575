"""A large batch's KV copies and growth a layer at a time (runtime.batch_layers'
``layers_evaluated_in_turn`` and ``room_made``): the device holds the batch once and a
layer more, not twice, and every cache and every answer is what it was."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import BatchKVCache

from runtime import batch_layers
from tests.test_batch_layers import _generation_batch, _layers

LAYERS = 8


@pytest.fixture
def large(monkeypatch):
    """Every batch counts as large (its copies and growth a layer at a time)."""
    monkeypatch.setattr(batch_layers, "large_batch_bytes", lambda mx_: 0)


def _never_large(monkeypatch):
    monkeypatch.setattr(batch_layers, "large_batch_bytes", lambda mx_: 1 << 62)


def _held_twice(change, result) -> float:
    """What ``change()`` held at its peak beyond the larger of what was held before it
    and after it (a copy's old and new arrays at once), over ``result()``'s bytes: about
    the smaller side's share where the whole copy is evaluated at once, a layer's where
    it is evaluated a layer at a time."""
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    change()
    mx.synchronize()
    after = mx.get_active_memory()
    return (mx.get_peak_memory() - max(before, after)) / result()


def _held(layers) -> int:
    return sum(c.keys.nbytes + c.values.nbytes for c in layers)


def _same(ours: list, theirs: list) -> bool:
    """Whether two batches' layers hold the same buffers, keys, offsets and paddings."""
    return len(ours) == len(theirs) and all(
        a.keys.shape == b.keys.shape and a._idx == b._idx
        and all(mx.array_equal(getattr(a, n), getattr(b, n)).item()
                for n in ("keys", "values", "offset", "left_padding"))
        for a, b in zip(ours, theirs, strict=True))


def _big_layers(seed: int, rows: int, length: int) -> list:
    return _layers(seed, [0] * rows, length, count=LAYERS, heads=8, dim=64)


@pytest.mark.parametrize("is_large", [True, False])
def test_a_join_into_a_large_batch_holds_it_once_and_a_layer(monkeypatch, is_large):
    """A row longer than the batch's joins it (the batch padded, every layer copied):
    evaluated a layer at a time the copy's peak is about a layer of the result beyond
    the old batch, evaluated at once the whole result; the layers are the same."""
    if is_large:
        monkeypatch.setattr(batch_layers, "large_batch_bytes", lambda mx_: 0)
    else:
        _never_large(monkeypatch)
    batch = _generation_batch(_big_layers(1, 4, 1000), 4)
    joining = _generation_batch(_big_layers(2, 1, 1064), 1, first=4)
    reference = _big_layers(1, 4, 1000)
    for c, o in zip(reference, _big_layers(2, 1, 1064), strict=True):
        c.extend(o)

    def join():
        batch.extend(joining)
        mx.eval([c.state for c in batch.prompt_cache])

    twice = _held_twice(join, lambda: _held(batch.prompt_cache))
    if is_large:
        assert twice < 1.5 / LAYERS
    else:
        assert twice > 0.5  # the old batch is 0.64 of the new
    assert _same(batch.prompt_cache, reference)


def test_a_large_batchs_leave_copies_the_kept_rows_a_layer_at_a_time(large):
    batch = _generation_batch(_big_layers(3, 6, 900), 6)
    reference = _big_layers(3, 6, 900)
    keep = [0, 2, 3, 5]

    def leave():
        batch.filter(keep)
        mx.eval([c.state for c in batch.prompt_cache])

    assert _held_twice(leave, lambda: _held(batch.prompt_cache)) < 1.5 / LAYERS
    for c in reference:
        c.filter(keep)
    assert _same(batch.prompt_cache, reference)


def test_a_large_batch_grows_before_its_pass_a_layer_at_a_time(large):
    """At its buffer's end, a decoding batch's next key would make mlx-lm's
    ``update_and_fetch`` concatenate a block onto every layer inside the pass (all of
    them held twice until the pass ends); ``room_made`` grows them before it, a layer at
    a time, to what mlx-lm would have made."""
    layers = _big_layers(4, 4, 1024)
    reference = _big_layers(4, 4, 1024)
    assert layers[0]._idx == layers[0].keys.shape[2]  # no room for one more key
    grew = []

    def grow():
        grew.append(batch_layers.room_made(layers, 1))
        mx.eval([c.state for c in layers])

    assert _held_twice(grow, lambda: _held(layers)) < 1.5 / LAYERS
    assert grew == [True]
    assert not batch_layers.room_made(layers, 1)  # room now
    step = [mx.ones((4, 8, 1, 64))] * 2
    for got, want in zip(layers, reference, strict=True):
        buffer = got.keys.shape
        got.update_and_fetch(*step)
        want.update_and_fetch(*step)
        assert got.keys.shape == buffer  # no growth in the pass
    assert _same(layers, reference)


def test_a_small_batch_grows_in_its_pass_as_mlx_lm_grows_it(monkeypatch):
    _never_large(monkeypatch)
    layers = _layers(5, [0, 1], 256)
    keys = [c.keys for c in layers]
    assert not batch_layers.room_made(layers, 1)
    assert [c.keys for c in layers] == keys


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=4), st.integers(1, 700),
       st.integers(1, 600), st.sampled_from([256, 64, 512]))
def test_any_growth_room_made_makes_is_mlx_lms(paddings, length, tokens, step):
    """Whatever the keys held, the buffer's block (``step``; a lone prompt's room sets
    its own) and the tokens to come: grown by ``room_made`` and then written, a layer
    is what mlx-lm's ``update_and_fetch`` makes of it alone."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch_layers, "large_batch_bytes", lambda mx_: 0)
        ours, reference = _layers(6, paddings, length), _layers(6, paddings, length)
        for c in ours + reference:
            c.step = step
        batch_layers.room_made(ours, tokens)
        assert all(c._idx + tokens <= c.keys.shape[2] for c in ours)
        shape = (len(paddings), 2, tokens, 4)
        new = [mx.random.normal(shape, key=mx.random.key(7)),
               mx.random.normal(shape, key=mx.random.key(8))]
        for got, want in zip(ours, reference, strict=True):
            buffer = got.keys.shape
            fetched = got.update_and_fetch(*new)
            wanted = want.update_and_fetch(*new)
            assert got.keys.shape == buffer
            assert [a.tolist() for a in fetched] == [a.tolist() for a in wanted]
            assert (got.offset.tolist(), got._idx) == (want.offset.tolist(), want._idx)


def test_other_layer_types_are_left_to_grow_themselves(large):
    from mlx_lm.models.cache import BatchRotatingKVCache

    rotating = BatchRotatingKVCache(max_size=8, left_padding=[0])
    rotating.update_and_fetch(mx.zeros((1, 2, 8, 4)), mx.zeros((1, 2, 8, 4)))
    keys = rotating.keys
    assert not batch_layers.room_made([rotating], 1)
    assert rotating.keys is keys
    assert type(rotating) is not BatchKVCache


# ----------------------------------------------------------------- the engine

def test_the_engine_answers_the_same_with_every_batch_large(tiny_model_path, monkeypatch):
    """The engine as ``make_engine_core`` wires it, prefilling 64 tokens a chunk: prompts
    of different lengths prefilled together (their rows rolled), replies that cross
    the 256-key blocks, rows joining and leaving, one request aborted. With every batch
    counted large (copies and growth a layer at a time, leaving rows' places kept) each
    request gets the tokens it gets without, and the prompt batch and the decoding batch
    each grew before a pass."""
    import runtime.engine.loading as loading
    import runtime.engine_generator as engine_generator
    import runtime.mlx_lm_batches as mlx_lm_batches
    from runtime.config import ServerConfig
    from runtime.messages import SamplingParams
    from tests.test_vacant_rows import engine_run, user_submit

    def waves(core):
        def submit(i, text, max_tokens, **fields):
            return user_submit(core.handle.tokenizer, i, text, max_tokens, **fields)

        return {
            0: [submit(0, "alpha beta " * 110, 40), submit(1, "gamma " * 150, 120),
                submit(2, "delta epsilon " * 70, 90)],
            25: [submit(3, "zeta " * 240, 60), submit(4, "eta", 30)],
            70: [submit(5, "theta iota " * 60, 50,
                        sampling=SamplingParams(temperature=0.8, seed=4))],
        }

    grown = {"prompt": 0, "decode": 0}

    def counted(kind):
        def room_made(caches, tokens):
            made = batch_layers.room_made(caches, tokens)
            grown[kind] += made
            return made
        return room_made

    monkeypatch.setattr(mlx_lm_batches, "room_made", counted("prompt"))
    monkeypatch.setattr(engine_generator, "room_made", counted("decode"))
    results = {}
    for is_large in (False, True):
        # counted large, a batch also keeps leaving rows' places (runtime.vacant_rows)
        monkeypatch.setattr(loading, "large_batch_bytes",
                            (lambda mx_: 0) if is_large else (lambda mx_: 1 << 62))
        if is_large:
            monkeypatch.setattr(batch_layers, "large_batch_bytes", lambda mx_: 0)
        else:
            _never_large(monkeypatch)
        config = ServerConfig(model=tiny_model_path, prefill_step_size=64)
        core = loading.make_engine_core(config, tiny_model_path)
        results[is_large] = engine_run(core, waves(core), abort_at={40: 1})
        batch = core._batch._generation_batch
        reuse = (batch.lanes[0] if hasattr(batch, "lanes") else batch).row_reuse
        if is_large:
            assert reuse is not None and reuse.vacated >= 1
        else:
            assert grown == {"prompt": 0, "decode": 0}
            assert reuse is None or reuse.vacated == 0
    assert results[True] == results[False]
    assert all(r["failed"] is None for r in results[True].values())
    assert len(results[True][3]["tokens"]) == 60
    assert grown["prompt"] >= 1 and grown["decode"] >= 1
