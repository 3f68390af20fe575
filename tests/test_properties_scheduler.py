"""Stateful property tests: SchedulerCore admission, and EngineCore over a fake batch."""

from __future__ import annotations

import collections
import queue
from types import SimpleNamespace

import attrs
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)
from mlx_lm.models.cache import KVCache, RotatingKVCache

from actors.scheduler import SchedulerCore
from runtime.engine.core import EngineCore
from runtime.engine.loop import run_engine_loop
from runtime.errors import Overloaded
from runtime.lifecycle import ModelInfo
from runtime.loaded_model import LoadedModel
from runtime.messages import (
    Abort,
    AbortReason,
    CacheEntryStored,
    EngineStats,
    SamplingParams,
    SequenceAborted,
    SequenceFailed,
    Shutdown,
    StepOutputs,
    Submit,
    TokenEvent,
)
from tests.fakes import FakeBatchGeneratorFactory, FakePromptCache

STATEFUL = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def make_submit(request_id: int, prompt=(1, 2, 3), max_tokens: int = 4, segments=None, types=None):
    prompt = tuple(prompt)
    return Submit(
        request_id=request_id,
        prompt=prompt,
        segments=segments if segments is not None else (prompt,),
        segment_types=types if types is not None else ("assistant",),
        sampling=SamplingParams(),
        max_tokens=max_tokens,
    )


# ----------------------------------------------------------------- Scheduler


class SchedulerMachine(RuleBasedStateMachine):
    """SchedulerCore used as the Scheduler shell uses it.

    ``submit`` is ``Scheduler.submit``: ``admit`` followed at once by
    ``to_start`` (which starts nothing while no engine is attached: the
    request waits for the engine's ``ModelReady``). Engine outputs, aborts,
    refills (``to_start``), engine loss and re-attachment happen in any order.
    A model (FIFO list + set) predicts every answer.
    """

    @initialize(max_in_engine=st.integers(1, 4), max_waiting=st.integers(0, 4))
    def setup(self, max_in_engine, max_waiting):
        self.core = SchedulerCore(max_in_engine=max_in_engine, max_waiting=max_waiting)
        self.attached = True
        self.waiting: list[int] = []  # the model's FIFO
        self.engine: set[int] = set()
        self.ids: list[int] = []
        self.admitted: list[int] = []
        self.started: list[int] = []
        self.aborted_in_engine: list[int] = []

    def _start(self):
        free = self.core.max_in_engine - len(self.engine) if self.attached else 0
        expect = self.waiting[: max(0, free)]
        started = self.core.to_start(engine_attached=self.attached)
        assert [s.request_id for s in started] == expect  # FIFO
        del self.waiting[: len(expect)]
        self.engine.update(expect)
        self.started.extend(expect)

    @rule(max_tokens=st.integers(1, 8))
    def submit(self, max_tokens):
        rid = self.core.allocate_id()
        assert rid not in self.ids
        self.ids.append(rid)
        could = self.core.can_admit()
        try:
            self.core.admit(make_submit(rid, max_tokens=max_tokens))
        except Overloaded as exc:
            assert not could
            assert exc.status == 429 and exc.retry_after
            return
        assert could
        self.admitted.append(rid)
        self.waiting.append(rid)
        self._start()

    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from([*self.ids, 10**9]), "rid")
        reason = data.draw(st.sampled_from(AbortReason), "reason")
        abort = self.core.abort(rid, reason)
        if rid in self.engine:
            assert abort == Abort(request_id=rid, reason=reason)
            self.engine.discard(rid)
            self.aborted_in_engine.append(rid)
        else:
            assert abort is None
            if rid in self.waiting:
                self.waiting.remove(rid)
        assert self.core.abort(rid, reason) is None  # idempotent

    @rule(data=st.data())
    def engine_reports(self, data):
        """One engine step: some sequences end (any terminal kind), others emit tokens;
        late SequenceAborted for aborted ones are harmless."""
        engine = sorted(self.engine)
        ending = data.draw(st.sets(st.sampled_from(engine)) if engine else st.just(set()), "ending")
        tokens, aborted, failed = [], [], []
        for rid in engine:
            if rid not in ending:
                tokens.append(TokenEvent(request_id=rid, token=1))
                continue
            kind = data.draw(st.sampled_from(["length", "stop", "aborted", "failed"]), "kind")
            if kind in ("length", "stop"):
                tokens.append(TokenEvent(request_id=rid, token=2, finish_reason=kind))
            elif kind == "aborted":
                aborted.append(SequenceAborted(request_id=rid))
            else:
                failed.append(SequenceFailed(request_id=rid, message="x"))
        late = data.draw(
            st.lists(st.sampled_from(self.aborted_in_engine))
            if self.aborted_in_engine
            else st.just([]),
            "late",
        )
        aborted.extend(SequenceAborted(request_id=rid) for rid in late)
        self.core.on_outputs(
            StepOutputs(tokens=tuple(tokens), aborted=tuple(aborted), failed=tuple(failed))
        )
        self.engine -= ending

    @rule()
    def to_start(self):
        self._start()

    @rule()
    def engine_lost(self):
        lost = self.core.engine_lost()
        assert lost == sorted(self.engine)
        self.engine.clear()
        self.attached = False

    @rule()
    def attach(self):
        self.attached = True
        self._start()

    @invariant()
    def bounds(self):
        assert len(self.core.in_engine) <= self.core.max_in_engine
        assert self.core.load <= self.core.max_in_engine + self.core.max_waiting
        if self.attached:  # what can start has started: only the FIFO's share waits
            assert len(self.core.waiting) <= self.core.max_waiting
        assert not (set(self.core.waiting) & self.core.in_engine)
        assert self.core.load == len(self.core.waiting) + len(self.core.in_engine)

    @invariant()
    def matches_model(self):
        assert list(self.core.waiting) == self.waiting
        assert self.core.in_engine == self.engine
        # Starts happen in admission order (aborted ones skipped).
        order = {rid: i for i, rid in enumerate(self.admitted)}
        assert [order[r] for r in self.started] == sorted(order[r] for r in self.started)


