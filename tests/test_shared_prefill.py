"""Requests that share a prefix not cached yet: the engine prefills it once.

``SharedPrefills`` on its own (who waits behind whom, when they go), then the
engine core on the tiny real model: sessions that start together over one
system prompt compute it once, start from the stored copy, report it as
cached, get keep-alive progress while they wait, and produce the very tokens
they produce when each computes its own prompt.
"""

from __future__ import annotations

import random

import pytest

from runtime.config import ServerConfig
from runtime.engine.loading import make_engine_core
from runtime.engine.shared_prefill import SharedPrefills, save_points
from runtime.messages import Abort, SamplingParams, Submit
from tests.test_engine_sampling import run


def sub(request_id: int, *segments, **fields) -> Submit:
    prompt = tuple(t for s in segments for t in s)
    types = ("system", "user", "assistant")[: len(segments)]
    return Submit(
        request_id=request_id,
        prompt=prompt,
        segments=tuple(tuple(s) for s in segments),
        segment_types=types,
        max_tokens=fields.pop("max_tokens", 8),
        sampling=SamplingParams(),
        **fields,
    )


SYSTEM = tuple(range(100, 400))


def nothing_cached(tokens) -> int:
    return 0


# ------------------------------------------------------------ SharedPrefills


def test_save_points_are_the_segment_ends_but_the_last_past_what_is_cached():
    assert save_points([[1, 2, 3], [4, 5], [6]], cached=0) == [3, 5]
    assert save_points([[1, 2, 3], [4, 5], [6]], cached=3) == [5]
    assert save_points([[1, 2, 3]], cached=0) == []


def test_a_request_waits_behind_the_longest_store_it_repeats_and_goes_when_stored():
    shared = SharedPrefills(min_tokens=16)
    shared.track(1, SYSTEM + (1, 2, 3), [len(SYSTEM)], cached=0)
    follower = sub(2, SYSTEM, (7, 8, 9))
    assert shared.wait_behind(follower, nothing_cached)
    assert shared.request_ids() == [2] and bool(shared)
    shared.progressed(1, 128)
    assert shared.progress() == [(2, 128, len(follower.prompt))]
    # A store short of its point releases nobody; the point itself does.
    assert shared.stored(1, 100) == []
    assert shared.stored(1, len(SYSTEM)) == [follower]
    assert not shared and shared.request_ids() == []


def test_no_wait_when_the_cache_serves_it_already_or_the_gain_is_small():
    shared = SharedPrefills(min_tokens=64)
    shared.track(1, SYSTEM + (1,), [len(SYSTEM)], cached=0)
    assert not shared.wait_behind(sub(2, SYSTEM, (5,)), lambda tokens: len(tokens) - 10)
    assert not shared.wait_behind(sub(3, SYSTEM[:40], (5,)), nothing_cached)  # diverges early
    assert not shared.wait_behind(sub(4, SYSTEM), nothing_cached)  # the point is its last token
    assert shared.wait_behind(sub(5, SYSTEM, (5,)), nothing_cached)
    assert SharedPrefills(min_tokens=0).wait_behind(sub(6, SYSTEM, (5,)), nothing_cached) is False


def test_a_leader_that_leaves_releases_its_followers_and_an_abort_drops_one():
    shared = SharedPrefills(min_tokens=16)
    shared.track(1, SYSTEM + (1,), [len(SYSTEM)], cached=0)
    a, b = sub(2, SYSTEM, (5,)), sub(3, SYSTEM, (6,), choice_ids=(4,))
    assert shared.wait_behind(a, nothing_cached) and shared.wait_behind(b, nothing_cached)
    assert shared.drop(4) == (4,)  # a further choice of a waiting request
    assert shared.drop(2) == (2,)
    assert shared.drop(99) == ()
    released = shared.ended(1)
    assert [s.request_id for s in released] == [3] and released[0].choice_ids == ()
    assert shared.clear() == []


# ------------------------------------------------------- the engine, real MLX


def core_for(tiny_model_path, min_tokens: int):
    config = ServerConfig(
        model=tiny_model_path,
        shared_prefill_min_tokens=min_tokens,
        prefill_step_size=64,  # the system prompt takes several steps
        admission_window_ms=0,
        prompt_cache_min_reuse=16,
    )
    return make_engine_core(config, tiny_model_path)


