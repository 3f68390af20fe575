"""The prompt cache's disk tier: entries kept in a folder, read back across restarts.

``DiskPromptCache`` on its own (real MLX arrays, a temporary folder): an entry
written comes back bit for bit, found by the longest shared prefix, after a
restart too; other weights or another scope never see it; the byte limit
removes the least recently used; partial files are removed at start; a full
writer queue skips; a damaged file fails its read and leaves the folder.

Then the engine core on the tiny real model: a system prompt cached by one
engine serves the next engine started on the same folder, with the tokens a
whole prefill gives; a conversation in memory when an engine stops serves its
next turn in the next engine; an entry evicted from memory comes back from disk; a
request aborted while it waits for a read ends once. Last, a property on the
fake engine: any arrivals, aborts and reads (served, failed or slow) end each
request once with its own tokens.
"""

from __future__ import annotations

import random
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from runtime.config import ServerConfig
from runtime.engine.disk_tier import MIN_TOKENS, DiskTier
from runtime.engine.loading import make_engine_core
from runtime.messages import Abort, EvictCache, SamplingParams, Submit
from runtime.prompt_cache_disk import DiskPromptCache, model_fingerprint


def layers_of(n_tokens: int, layers: int = 2, seed: int = 0) -> list[tuple]:
    rng = np.random.default_rng(seed)

    def array():
        values = rng.standard_normal((1, 2, n_tokens, 4)).astype(np.float32)
        return mx.array(values).astype(mx.bfloat16)

    return [(array(), array()) for _ in range(layers)]


def written(disk: DiskPromptCache, count: int) -> None:
    deadline = time.monotonic() + 10
    while disk.writes < count:
        assert time.monotonic() < deadline, "the writer did not write"
        time.sleep(0.01)


@pytest.fixture
def folder(tmp_path):
    return tmp_path / "prompt-cache"


def test_an_entry_comes_back_bit_for_bit_by_its_longest_prefix_and_after_a_restart(folder):
    disk = DiskPromptCache(folder, 10**9, "weights-a")
    first, second = layers_of(5, seed=1), layers_of(3, seed=2)
    tokens = list(range(100, 108))
    assert disk.keep("", tokens, [first, second])
    assert not disk.keep("", tokens, [first, second])  # being written or kept: once
    written(disk, 1)
    assert disk.entries == 1 and disk.nbytes == 2 * 2 * (5 + 3) * 2 * 4 * 2
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o600}  # it holds prompts
    entry, shared = disk.longest("", tokens[:6] + [1, 2, 3])
    assert shared == 6
    assert disk.longest("", [7] + tokens) is None  # shares no leading token
    disk.close()

    again = DiskPromptCache(folder, 10**9, "weights-a")
    entry, shared = again.longest("", tokens + [9])
    assert shared == len(tokens) and entry.tokens.tolist() == tokens
    cache = again.as_cache(entry, again.load(entry).result(timeout=10))
    for layer, (k1, v1), (k2, v2) in zip(cache, first, second, strict=True):
        assert layer.offset == len(tokens)
        assert mx.array_equal(layer.keys, mx.concatenate([k1, k2], axis=2)).item()
        assert mx.array_equal(layer.values, mx.concatenate([v1, v2], axis=2)).item()
        assert layer.keys.dtype == mx.bfloat16
    # Other weights, or another scope, never see it.
    assert again.longest("scope-b", tokens) is None
    again.close()
    other = DiskPromptCache(folder, 10**9, "weights-b")
    assert other.longest("", tokens) is None and other.entries == 1
    other.close()


def test_a_lookup_compares_only_the_entries_that_open_as_the_prompt_does(folder):
    from runtime.prompt_cache_disk import HEAD_TOKENS

    disk = DiskPromptCache(folder, 10**9, "w")
    n = 2 * HEAD_TOKENS
    base = list(range(1000, 1000 + n))
    late = base[:HEAD_TOKENS] + [7] * HEAD_TOKENS  # parts from base after its head
    early = base[:5] + [7] * (n - 5)  # parts within the head
    for i, tokens in enumerate((late, early)):
        disk.keep("", tokens, [layers_of(n, seed=i)])
        written(disk, i + 1)
    assert disk.longest("", base) == (disk.longest("", late)[0], HEAD_TOKENS)
    assert disk.longest("", base[:5] + [9] * 40) is None  # early opens otherwise: not compared
    assert disk.longest("", early)[1] == n
    disk.close()


