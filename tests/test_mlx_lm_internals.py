"""mlx-lm's private parts that ``runtime.mlx_lm_internals`` relies on, checked against
the installed mlx-lm: after an upgrade a failure here names the attribute that
changed (docs/upgrading-mlx-lm.md says what to do then).
"""

from __future__ import annotations

import inspect
import io
from pathlib import Path

import mlx.core as mx
import mlx_lm.utils
import pytest
from mlx_lm.models.cache import KVCache, LRUPromptCache
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from runtime import mlx_lm_batches, mlx_lm_internals
from runtime.mlx_lm_internals import (
    convert_chat,
    keep_leading_space,
    new_eviction_order,
    prompt_cache_entry,
    prompt_cache_has_entry,
    remove_prompt_cache_entry,
    shared_prefix_length,
    use_prompt_trie,
)
from runtime.prompt_trie import RadixPromptTrie

UPGRADE = "mlx-lm changed: see docs/upgrading-mlx-lm.md"


def require(condition: bool, what: str) -> None:
    if not condition:
        pytest.fail(f"{UPGRADE}: {what}", pytrace=False)


# ------------------------------------------------------------ LRUPromptCache._trie._trie


def test_the_prompt_cache_trie_is_nested_dicts_keyed_by_token():
    cache = LRUPromptCache(max_size=4)
    cache.insert_cache("m", [5, 6, 7], [KVCache()])
    cache.insert_cache("m", [5, 9], [KVCache()])
    trie = getattr(getattr(cache, "_trie", None), "_trie", None)
    require(isinstance(trie, dict), "LRUPromptCache._trie._trie is no longer a dict")
    require("m" in trie, "LRUPromptCache._trie._trie is no longer keyed by model")
    root = trie["m"]
    require(
        isinstance(root, dict) and isinstance(root.get(5), dict) and 6 in root[5],
        "LRUPromptCache._trie._trie[model] is no longer nested dicts keyed by token id",
    )
    assert shared_prefix_length(cache, "m", [5, 6, 8]) == 2
    assert shared_prefix_length(cache, "m", [5, 9, 1, 2]) == 2
    assert shared_prefix_length(cache, "m", [4]) == 0
    assert shared_prefix_length(cache, "other", [5, 6]) == 0


def _layer(tokens: int) -> KVCache:
    layer = KVCache()
    kv = mx.zeros((1, 1, tokens, 4))
    layer.update_and_fetch(kv, kv)
    return layer


def test_another_trie_takes_the_place_of_mlx_lms_only_in_an_empty_cache():
    cache = LRUPromptCache(max_size=4)
    use_prompt_trie(cache, RadixPromptTrie())
    assert isinstance(cache._trie, RadixPromptTrie)
    cache.insert_cache("m", [5, 6, 7], [KVCache()])
    assert shared_prefix_length(cache, "m", [5, 6, 8]) == 2
    with pytest.raises(ValueError):
        use_prompt_trie(cache, RadixPromptTrie())  # it holds an entry (and not mlx-lm's trie)


@pytest.mark.parametrize("radix", [False, True], ids=["mlx-lm's trie", "radix trie"])
def test_one_named_entry_can_be_found_and_removed_with_its_bytes(radix):
    cache = LRUPromptCache(max_size=10)
    if radix:
        use_prompt_trie(cache, RadixPromptTrie())
    cache.insert_cache("m", [1, 2, 3], [_layer(3)], cache_type="user")
    cache.insert_cache("m", [1, 5], [_layer(2)], cache_type="system")
    kept = cache.nbytes
    require(
        all(hasattr(cache, name) for name in ("_trie", "_lru", "_n_bytes", "_n_bytes_by_type")),
        "LRUPromptCache no longer has _trie, _lru, _n_bytes and _n_bytes_by_type",
    )
    assert prompt_cache_has_entry(cache, "m", [1, 2, 3])
    assert not prompt_cache_has_entry(cache, "m", [1, 2])  # a path, not an entry
    assert not prompt_cache_has_entry(cache, "other", [1, 2, 3])
    found = prompt_cache_entry(cache, "m", [1, 2, 3])
    require(
        found is not None and found[1] == "user" and found[0][0].offset == 3,
        "an entry's node no longer holds its CacheEntry (prompt_cache, cache_type)",
    )
    assert prompt_cache_entry(cache, "m", [1, 2]) is None
    freed = remove_prompt_cache_entry(cache, "m", [1, 2, 3])
    require(
        freed is not None and freed > 0 and cache.nbytes == kept - freed and len(cache) == 1,
        "removing one entry through _trie.pop / _lru.remove no longer keeps LRUPromptCache's "
        "count and bytes right",
    )
    assert cache.stats_by_type()["user"] == {"n_sequences": 0, "n_bytes": 0}
    assert remove_prompt_cache_entry(cache, "m", [1, 2, 3]) is None
    assert shared_prefix_length(cache, "m", [1, 2, 3]) == 1  # the path went with it
    # What is left is still served and evicted by mlx-lm's own code.
    cached, rest = cache.fetch_nearest_cache("m", [1, 5, 6])
    assert rest == [6] and cached[0].offset == 2
    cache.trim_to(n_sequences=0)
    assert len(cache) == 0 and cache.nbytes == 0