SchedulerMachine.TestCase.settings = STATEFUL
TestScheduler = SchedulerMachine.TestCase


# -------------------------------------------------------------------- Engine

VOCAB = 64
EOS = 5


def engine_with_fake(*, fail_on_step=None, batch=3, per_segment=False, model=None):
    factory = FakeBatchGeneratorFactory(
        fail_on_step=fail_on_step,
        vocab=VOCAB,
        eos_ids={EOS},
        completion_batch_size=batch,
        per_segment=per_segment,
    )
    cache = FakePromptCache()
    handle = LoadedModel(
        model=model, tokenizer=None, info=ModelInfo(model_key="fake", vocab_size=VOCAB)
    )
    core = EngineCore(
        handle,
        batch_generator_factory=factory,
        prompt_cache=cache,
    )
    return core, factory, cache


class Ledger:
    """Checks a stream of StepOutputs: one terminal per request, nothing after it."""

    def __init__(self) -> None:
        self.events: dict[int, list[tuple[str, object]]] = collections.defaultdict(list)
        self.terminal: dict[int, tuple[str, object]] = {}
        self.steps = 0

    def record(self, out: StepOutputs) -> None:
        self.steps += 1
        seen_terminal = set()
        for kind, events in (
            ("started", out.started),
            ("progress", out.progress),
            ("token", out.tokens),
            ("aborted", out.aborted),
            ("failed", out.failed),
        ):
            for e in events:
                rid = e.request_id
                assert rid not in self.terminal, f"{kind} event for {rid} after its terminal"
                self.events[rid].append((kind, e))
                if kind == "token":
                    terminal = "finish" if e.finish_reason is not None else None
                else:
                    terminal = kind if kind in ("aborted", "failed") else None
                if terminal:
                    assert rid not in seen_terminal
                    seen_terminal.add(rid)
                    self.terminal[rid] = (terminal, e)
        assert seen_terminal == out.terminal_ids()

    def tokens(self, rid: int) -> list[int]:
        return [e.token for kind, e in self.events[rid] if kind == "token"]