def session_submits(vocab: int, n: int) -> list[Submit]:
    rng = random.Random(5)
    system = tuple(rng.randrange(10, vocab - 10) for _ in range(300))
    return [
        sub(i, system, tuple(rng.randrange(10, vocab - 10) for _ in range(12 + 5 * i)))
        for i in range(1, n + 1)
    ]


def run_sessions(core, submits):
    started, progress = {}, []

    def on_step(core, out, calls):
        for s in out.started:
            started[s.request_id] = s.cached_tokens
        progress.extend(out.progress)

    seen = run(core, submits, on_step=on_step)
    return seen, started, progress


@pytest.fixture(scope="module")
def cores(tiny_model_path):
    return {m: core_for(tiny_model_path, m) for m in (0, 32)}


def test_sessions_that_start_together_compute_the_system_prompt_once(cores):
    core = cores[32]
    submits = session_submits(core.handle.info.vocab_size, 4)
    computed_before = core.counters.prompt_tokens_computed
    seen, started, progress = run_sessions(core, submits)
    system = len(submits[0].segments[0])
    # The first computes it all; the others start from its stored system prompt.
    assert started[1] == 0
    assert all(started[i] == system for i in (2, 3, 4))
    computed = core.counters.prompt_tokens_computed - computed_before
    assert computed == sum(len(s.prompt) for s in submits) - 3 * system
    # The waiting ones heard of the leader's progress (keep-alives for their streams).
    assert {p.request_id for p in progress} == {1, 2, 3, 4}
    assert all(s["failed"] is None and s["reason"] for s in seen.values())


def test_shared_prefills_give_the_tokens_each_prompt_gives_alone(cores):
    results = {}
    for m, core in cores.items():
        # Fresh ids per run, and a cold prompt cache for these prompts (other rng draws).
        submits = [
            sub(i + 10 * (m + 1), *s.segments) for i, s in enumerate(
                session_submits(core.handle.info.vocab_size, 3)
            )
        ]
        seen, started, _ = run_sessions(core, submits)
        results[m] = [seen[s.request_id]["tokens"] for s in submits]
        cached = [started[s.request_id] for s in submits]
        assert (cached[1] > 0) == (m > 0)
    assert results[0] == results[32]


def test_a_waiting_request_can_be_aborted(cores):
    core = cores[32]
    rng = random.Random(11)
    vocab = core.handle.info.vocab_size
    system = tuple(rng.randrange(10, vocab - 10) for _ in range(300))
    leader = sub(101, system, (11, 12, 13))
    follower = sub(102, system, (14, 15, 16))
    core.handle_command(leader)
    core.handle_command(follower)
    assert 102 in core.active_request_ids
    core.handle_command(Abort(request_id=102))
    out = core.step()
    assert [a.request_id for a in out.aborted] == [102]
    assert 102 not in core.active_request_ids
    finished = set()
    for _ in range(100):
        out = core.step()
        finished |= {e.request_id for e in out.tokens if e.finish_reason is not None}
        assert 102 not in {e.request_id for e in out.tokens} | {s.request_id for s in out.started}
        if not core.has_work:
            break
    assert finished == {101} and not core.has_work


# ------------------------------------------- property: the fake engine, any order

from hypothesis import event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from runtime.engine.core import EngineCore  # noqa: E402
from runtime.lifecycle import ModelInfo  # noqa: E402
from runtime.loaded_model import LoadedModel  # noqa: E402
from tests.fakes import FakeBatchGeneratorFactory, FakeKVCache, FakePromptCache  # noqa: E402

FAKE_VOCAB = 97


class PrefixServingCache(FakePromptCache):
    """A fake prompt cache that serves the longest stored prefix, as mlx-lm's does."""

    def _best(self, model, tokens) -> tuple[int, ...] | None:
        tokens = tuple(tokens)
        found = [k for m, k in self.entries if m == model and tokens[: len(k)] == k]
        return max(found, key=len, default=None)

    def shared_prefix(self, model, tokens) -> int:
        best = self._best(model, tokens)
        return 0 if best is None else len(best)

    def fetch_nearest_cache(self, model, tokens):
        self.fetches.append((model, tuple(tokens)))
        best = self._best(model, tokens)
        if best is None:
            return None, list(tokens)
        return [FakeKVCache(best)], list(tokens[len(best) :])