def test_the_eviction_order_is_one_lru_per_segment_type():
    order = new_eviction_order()
    for key, kind in [(1, "system"), (2, "user"), (3, "user"), (4, "assistant"), (5, "assistant")]:
        order.push("m", key, kind)
    require(len(order) == 5, "LRUPromptCache.CacheOrder no longer counts its keys")
    order.remove("m", 5)
    # assistant (1) >= user (2)? no; user (2) >= system (1)? yes: the oldest user key.
    require(order.pop() == ("m", 2), "LRUPromptCache.CacheOrder.pop changed its order")
    assert [order.pop() for _ in range(3)] == [("m", 4), ("m", 3), ("m", 1)]


def test_an_unknown_cache_layout_gives_no_shortcut():
    assert shared_prefix_length(object(), "m", [1, 2]) is None


# ------------------------------------------------- the detokenizers' leading space


class _SpmVocab:
    """What ``SPMStreamingDetokenizer`` reads of a tokenizer."""

    tokens = ["\u2581world", "a"]

    def __len__(self) -> int:
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids):
        return [self.tokens[i] for i in ids]


def _text(detokenizer, tokens) -> str:
    for token in tokens:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.last_segment


def test_spm_detokenizer_trim_space_switch():
    require(
        "trim_space" in inspect.signature(SPMStreamingDetokenizer.__init__).parameters,
        "SPMStreamingDetokenizer(tokenizer, trim_space=...) is gone",
    )
    require(_text(SPMStreamingDetokenizer(_SpmVocab()), [0]) == "world",
            "SPMStreamingDetokenizer no longer trims a leading space")
    detokenizer = SPMStreamingDetokenizer(_SpmVocab())
    keep_leading_space(detokenizer)
    require(_text(detokenizer, [0]) == " world",
            "SPMStreamingDetokenizer.trim_space = False no longer keeps the leading space")


def test_bpe_detokenizer_trims_only_while_its_text_is_empty(tiny_tokenizer):
    require(
        callable(getattr(BPEStreamingDetokenizer, "_maybe_trim_space", None)),
        "BPEStreamingDetokenizer._maybe_trim_space is gone",
    )
    tokens = tiny_tokenizer.encode(" world", add_special_tokens=False)
    plain = tiny_tokenizer.detokenizer
    require(isinstance(plain, BPEStreamingDetokenizer), "the tiny model's detokenizer is not BPE")
    require(_text(plain, tokens) == "world",
            "BPEStreamingDetokenizer no longer trims a leading space")
    kept = tiny_tokenizer.detokenizer
    keep_leading_space(kept)
    require(
        _text(kept, tokens) == " world",
        "BPEStreamingDetokenizer: a non-empty .text (NUL) and .offset = 1 no longer keep the "
        "leading space out of _maybe_trim_space, or the NUL shows",
    )


# ---------------------------------------------------------- mlx_lm.server.convert_chat


def test_convert_chat_is_mlx_lm_servers_plain_prompt():
    import mlx_lm.server

    require(hasattr(mlx_lm.server, "convert_chat"), "mlx_lm.server.convert_chat is gone")
    require(
        list(inspect.signature(mlx_lm.server.convert_chat).parameters)
        == ["messages", "role_mapping"],
        "mlx_lm.server.convert_chat(messages, role_mapping) changed its parameters",
    )
    prompt = convert_chat([{"role": "user", "content": "hi there"}], None)
    assert "hi there" in prompt
    mapped = convert_chat([{"role": "user", "content": "x"}], {"user": "U> ", "stop": "|"})
    assert mapped.startswith("U> x|")


