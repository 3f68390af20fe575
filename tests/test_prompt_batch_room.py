"""A prompt batch of one prompt grows its KV layers once for the rest of it
(``runtime.mlx_lm_batches``' ``RowAwarePromptBatch``).

mlx-lm grows a batch cache 256 tokens at a time, copying all it holds into a new
buffer each time; in 64-token paced chunks that was every fourth step of a long
prompt. Real mlx (CPU) on the tiny model: the layers' capacity after the first
chunk holds the whole prompt and never changes during its prefill, the class's
step is left as it was, a prompt that joins is not padded to the room nor takes
it to the decoding batch, and the tokens are mlx-lm's own (a plain
``BatchGenerator``), with prompts of different lengths padded together and
sequences decoding beside them. A lone row attends under ``"causal"`` and with no
mask (``runtime.plain_masks``), as do fresh prompts prefilled together; rows padded
on the left under mlx-lm's arrays. The
paddings a leaving row's extraction or filter reads are none a join left to the device.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache

from runtime.batch_sampling import BatchSampler, make_batch_generator
from runtime.tiny_model import build_tiny_model

LONG = [10 + (i * 7) % 300 for i in range(1000)]
SHORT = [[5, 9, 12, 40], [3, 3, 8, 9, 10]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model, _ = load(str(build_tiny_model(tmp_path_factory.mktemp("room") / "tiny")))
    return model


def ours(model) -> BatchGenerator:
    return make_batch_generator(model, sampler=BatchSampler(), completion_batch_size=8,
                                prefill_batch_size=8, prefill_step_size=64)


def drain(gen, uids, out) -> None:
    left = set(uids)
    while left:
        for r in gen.next()[1]:
            out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                left.discard(r.uid)


def test_a_long_prompt_grows_its_cache_once(model):
    gen = ours(model)
    (uid,) = gen.insert([LONG], max_tokens=[3])
    capacities = []
    while gen._currently_processing or not len(gen._generation_batch):
        gen.next()
        layer = gen._prompt_batch.prompt_cache[0] if gen._prompt_batch.prompt_cache else None
        if layer is not None and layer.keys is not None:
            assert "step" not in vars(layer)  # taken back after the chunk
            capacities.append(layer.keys.shape[2])
    # 15 chunks of 64 tokens: mlx-lm would grow the layer four times (256, 512, 768, 1024).
    assert len(capacities) >= 14
    assert set(capacities) == {1024}
    assert BatchKVCache.step == 256
    assert all("step" not in vars(layer) for layer in gen._generation_batch.prompt_cache)


def test_a_prompt_that_joins_takes_no_room(model):
    """A short prompt that joins a long one's prefill is not padded to the long one's
    room, and it joins the decoding batch with only the KV it holds: that batch pads
    every row to its longest layer. The long one, alone again, regrows its room."""
    gen = ours(model)
    (long_uid,) = gen.insert([LONG], max_tokens=[3])
    for _ in range(3):
        gen.next()
    assert gen._prompt_batch.prompt_cache[0].keys.shape[2] == 1024
    (short_uid,) = gen.insert([LONG[:100]], max_tokens=[40])
    gen.next()
    assert len(gen._prompt_batch) == 2
    joined = gen._prompt_batch.prompt_cache[0]
    assert joined.keys.shape[2] <= joined._idx + BatchKVCache.step < 1024
    while short_uid not in gen._generation_batch.uids:
        gen.next()
    decoding = gen._generation_batch.prompt_cache[0]
    assert decoding.keys.shape[2] <= decoding._idx + BatchKVCache.step < 1024
    assert len(gen._prompt_batch) == 1
    capacities = []
    while gen._currently_processing:
        gen.next()
        if gen._prompt_batch.prompt_cache:
            capacities.append(gen._prompt_batch.prompt_cache[0].keys.shape[2])
    # The room for the rest at its next growth, then no growth.
    room = next(i for i, c in enumerate(capacities) if c >= len(LONG) - 1)
    assert set(capacities[room:]) == {capacities[room]}
    assert len(set(capacities[:room])) <= 1


def test_the_tokens_are_mlx_lms(model):
    plain = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8,
                           prefill_step_size=64)
    results = []
    for gen in (plain, ours(model)):
        out: dict[int, list[int]] = {}
        uids = gen.insert(SHORT, max_tokens=[40, 30])
        for _ in range(3):
            for r in gen.next()[1]:
                out.setdefault(r.uid, []).append(r.token)
        # Two prompts of different lengths prefill together, beside the decoding two.
        uids += gen.insert([LONG, LONG[:450]], max_tokens=[6, 6])
        drain(gen, uids, out)
        results.append([out[u] for u in uids])
    assert results[0] == results[1]
    assert all(len(tokens) > 0 for tokens in results[1])


def _cached(model, prefix: list[int]) -> list:
    """A fresh prompt cache holding ``prefix``."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([prefix]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_unpadded_rows_attend_with_no_mask_array_left_padded_rows_with_mlx_lm_s(model, monkeypatch):
    """One unpadded row (a lone prompt's chunks, then its decode steps) reaches the
    attention with ``"causal"`` and no mask, and so do the chunks of fresh prompts of
    different lengths prefilled together (padded on the right) and of sessions after
    one cached system prompt; the rows decoding beside them, and prompts whose cached
    prefixes differ in length (padded on the left), with mlx-lm's arrays. The tokens are a plain ``BatchGenerator``'s, whose
    every call has an array."""
    fused = mx.fast.scaled_dot_product_attention
    masks = []

    def recording(q, k, v, *, scale, mask=None, **kwargs):
        kind = "array" if isinstance(mask, mx.array) else mask
        masks.append(("chunk" if q.shape[2] > 1 else "decode", q.shape[0], kind))
        return fused(q, k, v, scale=scale, mask=mask, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recording)
    results = []
    for gen in (BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8,
                               prefill_step_size=64), ours(model)):
        masks.clear()
        out: dict[int, list[int]] = {}
        uids = gen.insert([LONG], max_tokens=[8])
        drain(gen, uids, out)
        lone = set(masks)
        masks.clear()
        uids += gen.insert([LONG[:300], LONG[:450]], max_tokens=[4, 4])
        drain(gen, uids[1:], out)
        fresh = set(masks)
        masks.clear()
        # Two prompts after cached prefixes of 40 and 90 tokens: merged padded on the left.
        uids += gen.insert([LONG[40:200], LONG[90:200]], max_tokens=[4, 4],
                           caches=[_cached(model, LONG[:40]), _cached(model, LONG[:90])])
        drain(gen, uids[3:], out)
        cached = set(masks)
        masks.clear()
        # Two sessions after one cached 90-token system prompt, user turns of different
        # lengths: no left padding, so "causal" in ours.
        uids += gen.insert([LONG[90:150], LONG[300:400]], max_tokens=[4, 4],
                           caches=[_cached(model, LONG[:90]), _cached(model, LONG[:90])])
        drain(gen, uids[5:], out)
        results.append(([out[u] for u in uids], lone, fresh, cached, set(masks)))
        layers = gen._prompt_batch.prompt_cache + gen._generation_batch.prompt_cache
        assert all("make_mask" not in vars(layer) for layer in layers)
    (plain_tokens, plain_lone, _, _, _), (our_tokens, our_lone, our_fresh, our_cached,
                                          our_shared) = results
    assert our_tokens == plain_tokens
    assert plain_lone == {("chunk", 1, "array"), ("decode", 1, "array")}
    assert our_lone == {("chunk", 1, "causal"), ("decode", 1, None)}
    assert ("chunk", 2, "causal") in our_fresh and ("chunk", 2, "array") not in our_fresh
    assert ("decode", 2, "array") in our_fresh
    assert ("chunk", 2, "array") in our_cached and ("chunk", 2, "causal") not in our_cached
    assert ("chunk", 2, "causal") in our_shared and ("chunk", 2, "array") not in our_shared