@st.composite
def arrivals(draw):
    systems = [
        tuple(draw(st.lists(st.integers(1, FAKE_VOCAB - 1), min_size=8, max_size=14)))
        for _ in range(2)
    ]
    n = draw(st.integers(1, 8))
    events = []
    for i in range(n):
        system = systems[draw(st.integers(0, 1))]
        tail = (FAKE_VOCAB - 1 - i,) + tuple(
            draw(st.lists(st.integers(1, FAKE_VOCAB - 1), min_size=0, max_size=3))
        )
        arrive = draw(st.integers(0, 6))
        # arrive + 1: often between its system prompt's step and the rest's.
        abort = draw(st.none() | st.integers(0, 10) | st.just(arrive + 1))
        events.append((i + 1, system, tail, arrive, abort))
    return events, draw(st.integers(1, 4)), draw(st.integers(1, 8)), draw(st.sampled_from([0, 1, 8]))


def send_due(core, events, submits, step: int) -> None:
    """The submits and aborts ``events`` (rid, system, tail, arrive, abort) place at ``step``."""
    for rid, _, _, arrive, abort in events:
        if arrive == step:
            core.handle_command(submits[rid])
        if abort is not None and abort == step and arrive <= step:
            core.handle_command(Abort(request_id=rid))


def record(out, ends: dict, tokens: dict) -> None:
    """A step's tokens, and each request's ends (finished, aborted, failed)."""
    for e in out.tokens:
        tokens[e.request_id].append(e.token)
        if e.finish_reason is not None:
            ends[e.request_id].append("finished")
    for a in out.aborted:
        ends[a.request_id].append("aborted")
    for f in out.failed:
        ends[f.request_id].append("failed")


@settings(max_examples=150, deadline=None)
@given(example=arrivals())
def test_any_arrivals_and_aborts_end_each_request_once_with_its_own_tokens(example):
    events, batch, min_tokens, aborted_min_tokens = example
    factory = FakeBatchGeneratorFactory(
        vocab=FAKE_VOCAB, eos_ids={0}, completion_batch_size=batch, per_segment=True
    )
    core = EngineCore(
        LoadedModel(
            model=None, tokenizer=None, info=ModelInfo(model_key="fake", vocab_size=FAKE_VOCAB)
        ),
        batch_generator_factory=factory,
        prompt_cache=PrefixServingCache(),
        shared_prefill_min_tokens=min_tokens,
        aborted_prefill_min_tokens=aborted_min_tokens,
    )
    submits = {rid: sub(rid, system, tail, max_tokens=3) for rid, system, tail, _, _ in events}
    ends: dict[int, list[str]] = {rid: [] for rid in submits}
    tokens: dict[int, list[int]] = {rid: [] for rid in submits}
    for step in range(200):
        send_due(core, events, submits, step)
        if core._shared:
            event("a request waited behind another's prefill")
        record(core.step(), ends, tokens)
        if step > 10 and not core.has_work:
            break
    assert not core.has_work
    if core.stats().aborted_prefills_kept:
        event("an aborted prefill was kept")
    # Every entry, kept from an aborted prefill or stored whole, is some prompt's prefix
    # (or a finished sequence's prompt and reply).
    everything = [s.prompt + tuple(tokens[rid]) for rid, s in submits.items()]
    for _, entry in core.prompt_cache.entries:
        assert any(whole[: len(entry)] == entry for whole in everything), entry
    for rid, how in ends.items():
        assert len(how) == 1, (rid, how)
        assert how != ["failed"]
        if how == ["finished"]:
            # Whatever it started from, a sequence decodes its own prompt's tokens.
            generator = factory.current
            (uid,) = [
                u for u, seq in generator.sequences.items()
                if tuple(seq.prompt) == submits[rid].prompt
            ]
            assert tokens[rid] == generator.expected_tokens(uid)