# ----------------------------------------------------- the barrier of sharded_load


def test_sharded_load_ends_with_a_barrier_on_the_cpu_stream():
    source = inspect.getsource(mlx_lm.utils.sharded_load)
    require(
        "mx.distributed.all_sum(" in source and "stream=mx.cpu" in source,
        "mlx_lm.utils.sharded_load no longer ends with all_sum(..., stream=mx.cpu): "
        "sharded_load_on_the_default_stream may be unneeded or miss the new call",
    )
    require(mlx_lm.utils.mx is mx, "mlx_lm.utils no longer names mlx.core 'mx'")


def test_the_barrier_overlay_is_scoped_to_mlx_lm_utils(monkeypatch):
    calls = []
    real = mx.distributed.all_sum

    def recording_all_sum(x, *args, stream=None, **kwargs):
        calls.append(stream)
        return real(x, *args, stream=stream, **kwargs)

    monkeypatch.setattr(mx.distributed, "all_sum", recording_all_sum)
    with mlx_lm_internals._utils_barrier_off_the_cpu_stream():
        seen = mlx_lm.utils.mx
        assert seen is not mx and mx.distributed.all_sum is recording_all_sum
        assert seen.eval is mx.eval and seen.distributed.init is mx.distributed.init
        total = seen.distributed.all_sum(mx.array(1.0), stream=mx.cpu)
        seen.distributed.all_sum(mx.array(1.0), stream=mx.cpu)
        mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu)  # everyone else: untouched
    assert mlx_lm.utils.mx is mx
    assert total.item() == 1.0
    assert calls == [None, None, mx.cpu]


def test_the_internals_module_is_the_only_one_reading_private_mlx_lm_names():
    """Outside runtime/mlx_lm_internals.py (and mlx_lm_batches.py) no code names the private
    parts it wraps."""
    root = Path(__file__).resolve().parents[1]
    private = (
        "._trie",
        "._lru",
        "._n_bytes",
        "CacheOrder",
        "_maybe_trim_space",
        "from mlx_lm.server import",
        "import mlx_lm.server",
        "mx.distributed.all_sum =",
    )
    offenders = []
    for package in ("runtime", "actors", "api"):
        for path in (root / package).rglob("*.py"):
            if path.name in ("mlx_lm_internals.py", "mlx_lm_batches.py"):
                continue
            text = path.read_text()
            offenders += [f"{path.relative_to(root)}: {p}" for p in private if p in text]
    assert not offenders, offenders


# ------------------------------------------------------------ batch caches' filter