def test_the_byte_limit_removes_the_least_recently_used(folder):
    one = 2 * 2 * 4 * 2 * 4 * 2  # an entry of 4 tokens: 2 layers x (keys, values)
    disk = DiskPromptCache(folder, 2 * one, "w")
    a, b, c = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]
    disk.keep("", a, [layers_of(4)])
    written(disk, 1)
    disk.keep("", b, [layers_of(4)])
    written(disk, 2)
    entry, _ = disk.longest("", a)
    disk.load(entry).result(timeout=10)  # a is used: b is now the least recent
    disk.keep("", c, [layers_of(4)])
    written(disk, 3)
    assert disk.entries == 2 and disk.nbytes == 2 * one and disk.removed == 1
    assert disk.longest("", b) is None
    assert disk.longest("", a)[1] == 4 and disk.longest("", c)[1] == 4
    disk.close()
    assert len(list(folder.glob("*.kv"))) == 2


def test_partial_files_are_removed_at_start(folder):
    disk = DiskPromptCache(folder, 10**9, "w")
    disk.keep("", [1, 2, 3], [layers_of(3)])
    written(disk, 1)
    disk.close()
    (whole,) = folder.glob("*.json")
    (folder / "0123.kv").write_bytes(b"no index")  # a kv without its json
    (folder / ".4567.kv.tmp").write_bytes(b"half")  # a write cut short
    (folder / "89ab.json").write_text('{"format": 1, "nbytes": 5}')  # its kv is missing
    again = DiskPromptCache(folder, 10**9, "w")
    assert sorted(p.name for p in folder.iterdir()) == sorted([whole.name, whole.stem + ".kv"])
    assert again.entries == 1
    again.close()


def test_a_full_writer_queue_skips_the_entry(folder, monkeypatch):
    disk = DiskPromptCache(folder, 10**9, "w")
    release = threading.Event()
    write = disk._write

    def slow_write(*job):
        release.wait(10)
        write(*job)

    monkeypatch.setattr(disk, "_write", slow_write)
    queued = [disk.keep("", [i, i + 1], [layers_of(2, seed=i)]) for i in range(10)]
    # One being written, WRITE_QUEUE waiting; the rest skipped.
    assert queued.count(True) in (4, 5) and disk.write_skips == queued.count(False)
    release.set()
    written(disk, queued.count(True))
    disk.close()