class EngineMachine(RuleBasedStateMachine):
    """EngineCore with a FakeBatchGenerator: random submits, aborts and steps."""

    @initialize(
        batch=st.integers(1, 4),
        fail_on_step=st.one_of(st.none(), st.integers(1, 15)),
        per_segment=st.booleans(),
    )
    def setup(self, batch, fail_on_step, per_segment):
        self.core, self.factory, self.cache = engine_with_fake(
            fail_on_step=fail_on_step, batch=batch, per_segment=per_segment
        )
        self.batch_kv_bytes: dict[int, int] = {}  # rid -> the batch's KV bytes after it joined
        self.stored: dict[int, tuple] = {}  # entry id -> (model, tokens), from the cache events
        self.ledger = Ledger()
        self.submits: dict[int, Submit] = {}
        self.bad: set[int] = set()  # submits the batch generator rejects
        self.uid: dict[int, tuple] = {}  # rid -> (generator, uid)
        self.aborts: list[tuple] = []  # (generator, uid, index into generator.calls)
        self.injected_failures = 0
        self.next_id = 1

    @rule(
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
        max_tokens=st.integers(1, 6),
        data=st.data(),
    )
    def submit(self, prompt, max_tokens, data):
        rid = self.next_id
        self.next_id += 1
        prompt = tuple(prompt)
        cuts = (
            sorted(data.draw(st.sets(st.integers(1, len(prompt) - 1), max_size=2), "cuts"))
            if len(prompt) > 1
            else []
        )
        bounds = [0, *cuts, len(prompt)]
        segments = tuple(prompt[a:b] for a, b in zip(bounds, bounds[1:], strict=False))
        types = ("system", "user", "assistant")[-len(segments) :]
        if data.draw(st.integers(0, 9), "bad") == 0:
            max_tokens = 0  # the batch generator rejects it: SequenceFailed, engine unharmed
            self.bad.add(rid)
        sub = make_submit(rid, prompt, max_tokens, segments, types)
        self.submits[rid] = sub
        gen = self.factory.current
        before = len(gen.inserted)
        self.core.handle_command(sub)
        if rid in self.bad:
            assert len(gen.inserted) == before
            assert rid not in self.core.active_request_ids
        else:
            assert gen.inserted[before:] == [gen.inserted[-1]]
            self.uid[rid] = (gen, gen.inserted[-1])
            assert gen.sequences[gen.inserted[-1]].prompt == list(prompt)
            assert gen.sequences[gen.inserted[-1]].segments == [list(x) for x in segments]
            # What the prompt-cache policy's byte budget gives way to, measured now.
            self.batch_kv_bytes[rid] = gen.prompt_cache_nbytes
            # A duplicate submit while active is ignored.
            self.core.handle_command(sub)
            assert len(gen.inserted) == before + 1

    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from([*self.submits, 10**9]), "rid")
        active = rid in self.core.active_request_ids
        if active:
            gen, uid = self.uid[rid]
            assert gen is self.factory.current
            self.aborts.append((gen, uid, len(gen.calls)))
        event("abort: active" if active else "abort: not active")
        self.core.handle_command(Abort(request_id=rid))
        assert rid not in self.core.active_request_ids
        if active:
            assert gen.remove_calls[-1] == (uid,)
            assert uid not in gen.active_uids

    @rule()
    def step(self):
        gen = self.factory.current
        active = set(self.core.active_request_ids)
        pending_bad = {r for r in self.bad if r not in self.ledger.terminal}
        n_generators = len(self.factory.instances)
        out = self.core.step()
        self.ledger.record(out)
        failed = {e.request_id for e in out.failed}
        if len(self.factory.instances) > n_generators:
            # The step raised: every active sequence failed, on a fresh generator.
            self.injected_failures += 1
            event(f"engine: injected failure with {min(len(active), 2)} active")
            assert gen.fail_on_step == gen.next_calls
            assert gen.closed
            assert failed == active | pending_bad
            assert self.core.active_request_ids == set()
            assert all(
                "injected failure" in e.message for e in out.failed if e.request_id in active
            )
        else:
            assert failed == pending_bad
        assert out.stats.active_sequences == len(self.core.active_request_ids)
        assert out.stats.steps == self.ledger.steps
        for started in out.started:
            assert started.batch_kv_bytes == self.batch_kv_bytes[started.request_id]
        # The cache events account for every entry, and the engine evicts nothing
        # by itself (the prompt-cache policy decides; tests/test_prompt_cache_policy.py).
        for e in out.cache_events:
            if isinstance(e, CacheEntryStored):
                self.stored[e.entry_id] = ("fake", e.tokens)
                assert e.nbytes == sum(c.nbytes for c in self.cache.entries[("fake", e.tokens)][0])
            else:
                del self.stored[e.entry_id]
        assert sorted(self.stored.values()) == sorted(self.cache.entries)
        assert self.cache.removals == []

    @invariant()
    def consistent(self):
        if not hasattr(self, "core"):
            return
        active = self.core.active_request_ids
        assert active <= set(self.submits) - set(self.ledger.terminal) - self.bad
        assert self.core.has_work == bool(active)
        gen = self.factory.current
        assert {self.uid[r][1] for r in active} == gen.active_uids

    @invariant()
    def aborted_never_stepped_again(self):
        if not hasattr(self, "core"):
            return
        for gen, uid, at in self.aborts:
            for record in gen.steps_after(at):
                assert uid not in record.uids, f"aborted uid {uid} in step {record.index}"

    def teardown(self):
        if not hasattr(self, "core"):
            return
        for _ in range(200):
            if not self.core.has_work:
                break
            self.step()
        assert not self.core.has_work
        # A fresh submit after everything (including any failure) is still served;
        # if it meets the injected failure instead, the one after it is served.
        for attempt in range(2):
            rid = self.next_id
            self.next_id += 1
            self.submits[rid] = make_submit(rid, (7, 8), max_tokens=2)
            self.core.handle_command(self.submits[rid])
            self.uid[rid] = (self.factory.current, self.factory.current.inserted[-1])
            self.batch_kv_bytes[rid] = self.factory.current.prompt_cache_nbytes
            failures = self.injected_failures
            for _ in range(4):
                self.step()
            kind = self.ledger.terminal[rid][0]
            if kind == "finish":
                break
            assert attempt == 0 and kind == "failed" and self.injected_failures == failures + 1
        else:
            raise AssertionError("the engine did not recover")
        self.ledger.record(self.core.close())
        assert self.factory.current.closed
        self.aborted_never_stepped_again()
        # Every request got exactly one terminal event.
        assert set(self.ledger.terminal) == set(self.submits)
        for rid, (kind, terminal) in self.ledger.terminal.items():
            started = [k for k, _ in self.ledger.events[rid] if k == "started"]
            if rid in self.bad:
                assert kind == "failed" and started == []
                continue
            assert started == ["started"]
            assert self.ledger.events[rid][0][0] == "started"
            gen, uid = self.uid[rid]
            got = self.ledger.tokens(rid)
            want = gen.expected_tokens(uid)
            if kind == "finish":
                # Routed to the right request, in order, all of them.
                assert got == want
                assert terminal.finish_reason == ("stop" if want[-1] == EOS else "length")
            else:  # aborted or failed part-way: a strict prefix of the script
                assert got == want[: len(got)] and len(got) < len(want)