def _batch_layers(seed: int, paddings: list[int], length: int, rotating: bool = False) -> list:
    """Two layers' batch KV caches (rows left-padded by ``paddings``), filled with random
    keys and values; a rotating layer (a window of 8) beside them when asked."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

    key = mx.random.key(seed)
    layers = []
    for i in range(2):
        layer = BatchKVCache(list(paddings))
        k1, k2 = mx.random.split(mx.random.key(seed * 10 + i))
        shape = (len(paddings), 2, length, 4)
        layer.update_and_fetch(mx.random.normal(shape, key=k1), mx.random.normal(shape, key=k2))
        layers.append(layer)
    if rotating:
        layer = BatchRotatingKVCache(8, list(paddings))
        shape = (len(paddings), 2, length, 4)
        layer.update_and_fetch(mx.random.normal(shape, key=key), mx.random.normal(shape, key=key))
        layers.append(layer)
    mx.eval([c.state for c in layers])
    return layers


def _layer_state(layer) -> tuple:
    return (layer.keys.tolist(), layer.values.tolist(), layer.offset.tolist(),
            layer.left_padding.tolist(), layer._idx)


@pytest.mark.parametrize(("paddings", "keep"), [
    ([3, 0, 5, 2], [0, 2, 3]),  # the row without padding leaves: two columns trimmed
    ([3, 0, 5, 2], [1, 2]),  # a row without padding stays: nothing trimmed
    ([4, 4, 6], [2]),  # one row left
    ([1, 2], [0, 1]),  # every row stays, padding shared by all trimmed
    ([5], [0]),  # a lone prompt's split: nothing selected, its padding trimmed
])
def test_layers_filter_as_mlx_lms_own_filter_does(paddings, keep):
    ours = _batch_layers(7, paddings, 10, rotating=True)
    theirs = _batch_layers(7, paddings, 10, rotating=True)
    mlx_lm_internals.filter_layers(ours, keep)
    for layer in theirs:
        layer.filter(keep)
    for mine, reference in zip(ours, theirs, strict=True):
        assert _layer_state(mine) == _layer_state(reference)
    # and a decode step after the filter sees the same cache
    step = [mx.ones((len(keep), 2, 1, 4))] * 2
    for mine, reference in zip(ours[:2], theirs[:2], strict=True):
        got, want = mine.update_and_fetch(*step), reference.update_and_fetch(*step)
        assert got[0].tolist() == want[0].tolist()
        assert mine.make_mask(1).tolist() == reference.make_mask(1).tolist()


@pytest.mark.parametrize(("paddings", "keep"), [
    ([3, 0, 5, 2], [0, 2, 3]),  # the longest row leaves: the shared padding trimmed too
    ([3, 0, 5, 2], [1, 2]),  # nothing trimmed
])
def test_the_step_after_a_leave_writes_its_token_in_place(paddings, keep):
    """A leave copies the kept rows once: the next step's token is written into that
    copy (MLX's slice update in place), not into yet another copy of the batch, as it
    would be into a strided view (the padding trimmed after the rows were selected)."""
    from mlx_lm.models.cache import BatchKVCache

    layer = BatchKVCache(list(paddings))
    shape = (len(paddings), 8, 2000, 32)  # 8 MB of keys, 8 of values (room for 48 more)
    layer.update_and_fetch(mx.zeros(shape), mx.zeros(shape))
    mx.eval(layer.keys, layer.values)
    mlx_lm_internals.filter_layers([layer], keep)
    mx.eval(layer.keys, layer.values)
    kept = layer.keys.nbytes + layer.values.nbytes
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    token = mx.ones((len(keep), 8, 1, 32))
    mx.eval(token)
    layer.update_and_fetch(token, token)
    mx.eval(layer.keys, layer.values)
    assert mx.get_peak_memory() - before < kept // 4
    assert layer.keys[:, :, layer._idx - 1].tolist() == token[:, :, 0].tolist()


def test_a_batch_filter_reads_its_paddings_back_once(monkeypatch):
    """The generation batch's filter (a sequence finished) waits for the device once,
    not once per layer."""
    from mlx_lm.generate import GenerationBatch

    layers = [_batch_layers(3, [2, 0, 1], 6)[0] for _ in range(8)]  # eight layers
    batch = mlx_lm_batches.RowAwareGenerationBatch.empty(None, None)
    batch.prompt_cache = layers
    for name in ("uids", "tokens", "samplers", "logits_processors", "max_tokens",
                 "stop_sequences", "_next_logprobs", "_token_context", "_num_tokens",
                 "_matchers"):
        setattr(batch, name, [name] * 3)
    batch._next_tokens = mx.array([1, 2, 3])
    evals = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (evals.append(a), real_eval(*a))[1])
    batch.filter([0, 2])
    assert len(evals) == 1
    assert batch.prompt_cache is layers and batch.uids == ["uids"] * 2
    assert batch._next_tokens.tolist() == [1, 3]
    assert [c.left_padding.tolist() for c in layers] == [[1, 0]] * 8  # one column trimmed
    assert isinstance(batch, GenerationBatch)


def _computed(array) -> bool:
    """Whether ``array`` holds its values: no operation left for the device to run."""
    dot = io.StringIO()
    mx.export_to_dot(dot, array)
    return "shape=rectangle" not in dot.getvalue()


@pytest.mark.parametrize("keep", [[0, 2], [1, 2], [0, 1, 2]])
def test_a_filter_runs_nothing_on_the_device_to_read_its_paddings(monkeypatch, keep):
    """The kept rows' paddings are made on the host: the filter reads the paddings the
    layers had (computed as rows joined) and leaves none for the device to compute,
    where reading them back would wait behind the step in flight."""
    layers = [_batch_layers(3, [2, 0, 1], 6)[0] for _ in range(4)]
    had = [c.left_padding for c in layers]
    evaluated = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (evaluated.append(a), real_eval(*a))[1])
    mlx_lm_internals.filter_layers(layers, keep)
    assert len(evaluated) == 1 and all(a is b for a, b in zip(evaluated[0][0], had, strict=True))
    assert all(_computed(c.left_padding) for c in layers)
    want = [[2, 0, 1][i] for i in keep]
    assert [c.left_padding.tolist() for c in layers] == [[p - min(want) for p in want]] * 4


def _generation_batch(layers, rows: int):
    batch = mlx_lm_batches.RowAwareGenerationBatch.empty(None, None)
    batch.prompt_cache = layers
    for name in ("uids", "tokens", "samplers", "logits_processors", "max_tokens",
                 "stop_sequences", "_next_logprobs", "_token_context", "_num_tokens",
                 "_matchers"):
        setattr(batch, name, [name] * rows)
    batch._next_tokens = mx.array(list(range(rows)))
    return batch


def _concatenations(monkeypatch) -> list:
    """Spy on mlx-lm's ``BatchKVCache.extend``: the padding array each call left."""
    from mlx_lm.models.cache import BatchKVCache

    left = []
    real_extend = BatchKVCache.extend

    def extend(self, other):
        real_extend(self, other)
        left.append(self.left_padding)

    extend.__wrapped__ = real_extend  # mlx-lm's source, as a generator checks it
    monkeypatch.setattr(BatchKVCache, "extend", extend)
    return left


@pytest.mark.parametrize(("mine", "theirs"), [
    (([2, 0], 6), ([1], 3)),  # the joining row is shorter: shifted by 3
    (([1], 3), ([2, 0], 6)),  # the batch is shorter: its rows shifted
    (([0, 4], 5), ([0, 0, 2], 5)),  # the same length
    (([1, 0], None), ([3], 4)),  # the batch holds no keys yet
    (([1, 0], None), ([3], None)),  # neither does: paddings concatenated
])
def test_joined_paddings_are_mlx_lms_made_on_the_host(monkeypatch, mine, theirs):
    """A join's paddings hold what mlx-lm's ``extend`` computes, made from the two
    sides' paddings read before it, not left as its concatenation for the device."""
    from mlx_lm.models.cache import BatchKVCache

    def layers(seed, paddings, length):
        if length is None:
            return [BatchKVCache(list(paddings)) for _ in range(2)]
        return _batch_layers(seed, paddings, length)

    ours, theirs_layers = layers(1, *mine), layers(2, *theirs)
    reference, reference_other = layers(1, *mine), layers(2, *theirs)
    for c, o in zip(reference, reference_other, strict=True):
        c.extend(o)
    concatenated = _concatenations(monkeypatch)
    before = mlx_lm_internals.layer_paddings(ours), mlx_lm_internals.layer_paddings(theirs_layers)
    for c, o in zip(ours, theirs_layers, strict=True):
        c.extend(o)
    mlx_lm_internals.joined_paddings(ours, *before)
    assert [c.left_padding.tolist() for c in ours] == [c.left_padding.tolist() for c in reference]
    assert all(c.left_padding is not made for c, made in zip(ours, concatenated, strict=True))
    assert [c.left_padding.dtype for c in ours] == [c.left_padding.dtype for c in reference]


def test_a_generation_batch_makes_its_joined_paddings_on_the_host(monkeypatch):
    """The generation batch's ``extend`` leaves no layer with mlx-lm's concatenated
    paddings, and the row that joined leaves with its own keys."""
    batch = _generation_batch([_batch_layers(3, [2, 0], 6)[0] for _ in range(2)], 2)
    joining = _generation_batch([_batch_layers(4, [1], 3)[0] for _ in range(2)], 1)
    its_keys = [c.keys[:, :, 1:3].tolist() for c in joining.prompt_cache]  # padding 1 of 3
    concatenated = _concatenations(monkeypatch)
    batch.extend(joining)
    paddings = [c.left_padding for c in batch.prompt_cache]
    assert len(concatenated) == 2
    assert all(a is not b for a, b in zip(concatenated, paddings, strict=True))
    assert [p.tolist() for p in paddings] == [[2, 0, 4]] * 2
    extracted = batch.extract_cache(2)
    assert [c.keys.tolist() for c in extracted] == its_keys


def test_rows_joining_or_leaving_a_decoding_batch_first_let_a_large_one_wait(monkeypatch):
    """The generation batch asks ``wait_before_batch_copy`` with its layers before a
    copy of them: as rows join a batch that has rows, and as some (not all, not none)
    leave; a join into an empty batch copies nothing and asks with no layers."""
    asked = []
    monkeypatch.setattr(mlx_lm_batches, "wait_before_batch_copy",
                        lambda mx_, caches: asked.append(list(caches)))
    empty = _generation_batch([], 0)
    empty.extend(_generation_batch([_batch_layers(4, [1], 3)[0] for _ in range(2)], 1))
    assert asked == [[]]
    asked.clear()
    batch = _generation_batch([_batch_layers(3, [2, 0], 6)[0] for _ in range(2)], 2)
    layers = list(batch.prompt_cache)
    batch.extend(_generation_batch([_batch_layers(4, [1], 3)[0] for _ in range(2)], 1))
    assert asked == [layers]
    batch.filter([0, 1, 2])  # every row stays: nothing copied
    assert len(asked) == 1
    batch.filter([0, 2])
    assert len(asked) == 2 and asked[1] == batch.prompt_cache
    batch.filter([])  # the last rows leave: the layers are dropped, not copied
    assert len(asked) == 2


def test_a_join_into_an_empty_batch_keeps_the_joining_layers():
    batch = _generation_batch([], 0)
    joining = _generation_batch([_batch_layers(4, [1], 3)[0] for _ in range(2)], 1)
    layers, paddings = joining.prompt_cache, [c.left_padding for c in joining.prompt_cache]
    batch.extend(joining)
    assert batch.prompt_cache is layers
    assert all(c.left_padding is p for c, p in zip(layers, paddings, strict=True))


def test_freed_buffers_are_kept_only_inside_mlx_lm_generate(monkeypatch):
    import importlib

    generate = importlib.import_module("mlx_lm.generate")  # the module, not the function
    monkeypatch.setattr(generate, "mx", mx)  # undone after the test
    cleared = []
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(True))
    assert mlx_lm_internals.keep_freed_buffers_in_generate()
    assert mlx_lm_internals.keep_freed_buffers_in_generate()  # idempotent
    generate.mx.clear_cache()
    assert cleared == []
    assert generate.mx.eval is mx.eval and generate.mx.array is mx.array
    mx.clear_cache()  # everyone else's is MLX's own
    assert cleared == [True]