def test_a_damaged_file_fails_its_read_and_leaves_the_folder(folder):
    disk = DiskPromptCache(folder, 10**9, "w")
    tokens = list(range(300))
    disk.keep("", tokens, [layers_of(300)])
    written(disk, 1)
    (kv,) = folder.glob("*.kv")
    kv.write_bytes(kv.read_bytes()[:100])
    tier = DiskTier(disk)
    sub = submit(1, tokens + [5, 6])
    assert tier.hold(sub, lambda: 0)
    deadline = time.monotonic() + 10
    while not (loaded := tier.finished()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert loaded[0].cache is None and loaded[0].waiting == [sub]
    assert tier.load_failures == 1 and disk.entries == 0 and not list(folder.iterdir())
    assert not tier.hold(sub, lambda: 0)  # it goes on without the disk
    tier.close()


def test_the_fingerprint_follows_the_model_files(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"1234")
    before = model_fingerprint(str(model))
    assert before == model_fingerprint(str(model))
    (model / "model.safetensors").write_bytes(b"12345")
    assert model_fingerprint(str(model)) != before
    assert model_fingerprint(str(tmp_path / "missing")) is None


# ------------------------------------------------------- the engine, real MLX


def submit(request_id: int, *segments, max_tokens: int = 6) -> Submit:
    """One segment: a user message; two: a system prompt and a user message."""
    return Submit(
        request_id=request_id,
        prompt=tuple(t for s in segments for t in s),
        segments=tuple(tuple(s) for s in segments),
        segment_types=("user",) if len(segments) == 1 else ("system", "user"),
        max_tokens=max_tokens,
        sampling=SamplingParams(),
    )


def core_for(tiny_model_path, folder=None):
    config = ServerConfig(
        model=tiny_model_path,
        prefill_step_size=64,
        admission_window_ms=0,
        prompt_cache_min_reuse=16,
        prompt_cache_dir=None if folder is None else str(folder),
    )
    return make_engine_core(config, tiny_model_path)


def tokens_of(core, n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    vocab = core.handle.info.vocab_size
    return tuple(rng.randrange(10, vocab - 10) for _ in range(n))


def served(core, request: Submit) -> tuple[int, list[int]]:
    """(cached tokens reported, tokens generated) for ``request``, stepping as the engine
    loop does: waiting ``hold_timeout()`` where it says so (a read from disk)."""
    cached, tokens = {}, []
    core.handle_command(request)
    deadline = time.monotonic() + 60
    while core.has_work:
        assert time.monotonic() < deadline, "the engine did not finish the request"
        wait = core.hold_timeout()
        if wait:
            time.sleep(wait)
        out = core.step()
        assert not out.failed
        cached.update({s.request_id: s.cached_tokens for s in out.started})
        tokens += [e.token for e in out.tokens if e.request_id == request.request_id]
    return cached[request.request_id], tokens


@pytest.fixture(scope="module")
def memory_core(tiny_model_path):
    return core_for(tiny_model_path)


def test_a_system_prompt_cached_by_one_engine_serves_the_next(tiny_model_path, folder,
                                                               memory_core):
    first = core_for(tiny_model_path, folder)
    system = tokens_of(first, 300, seed=1)
    served(first, submit(1, system, tokens_of(first, 20, seed=2)))
    first.close()  # the system prompt, and as it stops what memory holds
    assert len(list(folder.glob("*.json"))) == 2  # the system prompt; the conversation

    second = core_for(tiny_model_path, folder)  # a restart on the same folder
    question = tokens_of(second, 20, seed=3)
    cached, tokens = served(second, submit(2, system, question))
    assert cached == len(system)
    stats = second.stats()
    assert stats.prompt_cache_disk_reads == 1 and stats.prompt_cache_disk_read_tokens == 300
    assert stats.prompt_cache_disk_entries == 2 and stats.prompt_cache_disk_bytes > 0
    # The very tokens a whole prefill gives.
    assert served(memory_core, submit(3, system, question)) == (0, tokens)
    # The next request finds it in memory: no second read.
    assert served(second, submit(4, system, question[:10]))[0] >= len(system)
    assert second.stats().prompt_cache_disk_reads == 1
    second.close()


def test_a_conversation_in_memory_when_the_engine_stops_serves_its_next_turn(
        tiny_model_path, folder, memory_core):
    core = core_for(tiny_model_path, folder)
    conversation = tokens_of(core, 300, seed=8)
    _, reply = served(core, submit(30, conversation))
    core.close()  # writes what memory holds: the conversation and its reply
    core = core_for(tiny_model_path, folder)
    next_turn = conversation + tuple(reply) + tokens_of(core, 20, seed=9)
    cached, tokens = served(core, submit(31, next_turn))
    assert cached >= len(conversation) + len(reply) - 1
    assert served(memory_core, submit(32, next_turn)) == (0, tokens)
    core.close()


def test_an_entry_evicted_from_memory_comes_back_from_disk(tiny_model_path, folder,
                                                          memory_core):
    core = core_for(tiny_model_path, folder)
    conversation = tokens_of(core, 400, seed=4)
    served(core, submit(10, conversation))
    ids = [i for i, (_, tokens) in core.cache_entries.held().items() if len(tokens) >= MIN_TOKENS]
    assert ids, "the finished conversation's entry"
    core.handle_command(EvictCache(entry_ids=tuple(ids)))
    core.step()  # the writer gets it at the next step
    deadline = time.monotonic() + 10
    while core.stats().prompt_cache_disk_writes < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert core.stats().prompt_cache_entries == 0
    entry, _ = core._disk.disk.longest("", conversation)
    assert entry.cache_type == "assistant"  # it comes back as what it was
    follow_up = conversation + tokens_of(core, 30, seed=5)
    cached, tokens = served(core, submit(11, follow_up))
    assert cached == len(conversation)
    assert served(memory_core, submit(12, follow_up)) == (0, tokens)
    core.close()


def test_a_request_aborted_while_it_waits_for_a_read_ends_once(tiny_model_path, folder):
    core = core_for(tiny_model_path, folder)
    system = tokens_of(core, 300, seed=6)
    served(core, submit(20, system, (1, 2, 3)))
    core.close()
    core = core_for(tiny_model_path, folder)
    core.handle_command(submit(21, system, (4, 5, 6)))
    assert 21 in core.active_request_ids and core.has_work
    core.handle_command(Abort(request_id=21))
    out = core.step()
    assert [a.request_id for a in out.aborted] == [21]
    deadline = time.monotonic() + 10
    while core.has_work:  # the read still finishes; nobody waits for it
        assert time.monotonic() < deadline
        out = core.step()
        assert not out.started and not out.aborted and not out.tokens
    core.close()


# ------------------------------------------- property: the fake engine, any order

import concurrent.futures  # noqa: E402

import attrs  # noqa: E402
from hypothesis import event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from runtime.engine.core import EngineCore  # noqa: E402
from runtime.lifecycle import ModelInfo  # noqa: E402
from runtime.loaded_model import LoadedModel  # noqa: E402
from tests.fakes import FakeBatchGeneratorFactory, FakeKVCache  # noqa: E402
from tests.test_shared_prefill import (  # noqa: E402
    FAKE_VOCAB,
    PrefixServingCache,
    record,
    send_due,
)


@attrs.define(eq=False)
class FakeDiskEntry:
    name: str
    tokens: np.ndarray
    cache_type: str = "system"

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class FakeDisk:
    """``DiskPromptCache`` as ``DiskTier`` uses it: entries of given token prefixes, whose
    reads the test finishes (or fails) when it likes."""

    def __init__(self, prefixes: list[tuple[int, ...]]):
        self.entries_by_name = {
            f"e{i}": FakeDiskEntry(f"e{i}", np.asarray(p, dtype=np.int32))
            for i, p in enumerate(prefixes)
        }
        self.reads: list[tuple[FakeDiskEntry, concurrent.futures.Future]] = []
        self.forgotten: list[str] = []
        self.entries, self.nbytes, self.writes = len(prefixes), 0, 0

    def longest(self, scope, tokens):
        best = None
        for entry in self.entries_by_name.values():
            n = entry.n_tokens
            if tuple(tokens[:n]) == tuple(entry.tokens.tolist()) and (best is None or n > best[1]):
                best = (entry, n)
        return best

    def load(self, entry):
        future = concurrent.futures.Future()
        self.reads.append((entry, future))
        return future

    @staticmethod
    def as_cache(entry, arrays):
        return [FakeKVCache(tuple(entry.tokens.tolist()))]

    def forget(self, entry):
        self.forgotten.append(entry.name)
        self.entries_by_name.pop(entry.name, None)

    def keep(self, *args, **kwargs):
        return False

    def close(self):
        pass


@st.composite
def disk_arrivals(draw):
    systems = [tuple(draw(st.lists(st.integers(1, FAKE_VOCAB - 1), min_size=4, max_size=8)))
               for _ in range(2)]
    events = []
    for i in range(draw(st.integers(1, 6))):
        system = systems[draw(st.integers(0, 1))]
        tail = (FAKE_VOCAB - 1 - i, *draw(st.lists(st.integers(1, 90), max_size=3)))
        arrive = draw(st.integers(0, 5))
        abort = draw(st.none() | st.integers(0, 8) | st.just(arrive + 1))
        events.append((i + 1, system, tail, arrive, abort))
    # Each step, reads in flight finish (True), fail (False) or wait (None), in order.
    outcomes = draw(st.lists(st.none() | st.booleans(), min_size=20, max_size=20))
    return systems, events, outcomes


@settings(max_examples=150, deadline=None)
@given(example=disk_arrivals())
def test_any_arrivals_aborts_and_reads_end_each_request_once_with_its_own_tokens(example):
    systems, events, outcomes = example
    disk = FakeDisk(systems)
    factory = FakeBatchGeneratorFactory(vocab=FAKE_VOCAB, eos_ids={0}, completion_batch_size=2)
    store = PrefixServingCache()
    core = EngineCore(
        LoadedModel(model=None, tokenizer=None,
                    info=ModelInfo(model_key="fake", vocab_size=FAKE_VOCAB)),
        batch_generator_factory=factory,
        prompt_cache=store,
        disk=DiskTier(disk, min_tokens=1),
    )
    submits = {rid: Submit(request_id=rid, prompt=system + tail,
                           segments=(system, tail), segment_types=("system", "user"),
                           max_tokens=3, sampling=SamplingParams())
               for rid, system, tail, _, _ in events}
    ends = {rid: [] for rid in submits}
    tokens = {rid: [] for rid in submits}
    cached = {}
    for step in range(60):
        send_due(core, events, submits, step)
        outcome = outcomes[step] if step < len(outcomes) else True
        for _, future in disk.reads:
            if future.done() or outcome is None:
                continue
            if outcome:
                future.set_result([])
            else:
                future.set_exception(OSError("a damaged file"))
        if core._disk:
            event("a request waited for a read")
        out = core.step()
        cached.update({s.request_id: s.cached_tokens for s in out.started})
        record(out, ends, tokens)
        if step > 8 and not core.has_work:
            break
    assert not core.has_work
    for rid, how in ends.items():
        assert len(how) == 1, (rid, how)
        assert how != ["failed"]
        if how == ["finished"]:
            generator = factory.current
            (uid,) = [u for u, seq in generator.sequences.items()
                      if tuple(seq.prompt) == submits[rid].prompt]
            assert tokens[rid] == generator.expected_tokens(uid)
            # What the cache served is a prefix of its prompt, the system prompt at most
            # (or the whole prompt but one token).
            assert cached[rid] <= len(submits[rid].prompt) - 1
            if False not in outcomes:  # every read served: each system prompt came from disk
                assert cached[rid] >= len(submits[rid].segments[0])
    if disk.forgotten:
        event("a read failed")
    # A read that failed removed its entry; every one that served went into the cache.
    for entry, future in disk.reads:
        if future.done() and future.exception() is not None:
            assert entry.name in disk.forgotten
