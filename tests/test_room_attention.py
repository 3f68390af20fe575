"""A lone prompt's paced chunk attended in one fused call over its whole room
(runtime.room_attention), on real mlx (CPU): the same attention as over the keys it
sees, rooms reserved in whole blocks, the tokens of the engine's own generator with
and without it, and the cases that keep the chunk's attention as it was."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache

import runtime.room_attention as room_module
from runtime.room_attention import ROOM_BLOCK, RoomAttention, room_attention, room_tokens

HEADS, KV_HEADS, WIDTH = 4, 2, 16


def lone_cache(prefix: int, room: int, dtype=mx.float32, seed: int = 0) -> BatchKVCache:
    """One prompt's cache holding ``prefix`` keys in a buffer of ``room`` (zeros past them)."""
    cache = BatchKVCache(left_padding=[0])
    cache.step = room
    rng = np.random.default_rng(seed)
    if prefix:
        keys, values = (mx.array(rng.standard_normal((1, KV_HEADS, prefix, WIDTH)), dtype=dtype)
                        for _ in range(2))
        cache.update_and_fetch(keys, values)
    del cache.step
    return cache


def update(cache: BatchKVCache, keys, values, room: int):
    """The chunk's keys into ``cache``, whose buffer grows (if it must) to ``room`` as
    ``runtime.mlx_lm_batches``' reserved room does."""
    cache.step = room - cache._idx
    try:
        return cache.update_and_fetch(keys, values)
    finally:
        del cache.step


def chunk(length: int, dtype=mx.float32, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [mx.array(rng.standard_normal((1, h, length, WIDTH)), dtype=dtype)
            for h in (HEADS, KV_HEADS, KV_HEADS)]


@pytest.mark.parametrize(("prefix", "length"), [(0, 64), (1000, 64), (4000, 96)])
def test_the_room_s_attention_is_the_attention_over_the_keys_the_chunk_sees(prefix, length):
    room = room_tokens(prefix + length, ROOM_BLOCK)
    cache = lone_cache(prefix, room)
    queries, keys, values = chunk(length)
    attention = room_attention(mx, cache, length=length, dtype=mx.bfloat16)
    assert isinstance(attention, RoomAttention)
    seen_keys, seen_values = update(cache, keys, values, room)
    assert cache.keys.shape[2] == room
    ours = attention(queries, cache, scale=0.25)
    expected = scaled_dot_product_attention(queries, seen_keys, seen_values, cache=None,
                                            scale=0.25, mask="causal")
    np.testing.assert_allclose(np.array(ours), np.array(expected), atol=1e-5)
    # One mask for every layer of the pass.
    assert attention.mask(room, queries.dtype) is attention.mask(room, queries.dtype)


def test_in_half_precision_too():
    cache = lone_cache(900, ROOM_BLOCK, mx.bfloat16)
    queries, keys, values = chunk(64, mx.bfloat16)
    attention = room_attention(mx, cache, length=64, dtype=mx.bfloat16)
    seen_keys, seen_values = cache.update_and_fetch(keys, values)
    ours = attention(queries, cache, scale=0.25).astype(mx.float32)
    expected = scaled_dot_product_attention(queries, seen_keys, seen_values, cache=None,
                                            scale=0.25, mask="causal").astype(mx.float32)
    np.testing.assert_allclose(np.array(ours), np.array(expected), atol=3e-2)


def test_chunks_that_keep_their_attention_as_it_was():
    cache = lone_cache(100, ROOM_BLOCK)
    assert room_attention(mx, cache, length=64, dtype=mx.float32) is None  # not half
    assert room_attention(mx, cache, length=1, dtype=mx.bfloat16) is None
    padded = BatchKVCache(left_padding=[3])
    assert room_attention(mx, padded, length=64, dtype=mx.bfloat16) is None
    several = BatchKVCache(left_padding=[0, 0])
    assert room_attention(mx, several, length=64, dtype=mx.bfloat16) is None
    # A buffer of mlx-lm's own growth (not whole blocks): the caller's attention instead.
    grown = lone_cache(100, 256)
    attention = room_attention(mx, grown, length=64, dtype=mx.bfloat16)
    queries, keys, values = chunk(64)
    grown.update_and_fetch(keys, values)
    assert attention(queries, grown, scale=0.25) is None


def test_a_room_the_fused_call_cannot_take_falls_back_once_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(room_module, "_tried", {})

    def fails(*args, **kwargs):
        raise ValueError("no graph for this shape")

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", fails)
    cache = lone_cache(100, ROOM_BLOCK)
    attention = room_attention(mx, cache, length=64, dtype=mx.bfloat16)
    queries, keys, values = chunk(64)
    cache.update_and_fetch(keys, values)
    with caplog.at_level(logging.WARNING, logger="runtime.room_attention"):
        assert attention(queries, cache, scale=0.25) is None
        assert attention(queries, cache, scale=0.25) is None
    assert len([r for r in caplog.records if "fused call" in r.getMessage()]) == 1


def test_rooms_are_whole_blocks():
    assert room_tokens(1, 4096) == 4096
    assert room_tokens(4096, 4096) == 4096
    assert room_tokens(4097, 4096) == 8192
    assert room_tokens(700, 256) == 768


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from runtime.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("room") / "llama"))


def test_a_lone_prompt_beside_decoding_rows_gives_the_same_tokens_over_its_room(
        tiny_model, monkeypatch):
    """The engine's generator in half precision: a lone prompt's paced chunks beside
    three decoding rows attend over a room of whole blocks, and every sequence gets the
    tokens it gets with the chunks' attention as it was."""
    from mlx_lm import load

    from runtime.batch_sampling import BatchSampler, make_batch_generator
    from runtime.compiled_decode import install_compiled_decode
    from tests.test_mixed_step import lone_prompt_beside_rows

    rooms, calls = [], []
    real_call = RoomAttention.__call__

    def call(self, queries, cache, *, scale):
        rooms.append(cache.keys.shape[2])
        out = real_call(self, queries, cache, scale=scale)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(RoomAttention, "__call__", call)
    tokens = {}
    for room in (False, True):
        model, _ = load(tiny_model)
        model.set_dtype(mx.bfloat16)
        install_compiled_decode(model)
        gen = make_batch_generator(model, sampler=BatchSampler(), chunk_pass="shared",
                                   completion_batch_size=8, prefill_batch_size=8,
                                   prefill_step_size=64, room=room)
        tokens[room] = lone_prompt_beside_rows(gen)[0]
        assert (gen._prompt_batch.room_block == ROOM_BLOCK) is room
    assert tokens[True] == tokens[False]
    # Every paced chunk but the last layer's (whose output no one reads) went over the
    # room: LONG's 700 tokens in a room of one block.
    assert calls and all(calls) and set(rooms) == {ROOM_BLOCK}
