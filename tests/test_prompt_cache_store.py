"""The engine's prompt cache (runtime.prompt_cache_store): the reuse floor,
checked against mlx-lm's own LRUPromptCache and a brute-force prefix count; the
ledger of entries (ids, events, evictions by id); no limits of its own."""

from __future__ import annotations

import copy

import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, LRUPromptCache

from runtime.messages import CacheEntryStored, EngineStats, StepOutputs
from runtime.prompt_cache_store import CacheEntries, PromptCacheStore

MODEL = "m"
token_lists = st.lists(st.integers(0, 4), min_size=1, max_size=10)


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(token_lists, min_size=0, max_size=6),
    query=token_lists,
    floor=st.integers(0, 6),
)
def test_the_floor_misses_short_prefixes_and_otherwise_fetches_as_mlx_lm(keys, query, floor):
    ours = PromptCacheStore(max_size=10, min_reuse_tokens=floor)
    theirs = LRUPromptCache(max_size=10)
    for key in keys:
        ours.insert_cache(MODEL, list(key), _cache(len(key)))
        theirs.insert_cache(MODEL, list(key), _cache(len(key)))

    shared = ours.shared_prefix(MODEL, list(query))
    assert shared == max((_common(k, query) for k in keys), default=0)

    cache, rest = ours.fetch_nearest_cache(MODEL, list(query))
    want_cache, want_rest = theirs.fetch_nearest_cache(MODEL, list(query))
    reused_by_mlx = len(query) - len(want_rest)
    assert shared >= reused_by_mlx
    if shared < floor:
        assert (cache, rest) == (None, list(query))
    else:
        assert rest == want_rest
        assert (cache is None) == (want_cache is None)
        if cache is not None:
            assert [c.offset for c in cache] == [c.offset for c in want_cache]


def _cache(tokens: int) -> list:
    layer = KVCache()
    kv = mx.zeros((1, 1, tokens, 4))
    layer.update_and_fetch(kv, kv)
    return [layer]


def test_a_prefix_below_the_floor_is_not_reused():
    store = PromptCacheStore(max_size=4, min_reuse_tokens=8)
    stored = list(range(100, 120))
    store.insert_cache(MODEL, stored, _cache(len(stored)))

    # Shares 5 tokens with the entry: under the floor, a miss.
    prompt = stored[:5] + [1, 2, 3]
    assert store.fetch_nearest_cache(MODEL, prompt) == (None, prompt)

    # Shares 10: reused, trimmed to the shared prefix.
    prompt = stored[:10] + [1, 2, 3]
    cache, rest = store.fetch_nearest_cache(MODEL, prompt)
    assert rest == [1, 2, 3]
    assert cache[0].offset == 10

    # The stored entry is a prefix of the prompt: reused whole.
    prompt = stored + [7]
    cache, rest = store.fetch_nearest_cache(MODEL, prompt)
    assert rest == [7] and cache[0].offset == len(stored)


def test_a_zero_floor_reuses_any_prefix_as_mlx_lm_does():
    store = PromptCacheStore(max_size=4, min_reuse_tokens=0)
    stored = list(range(100, 120))
    store.insert_cache(MODEL, stored, _cache(len(stored)))
    prompt = stored[:3] + [1]
    cache, rest = store.fetch_nearest_cache(MODEL, prompt)
    assert rest == [1] and cache[0].offset == 3


def test_shared_prefix_counts_what_any_entry_shares():
    store = PromptCacheStore(max_size=4)
    store.insert_cache(MODEL, [1, 2, 3, 4], _cache(4))
    store.insert_cache(MODEL, [1, 2, 9, 9, 9, 9], _cache(6))
    assert store.shared_prefix(MODEL, [1, 2, 3, 4]) == 4  # exact
    assert store.shared_prefix(MODEL, [1, 2, 3, 4, 5]) == 4  # a stored prefix
    assert store.shared_prefix(MODEL, [1, 2, 9, 9, 7]) == 4  # part of a longer entry
    assert store.shared_prefix(MODEL, [8, 8]) == 0
    assert store.shared_prefix("another model", [1, 2]) == 0