def test_no_padding_a_leaving_row_reads_is_a_joins_concatenation(model, monkeypatch):
    """Where a row leaves a batch (its cache extracted, the batch filtered) the layers'
    paddings are read back on the host. None of them is the concatenation mlx-lm's
    ``extend`` leaves for the device as rows join the decoding ones (on CUDA, reading
    that waits for a copy behind the step in flight): the generation batch makes
    them on the host. Each prompt here joins an empty prompt batch, which takes its
    layers as they are. The tokens are still mlx-lm's."""
    import runtime.batch_layers as batch_layers

    joined: list = []  # the arrays themselves, so that no buffer is reused meanwhile
    read: list[str] = []
    real_extend, real_filter = BatchKVCache.extend, batch_layers.filter_layers
    real_extract = BatchKVCache.extract

    def extend(self, other):
        real_extend(self, other)
        joined.append(self.left_padding)

    def buffer(array) -> int:  # a split's deep copy shares its arrays' buffers
        return np.asarray(memoryview(array)).__array_interface__["data"][0]

    def check(where, layers):
        buffers = {buffer(a) for a in joined}
        read.extend(where for c in layers
                    if type(c) is BatchKVCache and buffer(c.left_padding) in buffers)

    def filter_layers(caches, keep):
        check("filter", caches)
        real_filter(caches, keep)

    def extract(self, idx):
        check("extract", [self])
        return real_extract(self, idx)

    extend.__wrapped__ = real_extend  # mlx-lm's source, as the generator checks it

    def run(gen) -> list[list[int]]:
        out: dict[int, list[int]] = {}
        uids = gen.insert([SHORT[0]], max_tokens=[40])
        for _ in range(3):
            for r in gen.next()[1]:
                out.setdefault(r.uid, []).append(r.token)
        uids += gen.insert([SHORT[1]], max_tokens=[12])
        for _ in range(3):
            for r in gen.next()[1]:
                out.setdefault(r.uid, []).append(r.token)
        uids += gen.insert([LONG[:300]], max_tokens=[6])
        drain(gen, uids, out)
        return [out[u] for u in uids]

    plain = run(BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8,
                               prefill_step_size=64))
    monkeypatch.setattr(BatchKVCache, "extend", extend)
    monkeypatch.setattr(BatchKVCache, "extract", extract)
    monkeypatch.setattr(batch_layers, "filter_layers", filter_layers)
    assert run(ours(model)) == plain
    assert joined and not read, read