EngineMachine.TestCase.settings = STATEFUL
TestEngine = EngineMachine.TestCase


# ------------------------------------------------------- failure injection


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    batch=st.integers(1, 4),
    fail_on_step=st.integers(1, 6),
    max_tokens=st.integers(1, 8),
)
def test_failed_step_fails_every_active_sequence_and_engine_recovers(
    n, batch, fail_on_step, max_tokens
):
    core, factory, _ = engine_with_fake(fail_on_step=fail_on_step, batch=batch)
    old = factory.current
    ledger = Ledger()
    submitted = []

    def submit():
        rid = len(submitted) + 1
        submitted.append(rid)
        core.handle_command(make_submit(rid, (rid, 2 * rid), max_tokens=max_tokens))

    for _ in range(n):
        submit()
    # Step (submitting more whenever the engine runs dry) until the injected failure.
    for _ in range(fail_on_step):
        if not core.has_work:
            submit()
        active = set(core.active_request_ids)
        out = core.step()
        ledger.record(out)
        if out.failed:
            break
    assert old.next_calls == fail_on_step
    assert {e.request_id for e in out.failed} == active  # every active sequence, only them
    assert out.tokens == () and out.progress == ()
    assert not core.has_work and core.active_request_ids == set()
    assert old.closed and len(factory.instances) == 2
    assert set(ledger.terminal) == set(submitted)

    # The engine keeps serving: new submits run to completion on the new generator.
    uids = {}
    for rid in (100, 101):
        core.handle_command(make_submit(rid, (rid, 1), max_tokens=3))
        uids[rid] = factory.current.inserted[-1]
    for _ in range(10):
        ledger.record(core.step())
    for rid in (100, 101):
        assert ledger.terminal[rid][0] == "finish"
        assert ledger.tokens(rid) == factory.current.expected_tokens(uids[rid])
    assert old.steps_after(len(old.calls) - 1) == []  # the old generator is never used again