def test_the_ledger_numbers_entries_and_reports_what_the_store_drops_by_itself():
    store = PromptCacheStore()
    entries = CacheEntries(store)
    entries.insert(MODEL, [1, 2, 3], _cache(3), cache_type="system", request_id=7)
    # A longer trimmable entry covers the first: mlx-lm drops it.
    entries.insert(MODEL, [1, 2, 3, 4, 5], _cache(5), cache_type="assistant", request_id=8)
    # The same tokens again: the new entry replaces the old.
    entries.insert(MODEL, [1, 2, 3, 4, 5], _cache(5), cache_type="assistant", request_id=9)
    events = entries.take_events()
    assert [(type(e).__name__, e.entry_id, getattr(e, "reason", None)) for e in events] == [
        ("CacheEntryStored", 1, None),
        ("CacheEntryRemoved", 1, "superseded"),
        ("CacheEntryStored", 2, None),
        ("CacheEntryRemoved", 2, "replaced"),
        ("CacheEntryStored", 3, None),
    ]
    first = events[0]
    assert (first.request_id, first.tokens, first.cache_type) == (7, (1, 2, 3), "system")
    assert first.trimmable and first.nbytes == sum(c.nbytes for c in _cache(3))
    assert entries.take_events() == ()
    assert entries.held() == {3: (MODEL, (1, 2, 3, 4, 5))}
    assert len(store) == 1 and store.nbytes == events[-1].nbytes
    # Evicting by id: an unknown or stale id is skipped; the store is emptied.
    assert entries.evict([1, 3, 42]) == events[-1].nbytes
    assert len(store) == 0 and store.nbytes == 0 and entries.held() == {}
    assert store.fetch_nearest_cache(MODEL, [1, 2, 3, 4, 5, 6]) == (None, [1, 2, 3, 4, 5, 6])


def test_the_store_has_no_limits_of_its_own():
    store = PromptCacheStore()
    for i in range(30):
        store.insert_cache(MODEL, [1000 + i, i], _cache(2))
    assert len(store) == 30


def test_a_stored_entry_holds_its_own_rows_not_the_batchs_arrays():
    """mlx-lm hands a finished row's cache over as a lazy slice of the batch's arrays;
    stored, the entry holds copies of its own rows and the batch's arrays are freed."""
    from mlx_lm.models.cache import BatchKVCache

    rows, heads, tokens, dim = 16, 2, 96, 32
    mx.synchronize()
    before = mx.get_active_memory()
    batch = [BatchKVCache([0] * rows) for _ in range(2)]  # two layers
    for layer in batch:
        kv = mx.ones((rows, heads, tokens, dim))
        layer.update_and_fetch(kv, kv)
    mx.eval([layer.state[:2] for layer in batch])
    batch_bytes = sum(layer.nbytes for layer in batch)
    entry = [layer.extract(5) for layer in batch]
    own_bytes = sum(layer.nbytes for layer in entry)
    assert own_bytes * rows <= batch_bytes

    store = PromptCacheStore()
    entries = CacheEntries(store)
    entries.insert(MODEL, list(range(tokens)), entry, cache_type="assistant", request_id=1)
    entries.take_events()  # the engine takes a step's events at its end: the copies start
    del batch, entry, kv, layer
    mx.synchronize()
    held = mx.get_active_memory() - before
    assert held < batch_bytes / 4, (held, own_bytes, batch_bytes)
    cache, rest = store.fetch_nearest_cache(MODEL, list(range(tokens)))
    assert rest == [] and cache[0].keys.shape == (1, heads, tokens, dim)
    assert mx.all(cache[0].keys == 1).item()


