"""One forward pass for a step's decode and its prefill chunk (runtime.mixed_step).

Real mlx (CPU) on tiny models of each known architecture, through the engine's
own generator (``make_batch_generator``): sequences decode while two long prompts
are prefilled in 64-token chunks, and the shared pass must give the very tokens
of mlx-lm's two passes, also when a decoding sequence is removed (its extracted
cache as of its tokens) or a row finishes between a shared pass and the step
that reads it. A lone prompt's chunks off the ladder are padded onto it; a prompt
group's, models without the compiled layers and a trace that fails run as two
passes.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from runtime.batch_sampling import BatchSampler, make_batch_generator
from runtime.compiled_decode import install_compiled_decode
from runtime.engine.pacing import PrefillPacer
from runtime.mixed_step import (
    MixedStepModel,
    on_ladder,
    paced_chunk_lengths,
    tail_padding,
    trace_paced_shapes,
)
from runtime.tiny_model import ARCHS, build_tiny_model

LONG = [10 + (i * 7) % 300 for i in range(700)]
SHORT = [[5, 9, 12, 40], [3, 3, 8, 9, 10], [17, 2, 99]]


@pytest.fixture(scope="module", params=ARCHS)
def model_path(request, tmp_path_factory) -> str:
    arch = request.param
    return str(build_tiny_model(tmp_path_factory.mktemp(f"mix-{arch}") / arch, arch=arch))


def generator(model_path: str, chunk_pass: str, *, compiled: bool = True, step: int = 64,
              dtype=None, chunk_parts: int = 1):
    model, _ = load(model_path)
    if dtype is not None:
        model.set_dtype(dtype)
    if compiled:
        install_compiled_decode(model)
    return make_batch_generator(
        model, sampler=BatchSampler(), chunk_pass=chunk_pass, completion_batch_size=8,
        prefill_batch_size=8, prefill_step_size=step, chunk_parts=chunk_parts,
    )


def run(gen, *, remove_at: int | None = None, extract: bool = False, seen: dict | None = None):
    """Three sequences decode for six steps, then two long prompts arrive; every
    sequence's tokens, and (``remove_at``) the second sequence removed that many steps
    after the long prompts arrived, with its extracted cache (``extract``); ``seen``
    gets whether a shared pass had decoded ahead for the removed row."""
    uids = gen.insert(SHORT, max_tokens=[60, 50, 7])
    out: dict[int, list[int]] = {u: [] for u in uids}
    for _ in range(6):
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    uids += gen.insert([LONG, LONG[:300]], max_tokens=[10, 12])
    out.update({u: [] for u in uids[3:]})
    left, steps, removed = set(uids), 0, None
    while left:
        if steps == remove_at:
            if seen is not None:
                seen["pending"] = mixer_of(gen) is not None and mixer_of(gen).pending
            removed = gen.remove([uids[1]], return_prompt_caches=extract).get(uids[1])
            left.discard(uids[1])
        step_tokens(gen, out, left)
        steps += 1
    return [out[u] for u in uids], removed


def step_tokens(gen, out: dict, left: set) -> None:
    """One step: each token of a sequence in ``left``; a sequence that finished leaves."""
    for r in gen.next()[1]:
        if r.uid in left:
            out[r.uid].append(r.token)
        if r.finish_reason is not None:
            left.discard(r.uid)


def mixer_of(gen) -> MixedStepModel | None:
    model = gen._generation_batch.model
    return model if isinstance(model, MixedStepModel) else None


def test_a_shared_pass_gives_the_tokens_of_two(model_path):
    separate = generator(model_path, "separate")
    expected, _ = run(separate)
    assert mixer_of(separate) is None
    shared = generator(model_path, "shared")
    tokens, _ = run(shared)
    assert tokens == expected
    assert [len(t) for t in tokens[3:]] == [10, 12]
    # Both long prompts were prefilled beside the decoding sequences in shared passes.
    assert mixer_of(shared).mixed_passes >= 700 // 64 - 1


# Removed at 2 steps in, between steps whose chunks went first (nothing decoded
# ahead); at 7, after the shorter prompt left for decoding: from that step on a
# chunk shares its pass with the next step's decode.
@pytest.mark.parametrize(("steps_in", "ahead"), [(2, False), (7, True)])
def test_a_sequence_removed_after_a_shared_pass_leaves_its_cache_as_of_its_tokens(
        model_path, steps_in, ahead):
    expected, (want_cache, want_tokens) = run(
        generator(model_path, "separate"), remove_at=steps_in, extract=True)
    shared, seen = generator(model_path, "shared"), {}
    tokens, (cache, cache_tokens) = run(shared, remove_at=steps_in, extract=True, seen=seen)
    assert mixer_of(shared).mixed_passes > 0
    assert seen["pending"] is ahead
    assert tokens == expected
    assert list(cache_tokens) == list(want_tokens)
    for ours, theirs in zip(cache, want_cache, strict=True):
        assert ours.offset == theirs.offset == len(want_tokens)
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            np.testing.assert_allclose(np.array(a.astype(mx.float32)),
                                       np.array(b.astype(mx.float32)), atol=1e-5)


def test_a_row_removed_between_a_shared_pass_and_its_step_keeps_the_others_right(model_path):
    expected, _ = run(generator(model_path, "separate"), remove_at=8)
    shared, seen = generator(model_path, "shared"), {}
    tokens, _ = run(shared, remove_at=8, seen=seen)
    assert tokens == expected
    assert mixer_of(shared).mixed_passes > 0
    assert seen["pending"]


def test_a_prefill_beside_decoding_rows_runs_one_pass_a_step_its_chunk_first(
        model_path, monkeypatch):
    """A long prompt arrives while rows decode: every step of its prefill runs one
    forward pass, the first included (mlx-lm's order ran that step's decode as a pass
    of its own, then the chunk with the next step's decode), and the tokens are those
    of two passes a step."""
    def tokens_and_passes(chunk_pass: str):
        gen = generator(model_path, chunk_pass)
        mixer = mixer_of(gen)
        inner = gen.model
        calls = []
        real = type(inner).__call__
        monkeypatch.setattr(type(inner), "__call__",
                            lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
        uids = gen.insert(SHORT, max_tokens=[40, 40, 40])
        out = {u: [] for u in uids}
        for _ in range(3):
            for r in gen.next()[1]:
                out[r.uid].append(r.token)
        gen.insert([LONG], max_tokens=[3])
        passes, prefilling = [], True
        while prefilling:
            before = len(calls) + (mixer.mixed_passes if mixer else 0)
            prompt_responses, generated = gen.next()
            passes.append(len(calls) + (mixer.mixed_passes if mixer else 0) - before)
            prefilling = not any(r.end_of_prompt for r in prompt_responses)
            for r in generated:
                out.setdefault(r.uid, []).append(r.token)
        monkeypatch.undo()
        return out, passes

    expected, separate = tokens_and_passes("separate")
    tokens, shared = tokens_and_passes("shared")
    assert separate[:-1] == [2] * (len(separate) - 1)  # a decode pass and a chunk's
    # 699 tokens (the last is the first decode step's input): eleven chunks of 64, the
    # last (59 tokens) padded onto the ladder, each in the step's one pass.
    assert shared[:-1] == [1] * 11
    assert {u: t[: len(expected[u])] for u, t in tokens.items()} == expected


def test_a_chunk_of_a_pass_of_its_own_keeps_mlx_lm_s_order(model_path, monkeypatch):
    """Chunks of 100 tokens of two prompts together share no pass: each such step
    decodes first and then prefills, as mlx-lm does (taken first, the chunk would hold
    the decoding rows' tokens back behind it); the lone prompt's later chunks, padded
    onto the ladder, share the decode's pass."""
    expected, _ = run(generator(model_path, "separate", step=100))
    gen = generator(model_path, "shared", step=100)
    inner, calls = gen.model, []
    real = type(inner).__call__

    def record(self, inputs, cache=None, **kwargs):
        calls.append("chunk" if cache is gen._prompt_batch.prompt_cache else "decode")
        return real(self, inputs, cache=cache, **kwargs)

    monkeypatch.setattr(type(inner), "__call__", record)
    assert run(gen)[0] == expected
    # Six steps (the three short prompts' prefill, their first decode, four more), then
    # three steps of the two prompts together (100, 100 and the shorter one's last 99,
    # padded by mlx-lm to 100): each the decode, then the chunk.
    assert calls[:6] == ["chunk"] + ["decode"] * 5
    assert calls[6:12] == ["decode", "chunk"] * 3
    assert mixer_of(gen).mixed_passes > 0  # the lone prompt's padded chunks


def test_a_lone_prompt_s_chunks_off_the_ladder_are_padded_onto_it(model_path):
    """Chunks of 100 tokens: the two long prompts' chunks together take two passes; once
    the shorter one is done, the other's chunks share the decode's pass, padded to 128."""
    expected, _ = run(generator(model_path, "separate", step=100))
    off_ladder = generator(model_path, "shared", step=100)
    padded = []
    mixer = mixer_of(off_ladder)
    forward = mixer._forward
    mixer._forward = lambda generation, cache, chunk, **parts: (
        padded.append((chunk.shape, cache[0]._idx)),
        forward(generation, cache, chunk, **parts))[1]
    assert run(off_ladder)[0] == expected
    # LONG alone after LONG[:300]: chunks at 300, 400, 500 and 600 (99 tokens, the last
    # held back for its first sample). At 400 its cache (grown by mlx-lm to 512 while
    # the two prompts prefilled together) had no room for 128: that chunk grew it in a
    # pass of its own.
    assert padded == [((1, 128), 300), ((1, 128), 500), ((1, 128), 600)]
    assert mixer.mixed_passes == len(padded)


def test_tail_padding_only_for_a_lone_prompt_whose_cache_has_room():
    from mlx_lm.models.cache import BatchKVCache, KVCache

    def layer(room: int, held: int = 300):
        c = BatchKVCache(left_padding=[0])
        c.update_and_fetch(mx.zeros((1, 2, held, 8)), mx.zeros((1, 2, held, 8)))
        c.keys = mx.zeros((1, 2, held + room, 8))
        c.values = mx.zeros((1, 2, held + room, 8))
        return c

    odd = mx.zeros((1, 61), mx.int32)
    assert tail_padding(odd, [layer(64), layer(100)]) == 3
    assert tail_padding(mx.zeros((1, 100), mx.int32), [layer(128)]) == 28
    assert tail_padding(odd, [layer(64), layer(63)]) == 0  # a grow would copy the cache
    assert tail_padding(mx.zeros((2, 61), mx.int32), [layer(64)]) == 0  # a prompt group
    assert tail_padding(mx.zeros((1, 128), mx.int32), [layer(256)]) == 0  # on the ladder
    assert tail_padding(mx.zeros((1, 700), mx.int32), [layer(1024)]) == 0  # 324 to pad
    assert tail_padding(odd, [KVCache()]) == 0


def test_models_without_compiled_layers_take_two_passes(model_path):
    uncompiled = generator(model_path, "shared", compiled=False)
    assert not mixer_of(uncompiled).enabled
    assert run(uncompiled)[0] == run(generator(model_path, "separate", compiled=False))[0]
    assert mixer_of(uncompiled).mixed_passes == 0


def test_a_mixed_trace_that_fails_turns_mixing_off_before_any_cache_is_touched(
        model_path, caplog):
    expected, _ = run(generator(model_path, "separate"))
    shared = generator(model_path, "shared")
    for layer in shared.model.layers:

        def broken(*args):
            raise ValueError("planted")

        layer._compiled_decode.mixed_before_cache = broken
    with caplog.at_level(logging.WARNING, logger="runtime.mixed_step"):
        tokens, _ = run(shared)
    assert tokens == expected
    mixer = mixer_of(shared)
    assert not mixer.enabled and mixer.mixed_passes == 0
    assert "planted" in caplog.text


def test_the_load_runs_the_mixed_pass_for_every_batch_size_beside_each_paced_length(
        model_path, caplog):
    """Every compiled layout, every batch size up to the decode concurrency, every ladder
    length up to the paced step's bound: one run each, logged."""
    from runtime.compiled_decode import compiled_layouts

    model, _ = load(model_path)
    install_compiled_decode(model)
    layouts = len(compiled_layouts(model))
    with caplog.at_level(logging.INFO, logger="runtime.mixed_step"):
        assert trace_paced_shapes(model, 3, 128, 2048) == layouts * 3 * 2
    assert "64/128 tokens traced for batch sizes 1-3" in caplog.text
    assert trace_paced_shapes(model, 2, 32, 2048) == 0  # no paced length below the floor


def test_the_ladder():
    assert [n for n in range(1, 2100) if on_ladder(n)] == [64, 128, 256, 512, 1024, 2048]
    # The lengths a paced chunk can take, traced at load on CUDA.
    assert paced_chunk_lengths(256, 2048) == [64, 128, 256]
    assert paced_chunk_lengths(300, 2048) == [64, 128, 256]
    assert paced_chunk_lengths(0, 1024) == [64, 128, 256, 512, 1024]
    assert paced_chunk_lengths(4096, 512) == [64, 128, 256, 512]
    assert paced_chunk_lengths(32, 2048) == []
    pacer = PrefillPacer(1.5, 2048, ladder=True)
    pacer.observe(0.010, decoding=8, prefill_tokens=0)
    pacer.observe(0.0001 * 500, decoding=0, prefill_tokens=500)
    pacer.observe(0.0001 * 1000, decoding=0, prefill_tokens=1000)
    # 15 ms of budget is 150 tokens: the ladder's step below, 128; 75 each for two: 64.
    assert pacer.chunk(decoding=8, prompts=1) == 128
    assert pacer.chunk(decoding=8, prompts=2) == 64
    # A short prompt still goes whole (the step a multiple of 64), and nothing waits:
    # full chunks.
    assert pacer.chunk(decoding=8, prompts=2, short=300) == 320
    assert pacer.chunk(decoding=0, prompts=1) == 2048
    assert PrefillPacer(1.5, 2048).chunk(decoding=8, prompts=1) == 2048  # nothing learnt yet


@pytest.mark.parametrize("chunk_pass", ["separate", "shared"])
def test_shared_passes_queued_while_sequences_decode_give_the_same_tokens(
        model_path, chunk_pass, monkeypatch):
    queued = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (queued.append(len(a)), real(*a))[1])
    runs = {}
    for queue_chunks in (False, True):
        model, _ = load(model_path)
        install_compiled_decode(model)
        gen = make_batch_generator(
            model, sampler=BatchSampler(), chunk_pass=chunk_pass, queue_chunks=queue_chunks,
            completion_batch_size=8, prefill_batch_size=8, prefill_step_size=64,
        )
        before = len(queued)
        runs[queue_chunks] = run(gen)[0], len(queued) - before
    (waited, waited_evals), (tokens, queued_evals) = runs[False], runs[True]
    assert tokens == waited
    if chunk_pass == "shared":
        # The long prompts' chunks beside the decoding sequences (at least the 300-token
        # prompt's five) were queued rather than waited for.
        assert queued_evals - waited_evals >= 5
    else:  # two passes a step: always waited for
        assert queued_evals == waited_evals


def install_attention_as_on_cuda(monkeypatch) -> None:
    """The server's prefill attention installed in this process as on CUDA (for this
    test only): a shared pass's chunk then reads its keys in place (``ChunkAttention``)."""
    from runtime.cuda_attention import install_prefill_attention

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", mx.fast.scaled_dot_product_attention)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert install_prefill_attention(mx)


@pytest.mark.parametrize("step", [64, 100])
def test_a_shared_pass_reads_its_chunk_s_keys_in_place_under_the_grouped_attention(
        model_path, monkeypatch, step):
    """In half precision with the server's prefill attention installed (as on CUDA), a
    shared pass's chunk attends over its cache's buffer with one mask for all layers
    (``ChunkAttention``): the same tokens as the installed attention's own path, also
    for a lone prompt's chunks padded onto the ladder (``step`` 100)."""
    import runtime.mixed_step as mixed_step
    from runtime.cuda_attention import ChunkAttention

    install_attention_as_on_cuda(monkeypatch)
    calls = []
    real_call = ChunkAttention.__call__
    monkeypatch.setattr(ChunkAttention, "__call__",
                        lambda self, *a, **k: calls.append(1) or real_call(self, *a, **k))
    in_place = generator(model_path, "shared", dtype=mx.bfloat16, step=step)
    tokens, _ = run(in_place)
    assert mixer_of(in_place).mixed_passes > 0 and len(calls) >= mixer_of(in_place).mixed_passes
    monkeypatch.setattr(mixed_step, "chunk_attention", lambda *a, **k: None)
    calls.clear()
    installed = generator(model_path, "shared", dtype=mx.bfloat16, step=step)
    assert run(installed)[0] == tokens
    assert not calls and mixer_of(installed).mixed_passes > 0


def lone_prompt_beside_rows(gen, *, remove_long_at: int | None = None):
    """Three rows decode, then LONG arrives alone: every sequence's tokens, the steps
    of its prefill that carried a chunk's later layers, and (``remove_long_at``: that
    many steps after it arrived) LONG removed with its cache extracted."""
    uids = gen.insert(SHORT, max_tokens=[40, 40, 40])
    out = {u: [] for u in uids}
    for _ in range(3):
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    (long_uid,) = gen.insert([LONG], max_tokens=[3])
    out[long_uid] = []
    carried, steps, removed, left = 0, 0, None, set(out)
    while left:
        if steps == remove_long_at:
            removed = gen.remove([long_uid], return_prompt_caches=True)[long_uid]
            left.discard(long_uid)
        carried += bool(gen.chunk_in_flight())
        step_tokens(gen, out, left)
        steps += 1
    return [out[u] for u in [*uids, long_uid]], carried, removed


@pytest.mark.parametrize("parts", [2, 3])
def test_a_chunk_s_layers_spread_over_steps_give_the_tokens_of_one_pass(model_path, parts):
    expected, carried, _ = lone_prompt_beside_rows(generator(model_path, "separate"))
    assert carried == 0
    gen = generator(model_path, "shared", chunk_parts=parts)
    tokens, carried, _ = lone_prompt_beside_rows(gen)
    assert tokens == expected
    layers = len(gen.model.model.layers)
    # Each of LONG's eleven chunks but the last spreads over as many steps as its parts
    # (two layers: at most two), the first in the step it joins its batch. The last,
    # padded onto the ladder, ends the prompt: one pass.
    assert carried == 10 * (min(parts, layers) - 1)


def test_the_chunk_that_ends_a_segment_runs_in_one_pass(model_path):
    """A segment's end is stored right after its step, which would run a split chunk's
    rest as a second pass of its own: the chunk that ends each segment shares one pass
    whole, the others spread over two steps, and the tokens are those of one pass."""
    first, second = LONG[:300], LONG[300:]
    results = {}
    for parts in (1, 2):
        gen = generator(model_path, "shared", chunk_parts=parts)
        uids = gen.insert(SHORT, max_tokens=[40, 40, 40])
        out = {u: [] for u in uids}
        for _ in range(3):
            step_tokens(gen, out, set(out))
        (long_uid,) = gen.insert_segments([[first, second]], max_tokens=[3])
        out[long_uid] = []
        left, carried = set(out), 0
        while left:
            step_tokens(gen, out, left)
            carried += bool(gen.chunk_in_flight())
        results[parts] = (out, carried)
    assert results[2][0] == results[1][0]
    assert results[1][1] == 0
    # 300 tokens: four chunks of 64 and one of 44 (padded onto the ladder) that ends the
    # segment; 400: six of 64 and one of 15 (its last token is the first decode's input).
    assert results[2][1] == 4 + 6


def test_a_chunk_over_two_steps_reads_its_keys_in_place_as_on_cuda(model_path, monkeypatch):
    """CUDA's defaults together: half precision, the server's prefill attention
    installed, a lone prompt's chunk over two steps. Each part's layers attend over
    their cache's buffer (``ChunkAttention``, the second part's built from its first
    layer's cache), and the tokens are those of one pass a chunk."""
    from runtime.cuda_attention import ChunkAttention

    install_attention_as_on_cuda(monkeypatch)
    built = []
    real_init = ChunkAttention.__init__
    monkeypatch.setattr(ChunkAttention, "__init__",
                        lambda self, *a, **k: built.append(k["prefix"]) or real_init(self, *a, **k))
    whole = generator(model_path, "shared", dtype=mx.bfloat16)
    expected, carried, _ = lone_prompt_beside_rows(whole)
    assert carried == 0
    one_part = len(built)
    built.clear()
    halves = generator(model_path, "shared", dtype=mx.bfloat16, chunk_parts=2)
    tokens, carried, _ = lone_prompt_beside_rows(halves)
    assert carried > 0 and not halves.chunk_in_flight()
    assert tokens == expected
    # Every chunk's second part attends in place too, after the prefix its first
    # part's layers saw (their own cache's, not yet grown by the chunk).
    assert len(built) == one_part + carried > one_part
    assert built == sorted(built)


def test_a_prompt_removed_while_its_chunk_is_in_flight_leaves_its_cache_whole(model_path):
    gen = generator(model_path, "shared", chunk_parts=2)
    _, carried, (cache, tokens) = lone_prompt_beside_rows(gen, remove_long_at=3)
    assert carried >= 1 and not gen.chunk_in_flight()
    model, _ = load(model_path)
    install_compiled_decode(model)
    from mlx_lm.models.cache import make_prompt_cache

    fresh = make_prompt_cache(model)
    model(mx.array([list(tokens)]), cache=fresh)
    assert len(tokens) % 64 == 0
    for ours, theirs in zip(cache, fresh, strict=True):
        assert ours.offset == theirs.offset == len(tokens)
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            np.testing.assert_allclose(np.array(a[..., : len(tokens), :].astype(mx.float32)),
                                       np.array(b[..., : len(tokens), :].astype(mx.float32)),
                                       atol=1e-4)