# --------------------------------------------------------- run_engine_loop

loop_op = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 5)),
    st.tuples(st.just("abort"), st.integers(0, 20)),
)


@settings(max_examples=40, deadline=None)
@given(
    script=st.lists(st.lists(loop_op, max_size=3), max_size=12),
    fail_on_step=st.one_of(st.none(), st.integers(1, 10)),
)
def test_engine_loop_gives_every_submit_one_terminal(script, fail_on_step):
    """The thread body, run inline: commands arrive between steps, then Shutdown;
    whatever is still running when it returns is failed in the final outputs."""
    holder = {}

    def make_core():
        core, factory, _ = engine_with_fake(fail_on_step=fail_on_step, batch=2)
        holder["factory"] = factory
        return core

    inbox: queue.SimpleQueue = queue.SimpleQueue()
    ledger = Ledger()
    batches = iter(script)
    submitted: list[int] = []

    def check_cancelled():
        # Called at the top of each loop iteration: feed the next batch of commands.
        batch = next(batches, None)
        if batch is None:
            inbox.put(Shutdown())
            return
        for kind, arg in batch:
            if kind == "submit":
                rid = len(submitted) + 1
                submitted.append(rid)
                inbox.put(make_submit(rid, (rid, 3), max_tokens=arg))
            elif submitted:
                inbox.put(Abort(request_id=submitted[arg % len(submitted)]))

    ready = []
    run_engine_loop(
        make_core, inbox, ledger.record, check_cancelled, on_ready=ready.append, idle_wait=0.001
    )
    assert len(ready) == 1
    assert set(ledger.terminal) == set(submitted)
    assert holder["factory"].current.closed
    for kind, terminal in ledger.terminal.values():
        if kind != "failed":
            continue
        # Two causes only: a failed step (500, the request's own) or the
        # shutdown that ended the loop (503: retryable, the engine's).
        shutdown = terminal.message == "the engine is shutting down"
        assert terminal.retryable == shutdown
        if fail_on_step is None:
            assert shutdown, terminal.message


def test_engine_loop_emits_nothing_for_idle_steps():
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    emitted: list[StepOutputs] = []
    calls = iter(range(3))

    def check_cancelled():
        if next(calls, None) is None:
            inbox.put(Shutdown())

    run_engine_loop(
        lambda: engine_with_fake()[0], inbox, emitted.append, check_cancelled, idle_wait=0.001
    )
    assert emitted == []


def test_engine_stats_follow_the_prompt_cache():
    core, factory, cache = engine_with_fake(batch=2)
    core.handle_command(make_submit(1, (1, 2, 3), max_tokens=2))
    outs = [core.step() for _ in range(4)]
    assert isinstance(outs[-1].stats, EngineStats)
    # The finished sequence's cache was offered to the prompt cache.
    assert cache.inserts and cache.inserts[-1][2] == "assistant"
    assert outs[-1].stats.prompt_cache_entries == len(cache)
    assert outs[-1].stats.prompt_cache_bytes == cache.nbytes