def test_the_copies_of_a_steps_entries_start_in_one_evaluation(monkeypatch):
    """Entries stored in one step are evaluated together when the step's events are
    taken (one pass of MLX's evaluator a step, not one an entry), and before any lookup."""
    import runtime.prompt_cache_store as module

    evaluations: list[int] = []
    monkeypatch.setattr(module.mx, "async_eval", lambda arrays: evaluations.append(len(arrays)))
    entries = CacheEntries(PromptCacheStore())
    for n in (3, 4, 5):  # one step stores three entries
        entries.insert(MODEL, list(range(10 * n, 11 * n)), _cache(n), cache_type="user",
                       request_id=n)  # fmt: skip
    assert evaluations == []
    entries.take_events()
    per_entry = len(module.cache_arrays(_cache(3)))
    assert evaluations == [3 * per_entry]
    entries.take_events()  # nothing new stored: nothing evaluated
    assert evaluations == [3 * per_entry]
    entries.insert(MODEL, [7, 8], _cache(2), cache_type="user", request_id=9)
    entries.fetch(MODEL, [7, 8, 9])  # a lookup mid-step sees the entry as its own arrays
    assert evaluations == [3 * per_entry, per_entry]


def test_cache_arrays_are_every_layers_state_arrays():
    """The direct path for plain ``KVCache`` layers gives what ``state`` holds; other
    layer types (a rotating cache, an arrays cache) still go through their state."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    from runtime.prompt_cache_store import cache_arrays

    rotating = RotatingKVCache(max_size=8)
    kv = mx.ones((1, 1, 3, 4))
    rotating.update_and_fetch(kv, kv)
    arrays_cache = ArraysCache(2)
    arrays_cache[0] = mx.zeros((1, 2))
    layers = [*_cache(5), rotating, arrays_cache, KVCache()]  # the last one empty
    want = [
        leaf
        for layer in layers
        for _, leaf in tree_flatten(layer.state)
        if isinstance(leaf, mx.array)
    ]
    got = cache_arrays(layers)
    assert len(got) == len(want) == 5
    assert all(
        a.shape == b.shape and mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True)
    )
    assert got[0] is layers[0].keys and got[1] is layers[0].values  # no copies, no slices


def test_entries_the_count_limit_evicts_at_once_are_reported_but_never_stored(monkeypatch):
    """A wave of finishing sequences, more than the cache keeps: of each type stored in a
    row only the last ``max_entries`` are stored (copied, inserted); the others are
    reported as before, and the prompt-cache policy's own limit evicts exactly those, so
    its index, its statistics and the store end as if every entry had been stored."""
    import runtime.prompt_cache_store as module
    from actors.prompt_cache import PromptCachePolicy
    from runtime.messages import CacheEntryStored, StepOutputs

    evaluations: list[int] = []
    monkeypatch.setattr(module.mx, "async_eval", lambda arrays: evaluations.append(len(arrays)))
    store = PromptCacheStore()
    entries = CacheEntries(store, max_entries=2)
    policy = PromptCachePolicy(max_entries=2, min_reuse=0)
    policy.engine_changed(MODEL)
    entries.insert(MODEL, [9, 1], _cache(2), cache_type="user", request_id=1)
    for i in range(5):  # five sequences finish in one step
        entries.insert(MODEL, [9, 2, i], _cache(3), cache_type="assistant", request_id=10 + i)
    assert len(store) == 0  # queued until the step's end (or a lookup)
    events = entries.take_events()
    ids = [e.entry_id for e in events if isinstance(e, CacheEntryStored)]
    assert ids == [1, 2, 3, 4, 5, 6]
    assert evaluations == [3 * len(module.cache_arrays(_cache(2)))]  # the user entry, two more
    assert len(store) == 3 and entries.passed_over == {2, 3, 4}
    _, evicted = policy.on_step(StepOutputs(cache_events=events))
    assert set(evicted) >= {2, 3, 4}
    entries.evict(evicted)
    assert entries.passed_over == set()
    assert set(entries.held()) == set(policy.entries()) == {
        i for i in (1, 5, 6) if i not in evicted
    }
    assert len(store) == len(entries.held()) and policy.stats.evictions == len(evicted)


def test_a_passed_over_entry_still_replaces_and_supersedes_what_it_covers():
    """What storing an entry does to the store happens for one the limit evicts at
    once: the entry of the same tokens and the prefixes a trimmable one covers go."""
    store = PromptCacheStore()
    entries = CacheEntries(store, max_entries=1)
    entries.insert(MODEL, [1, 2], _cache(2), cache_type="user", request_id=1)
    entries.insert(MODEL, [5, 6], _cache(2), cache_type="assistant", request_id=2)
    entries.take_events()
    assert len(store) == 2
    entries.insert(MODEL, [1, 2, 3], _cache(3), cache_type="assistant", request_id=3)  # covers 1
    entries.insert(MODEL, [5, 6], _cache(2), cache_type="assistant", request_id=4)  # replaces 2
    entries.insert(MODEL, [7], _cache(1), cache_type="assistant", request_id=5)
    events = entries.take_events()
    assert [(type(e).__name__, e.entry_id, getattr(e, "reason", None)) for e in events] == [
        ("CacheEntryRemoved", 1, "superseded"),
        ("CacheEntryStored", 3, None),
        ("CacheEntryRemoved", 2, "replaced"),
        ("CacheEntryStored", 4, None),
        ("CacheEntryStored", 5, None),
    ]
    assert entries.passed_over == {3, 4}
    assert len(store) == 1 and store.has_entry(MODEL, [7])
    assert entries.evict([3, 4]) == 0  # never stored: nothing to free
    assert entries.held() == {5: (MODEL, (7,))}


def test_a_lookup_ends_the_row_an_entry_can_be_passed_over_in():
    """An entry a lookup could see is stored, however many follow it."""
    store = PromptCacheStore()
    entries = CacheEntries(store, max_entries=1)
    entries.insert(MODEL, [1, 2], _cache(2), cache_type="assistant", request_id=1)
    entries.fetch(MODEL, [1, 2, 3])
    entries.insert(MODEL, [4, 5], _cache(2), cache_type="assistant", request_id=2)
    entries.take_events()
    assert entries.passed_over == set() and len(store) == 2


def test_only_later_entries_that_stay_push_an_entry_out():
    """An entry superseded within the same row frees its slot: the entry before it
    may outlive the row, so it is stored (with a limit of 2: [9] stays beside
    [1, 2, 3], which supersedes [1, 2])."""
    from actors.prompt_cache import PromptCachePolicy
    from runtime.messages import StepOutputs

    store = PromptCacheStore()
    entries = CacheEntries(store, max_entries=2)
    policy = PromptCachePolicy(max_entries=2, min_reuse=0)
    policy.engine_changed(MODEL)
    for i, tokens in enumerate(([9], [1, 2], [1, 2, 3])):
        entries.insert(MODEL, tokens, _cache(len(tokens)), cache_type="assistant", request_id=i)
    events = entries.take_events()
    assert entries.passed_over == set()
    _, evicted = policy.on_step(StepOutputs(cache_events=events))
    assert evicted == ()
    entries.evict(evicted)
    assert set(entries.held()) == set(policy.entries()) == {1, 3}
    assert len(store) == 2 and store.has_entry(MODEL, [9])


# ------------------------------------------------------- entries sharing spans


def layer_of(keys: mx.array, values: mx.array) -> KVCache:
    cache = KVCache()
    cache.keys, cache.values, cache.offset = keys, values, keys.shape[2]
    return cache


def sequence_kv(n: int, seed: int, layers: int = 2) -> list[tuple[mx.array, mx.array]]:
    """Per layer, keys and values of ``n`` tokens (batch 1, 2 heads, dim 4)."""
    mx.random.seed(seed)
    return [(mx.random.normal((1, 2, n, 4)), mx.random.normal((1, 2, n, 4)))
            for _ in range(layers)]


def entry(kv, n: int | None = None) -> list[KVCache]:
    return [layer_of(k[:, :, :n], v[:, :, :n]) for k, v in kv]


def test_entries_that_repeat_a_stored_segment_share_its_arrays_and_fetch_whole():
    from runtime.prompt_cache_store import MIN_SHARED_TOKENS, SharedKVLayer

    store = PromptCacheStore()
    system = list(range(MIN_SHARED_TOKENS + 44))
    s = len(system)
    a_tokens, b_tokens = system + [7] * 50, system + [8] * 30
    # What a model computes for both conversations: the same KV over the system prompt.
    full_a, full_b = sequence_kv(s + 50, seed=1), sequence_kv(s + 30, seed=2)
    full_b = [
        (mx.concatenate([ka[:, :, :s], kb[:, :, s:]], axis=2),
         mx.concatenate([va[:, :, :s], vb[:, :, s:]], axis=2))
        for (ka, va), (kb, vb) in zip(full_a, full_b, strict=True)
    ]
    stored_system = store.insert_cache(MODEL, system, entry(full_a, s), cache_type="system")
    stored_a = store.insert_cache(MODEL, a_tokens, entry(full_a), cache_type="assistant")
    # mlx-lm dropped the system entry (a's covers it), yet b still shares its span.
    assert not store.has_entry(MODEL, system)
    stored_b = store.insert_cache(MODEL, b_tokens, entry(full_b), cache_type="assistant")
    system_span = stored_system[0].span
    for stored in (stored_a, stored_b):
        assert all(isinstance(layer, SharedKVLayer) for layer in stored)
        assert stored[0].span.prev is system_span
    assert stored_b[0].span.keys[0].shape[2] == 30  # only its own tokens were copied
    # Counted as whole entries, as mlx-lm counts them.
    assert store.nbytes == sum(k.nbytes + v.nbytes for k, v in full_a + full_b)
    for tokens, full in ((a_tokens, full_a), (b_tokens, full_b)):
        cache, rest = store.fetch_nearest_cache(MODEL, tokens + [99])
        assert rest == [99]
        for layer, (k, v) in zip(cache, full, strict=True):
            assert isinstance(layer, KVCache) and layer.offset == len(tokens)
            assert mx.array_equal(layer.keys, k) and mx.array_equal(layer.values, v)
    # A fetch that trims a longer entry back to the system prompt: made from the
    # system prompt's span alone, not the whole entry concatenated and trimmed.
    cache, rest = store.fetch_nearest_cache(MODEL, system + [5, 5])
    assert rest == [5, 5] and cache[0].offset == s
    assert cache[0].keys.shape[2] == s and cache[0].values.shape[2] == s
    assert mx.array_equal(cache[0].keys, full_a[0][0][:, :, :s])
    assert mx.array_equal(cache[0].values, full_a[0][1][:, :, :s])
    # Deep-copied again (several choices of one prompt): a plain KVCache of its own.
    again = copy.deepcopy(cache)
    assert type(again[0]) is KVCache and again[0].offset == s
    assert mx.array_equal(again[0].keys, cache[0].keys)


def test_the_ledger_names_each_entrys_spans_and_the_policy_counts_what_is_held():
    from actors.prompt_cache import PromptCachePolicy
    from runtime.prompt_cache_store import MIN_SHARED_TOKENS

    entries = CacheEntries(PromptCacheStore())
    system = list(range(MIN_SHARED_TOKENS + 44))
    s = len(system)
    full = sequence_kv(s + 50, seed=3)
    entries.insert(MODEL, system, entry(full, s), cache_type="system", request_id=1)
    sessions = [system + [7] * 50, system + [7] * 20 + [8] * 30, system + [9] * 40]
    for i, tokens in enumerate(sessions):
        entries.insert(MODEL, tokens, entry(full, len(tokens)), cache_type="user",
                       request_id=2 + i)
    all_events = entries.take_events()
    events = [e for e in all_events if isinstance(e, CacheEntryStored)]
    per_token = sum(k[:, :, :1].nbytes + v[:, :, :1].nbytes for k, v in full)
    system_span = events[0].spans[0]
    assert events[0].spans == (system_span,) and system_span[1] == s * per_token
    for event, tokens in zip(events[1:], sessions, strict=True):
        own = (len(tokens) - s) * per_token
        assert event.spans[0] == system_span and event.spans[1][1] == own
        assert event.nbytes == len(tokens) * per_token  # counted whole, as mlx-lm does
    # The sessions' entries cover the system entry, which mlx-lm drops; its span stays.
    assert entries.held().keys() == {2, 3, 4}
    policy = PromptCachePolicy(max_entries=10, max_bytes=(s + 50 + 50 + 40) * per_token)
    policy.engine_changed(MODEL)
    _, evicted = policy.on_step(StepOutputs(cache_events=all_events))
    assert evicted == () and policy.bytes == (s + 50 + 50 + 40) * per_token
    assert policy.entry_bytes == sum(e.nbytes for e in events[1:])
    # A batch that needs a byte of it: the oldest session goes, freeing its own span alone.
    _, evicted = policy.on_step(StepOutputs(stats=EngineStats(batch_kv_bytes=1)))
    assert evicted == (2,) and policy.bytes == (s + 50 + 40) * per_token


def test_short_segments_and_other_caches_are_stored_as_they_are():
    store = PromptCacheStore()
    short = list(range(20))
    kv = sequence_kv(20, seed=3)
    stored = store.insert_cache(MODEL, short, entry(kv), cache_type="system")
    longer = store.insert_cache(MODEL, short + [1, 2], entry(sequence_kv(22, seed=4)))
    assert longer[0].span.prev is None  # a 20-token segment is not worth sharing
    assert stored[0].span.end == 20
    class OtherLayer:  # a rotating or quantized cache, say
        nbytes = 64

        def is_trimmable(self):
            return False

    odd = [OtherLayer()]
    assert store.insert_cache(MODEL, [9, 9], odd) is odd


def test_a_segment_end_is_forgotten_when_its_span_goes():
    """Sessions that ended leave no end behind: once no entry uses a span, the end
    registered for it goes (a weak reference's callback), but not an end the same
    tokens registered since for a newer span."""
    import gc
    import weakref

    from runtime.prompt_cache_store import MIN_SHARED_TOKENS, _end_forgetter

    store = PromptCacheStore()
    system = list(range(MIN_SHARED_TOKENS + 10))
    s = len(system)
    session = system + [7] * 40
    store.insert_cache(MODEL, system, entry(sequence_kv(s, seed=5)), cache_type="system")
    store.insert_cache(MODEL, session, entry(sequence_kv(s + 40, seed=6)), cache_type="user")
    assert [end for end, _ in store._shared_ends.prefix_values(MODEL, session)] == [s, s + 40]
    store.remove_entry(MODEL, session)  # the system entry went when the session's covered it
    gc.collect()
    assert store._shared_ends.prefix_values(MODEL, session) == []
    # Registered again, the end stays while its entry does, and a callback of another
    # registration of the same tokens (a span gone since) leaves it alone.
    stored = store.insert_cache(MODEL, system, entry(sequence_kv(s, seed=7)), cache_type="system")
    registered = store._shared_ends.value(MODEL, system)
    assert registered() is stored[0].span
    _end_forgetter(store._shared_ends, MODEL, system)(weakref.ref(stored[0].span))
    assert store._shared_ends.value(MODEL, system) is registered


def test_a_fetched_layer_s_keys_set_before_either_is_read_keep_its_values():
    """Setting one of a fetched layer's arrays before either was read leaves the other
    as the stored entry has it (made from the spans first, not over the new one)."""
    from runtime.prompt_cache_store import MIN_SHARED_TOKENS

    store = PromptCacheStore()
    system = list(range(MIN_SHARED_TOKENS + 20))
    kv = sequence_kv(len(system), seed=6)
    store.insert_cache(MODEL, system, entry(kv), cache_type="system")
    fetched, _ = store.fetch_nearest_cache(MODEL, system + [3])
    replaced = mx.zeros_like(kv[0][0])
    fetched[0].keys = replaced
    assert fetched[0].keys is replaced
    assert mx.array_equal(fetched[0].values, kv[0][1])


def test_a_write_into_a_fetched_layer_leaves_the_entry_and_other_fetches():
    """A request's write into its fetched layer (``update_and_fetch`` where the trimmed
    layer has room, in place) changes neither the stored entry nor another fetch of
    it, and the next fetch is the stored KV again."""
    from runtime.prompt_cache_store import MIN_SHARED_TOKENS

    store = PromptCacheStore()
    system = list(range(MIN_SHARED_TOKENS + 20))
    s = len(system)
    kv = sequence_kv(s, seed=5)
    stored = store.insert_cache(MODEL, system, entry(kv), cache_type="system")
    mx.eval([a for layer in stored for a in layer.state])
    first, rest = store.fetch_nearest_cache(MODEL, system + [3])
    second, _ = store.fetch_nearest_cache(MODEL, system + [4])
    assert rest == [3]
    for layer, (k, _v) in zip(first, kv, strict=True):
        assert layer.keys is not stored[0].span.keys[0] and mx.array_equal(layer.keys, k)
    # A fetch that trims (one token shorter than the entry): the layer has room, and
    # the request's next token is written into it in place.
    trimmed, rest = store.fetch_nearest_cache(MODEL, system[:-1] + [9, 9])
    assert rest == [9, 9] and trimmed[0].offset == s - 1 and trimmed[0].keys.shape[2] == s
    new = mx.full((1, 2, 1, 4), 7.0)
    keys, _ = trimmed[0].update_and_fetch(new, new)
    mx.eval(keys)
    assert mx.array_equal(keys[:, :, -1:], new)
    for cache in (first, second, store.fetch_nearest_cache(MODEL, system + [5])[0]):
        for layer, (k, v) in zip(cache, kv, strict=True):
            assert mx.array_equal(layer.keys, k) and mx.array_equal(layer.values, v)
    for layer, (k, v) in zip(stored, kv, strict=True):
        assert mx.array_equal(layer.state[0], k) and mx.array_equal(layer.state[1], v)


def test_a_new_session_reuses_another_s_system_prompt_span_alone():
    """A prompt that shares another session's system prompt and the few tokens that
    open its user turn (a chat template's) reuses the system prompt's span alone, as
    views: the shared tokens past it are left to prefill, not reused by copying the
    span and the next. One whose first span is not a system segment, or that shares
    more, keeps everything it shares."""
    from runtime.fetched_kv import FIRST_SPAN_REACH
    from runtime.prompt_cache_store import MIN_SHARED_TOKENS

    store = PromptCacheStore()
    system = list(range(MIN_SHARED_TOKENS + 40))
    s = len(system)
    opening = [9000, 9001, 9002]  # the template's opening of a user turn
    a_tokens = system + opening + [7] * 80
    full = sequence_kv(len(a_tokens), seed=6)
    store.insert_cache(MODEL, system, entry(full, s), cache_type="system")
    store.insert_cache(MODEL, a_tokens, entry(full), cache_type="assistant")
    new = system + opening + [8] * 20
    cache, rest = store.fetch_nearest_cache(MODEL, new)
    assert cache[0].offset == s and rest == opening + [8] * 20
    for layer, (k, v) in zip(cache, full, strict=True):
        assert layer.keys.shape[2] == s  # the span alone, no concatenation
        assert mx.array_equal(layer.keys, k[:, :, :s]) and mx.array_equal(layer.values, v[:, :, :s])
    # A first span that is no system segment (a session's own earlier prompt): all
    # that is shared is reused.
    own = PromptCacheStore()
    own.insert_cache(MODEL, system, entry(full, s), cache_type="user")
    own.insert_cache(MODEL, a_tokens, entry(full), cache_type="assistant")
    cache, rest = own.fetch_nearest_cache(MODEL, new)
    assert cache[0].offset == s + 3 and rest == [8] * 20
    # Sharing more than FIRST_SPAN_REACH tokens past the span: all of it is reused.
    far = system + opening + [7] * FIRST_SPAN_REACH + [8] * 5
    cache, rest = store.fetch_nearest_cache(MODEL, far)
    assert cache[0].offset == s + 3 + FIRST_SPAN_REACH and rest == [8] * 5
    assert mx.array_equal(cache[0].keys[:, :, :cache[0].offset],
                          full[0][0][:, :, :cache[0].offset])