def test_an_engine_on_cuda_bounds_the_buffer_cache_and_keeps_prefill_s_freed_buffers(
        monkeypatch, tiny_model_path):
    """MLX's CUDA backend gives the device's memory as ``total_memory`` (Metal:
    ``memory_size``): an engine built there bounds the free-buffer cache to its share
    and makes mlx-lm's clear_cache after every prefill chunk a no-op."""
    import importlib

    from runtime.config import ServerConfig
    from runtime.engine.loading import make_engine_core
    from runtime.mlx_environment import CACHE_SHARE

    generate = importlib.import_module("mlx_lm.generate")
    monkeypatch.setattr(generate, "mx", mx)  # undone after the test
    memory = 64 << 30
    monkeypatch.setattr(mx, "device_info", lambda: {
        "total_memory": memory, "free_memory": memory // 2, "device_name": "NVIDIA H200"})
    limits = []
    monkeypatch.setattr(mx, "set_cache_limit", lambda limit: limits.append(limit) or memory)
    cleared = []
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(True))
    make_engine_core(ServerConfig(model=tiny_model_path), tiny_model_path)
    assert limits[0] == int(memory * CACHE_SHARE)
    cleared.clear()  # the load's own
    generate.mx.clear_cache()
    assert cleared == []
    mx.clear_cache()
    assert cleared == [True]


def test_freed_buffers_are_cleared_as_mlx_lm_does_where_its_module_changed(monkeypatch, caplog):
    import importlib

    generate = importlib.import_module("mlx_lm.generate")
    monkeypatch.delattr(generate, "mx")
    assert not mlx_lm_internals.keep_freed_buffers_in_generate()
    assert not hasattr(generate, "mx") and "clears MLX's buffer cache" in caplog.text