@pytest.mark.parametrize("per_segment", [False, True])
def test_segment_caches_are_saved_with_their_types(per_segment):
    core, factory, cache = engine_with_fake(per_segment=per_segment)
    prompt = (1, 2, 3, 4, 5, 6)
    segments = ((1, 2), (3, 4, 5), (6,))
    core.handle_command(
        make_submit(
            1, prompt, max_tokens=1, segments=segments, types=("system", "user", "assistant")
        )
    )
    for _ in range(6):
        core.step()
    saved = [(tokens, kind) for _, tokens, kind in cache.inserts]
    finished = [(t, k) for t, k in saved if k == "assistant"]
    assert len(finished) == 1 and finished[0][0][: len(prompt)] == prompt
    if per_segment:
        # One save at each inner segment boundary, with that segment's type.
        assert [s for s in saved if s[1] != "assistant"] == [
            ((1, 2), "system"),
            ((1, 2, 3, 4, 5), "user"),
        ]
    else:
        assert len(saved) == 1


# Models as mlx-lm's make_prompt_cache sees them: layers of plain KVCache, or a
# cache of the model's own (a sliding window here).
PLAIN_KV_MODEL = SimpleNamespace(layers=[None, None])
WINDOWED_MODEL = SimpleNamespace(
    layers=[None], make_cache=lambda: [RotatingKVCache(max_size=8), KVCache()]
)


def _saves_and_steps_to_finish(model):
    """The prompt-cache inserts of one thinking-tailed prompt, and the steps until
    its finished entry is stored."""
    core, factory, cache = engine_with_fake(per_segment=True, model=model)
    core.handle_command(
        make_submit(
            1,
            (1, 2, 3, 4, 5, 6, 7),
            max_tokens=1,
            segments=((1, 2), (3, 4, 5), (6, 7)),
            types=("system", "user", "assistant"),
        )
    )
    steps = 0
    while not cache.inserts or cache.inserts[-1][2] != "assistant":
        core.step()
        steps += 1
        assert steps < 10
    return [(tokens, kind) for _, tokens, kind in cache.inserts], steps


def test_the_save_point_before_a_thinking_tail_is_kept_only_for_caches_that_cannot_trim():
    inner = [((1, 2), "system"), ((1, 2, 3, 4, 5), "user")]
    plain_saves, plain_steps = _saves_and_steps_to_finish(PLAIN_KV_MODEL)
    for model in (WINDOWED_MODEL, None):  # None: a model that cannot say
        saves, steps = _saves_and_steps_to_finish(model)
        assert saves[:-1] == inner
        assert saves[-1][0][:7] == (1, 2, 3, 4, 5, 6, 7)
        # The tail's save point is a prefill stop of its own.
        assert steps == plain_steps + 1
    assert plain_saves[:-1] == inner[:1]
    # The finished entry covers the whole prompt: a plain cache is trimmed back
    # to what the next turn repeats.
    assert plain_saves[-1][0][:7] == (1, 2, 3, 4, 5, 6, 7)


def test_logprobs_are_reported_for_the_requests_that_ask():
    factory = FakeBatchGeneratorFactory(vocab=VOCAB, eos_ids={EOS}, emit_logprobs=True)
    core = EngineCore(
        LoadedModel(model=None, tokenizer=None, info=ModelInfo(model_key="fake", vocab_size=VOCAB)),
        batch_generator_factory=factory,
        prompt_cache=FakePromptCache(),
    )
    plain = make_submit(1, (1, 2), max_tokens=2)
    wants = Submit(**{**attrs.asdict(plain, recurse=False), "request_id": 2, "top_logprobs": 2})
    core.handle_command(plain)
    core.handle_command(wants)
    ledger = Ledger()
    for _ in range(4):
        ledger.record(core.step())
    for kind, e in ledger.events[1]:
        if kind == "token":
            assert e.logprob is None and e.top_logprobs == ()
    tokens = [e for kind, e in ledger.events[2] if kind == "token"]
    assert len(tokens) == 2
    for e in tokens:
        assert e.logprob == pytest.approx(e.top_logprobs[0][1])
        assert e.top_logprobs[0][0] == e.token and len(e.top_logprobs) == 2
        assert e.top_logprobs[0][1] > e.top_logprobs[1][1]
