"""The prompt cache's disk tier: entries kept in a folder, read back across restarts.

``DiskPromptCache`` on its own (real MLX arrays, a temporary folder): an entry
written comes back bit for bit, found by the longest shared prefix, after a
restart too; other weights or another scope never see it; the byte limit
removes the least recently used; partial files are removed at start; a full
writer queue skips; a damaged file fails its read and leaves the folder.

Then the engine core on the tiny real model: a system prompt cached by one
engine serves the next engine started on the same folder, with the tokens a
whole prefill gives; an entry evicted from memory comes back from disk; a
request aborted while it waits for a read ends once.
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
    first.close()  # its writer finishes the entries handed to it
    assert len(list(folder.glob("*.json"))) == 1

    second = core_for(tiny_model_path, folder)  # a restart on the same folder
    question = tokens_of(second, 20, seed=3)
    cached, tokens = served(second, submit(2, system, question))
    assert cached == len(system)
    stats = second.stats()
    assert stats.prompt_cache_disk_reads == 1 and stats.prompt_cache_disk_read_tokens == 300
    assert stats.prompt_cache_disk_entries == 1 and stats.prompt_cache_disk_bytes > 0
    # The very tokens a whole prefill gives.
    assert served(memory_core, submit(3, system, question)) == (0, tokens)
    # The next request finds it in memory: no second read.
    assert served(second, submit(4, system, question[:10]))[0] >= len(system)
    assert second.stats().prompt_cache_disk_reads == 1
    second.close()


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
