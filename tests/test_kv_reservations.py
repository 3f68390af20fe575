"""KV reservations: a reply reserved in steps, and sequences preempted and resumed.

Unit tests of ``actors.kv_reservations`` and of ``SchedulerCore`` around it, then a
stateful property test: the core between clients and a fake engine that emits one
token per sequence per step, applies aborts one step late and finishes sequences
at their ``max_tokens``. Whatever is preempted, each client sees one stream: one
``SequenceStarted``, every token of its reply in order, one terminal event.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from actors.kv_reservations import KvReservations, preemptible
from actors.scheduler import SchedulerCore
from runtime.messages import (
    Abort,
    AbortReason,
    ConstraintSpec,
    PromptProgress,
    SamplingParams,
    SequenceAborted,
    SequenceStarted,
    StepOutputs,
    Submit,
    TokenEvent,
)

PER_TOKEN = 10  # bytes of KV cache per token


def make_submit(request_id: int, prompt_tokens: int = 100, max_tokens: int = 64_000, **more):
    prompt = tuple(range(1, prompt_tokens + 1))
    n = 1 + len(more.get("choice_ids", ()))
    return Submit(
        request_id=request_id,
        prompt=prompt,
        segments=(prompt,),
        segment_types=("system",),
        sampling=more.pop("sampling", SamplingParams()),
        max_tokens=max_tokens,
        kv_bytes=PER_TOKEN * (prompt_tokens + max_tokens) * n,
        kv_bytes_per_token=PER_TOKEN,
        **more,
    )


def tokens(request_id: int, count: int, first: int = 1000, finish: str | None = None):
    events = [TokenEvent(request_id=request_id, token=first + i) for i in range(count)]
    if finish is not None:
        events[-1] = attrs.evolve(events[-1], finish_reason=finish)
    return tuple(events)


# ------------------------------------------------------------------ reservations


def test_a_long_max_tokens_reserves_the_reply_reserve_and_grows_in_steps():
    reservations = KvReservations(reply_tokens=50)
    submit = make_submit(1, prompt_tokens=100, max_tokens=64_000)
    assert reservations.needed(submit) == PER_TOKEN * 150  # not 64,100 tokens' worth
    reservations.start(submit)
    assert reservations.total == PER_TOKEN * 150
    reservations.count(tokens(1, 49))
    assert reservations.total == PER_TOKEN * 150  # 149 tokens held: within its room
    reservations.count(tokens(1, 1, first=2000))
    assert reservations.total == PER_TOKEN * 200  # its reply filled the room: 50 more
    # Never past the prompt plus max_tokens.
    short = make_submit(2, prompt_tokens=100, max_tokens=60)
    reservations.start(short)
    assert reservations.total == PER_TOKEN * (200 + 150)
    reservations.count(tokens(2, 50))
    assert reservations.total == PER_TOKEN * (200 + 160)


def test_requests_that_cannot_resume_reserve_max_tokens_whole():
    reservations = KvReservations(reply_tokens=50)
    constrained = make_submit(1, constraint=ConstraintSpec(kind="json_object", grammar=None))
    seeded = make_submit(2, sampling=SamplingParams(temperature=0.7, seed=3))
    several = make_submit(3, choice_ids=(4, 5))
    unknown = attrs.evolve(make_submit(6), kv_bytes_per_token=0)
    for submit in (constrained, seeded, several, unknown):
        assert not preemptible(submit)
        assert reservations.needed(submit) == submit.kv_bytes
    assert preemptible(make_submit(7))
    # With no reply reserve, every request reserves max_tokens whole.
    assert KvReservations(0).needed(make_submit(7)) == make_submit(7).kv_bytes
    reservations.start(several)
    assert reservations.total == several.kv_bytes  # a third per choice
    reservations.release(3)
    assert reservations.total == several.kv_bytes - several.kv_bytes // 3
    reservations.count(tokens(4, 10_000))  # choices do not grow: they hold max_tokens already
    assert reservations.total == several.kv_bytes - several.kv_bytes // 3
    assert reservations.preempt(budget=0) == []  # and are never preempted


# --------------------------------------------------------------- the scheduler


class Clock:
    """A clock the test moves: ``now`` seconds."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


def core_with_budget(budget_tokens: int, reply_tokens: int = 50,
                     clock: Clock | None = None) -> SchedulerCore:
    return SchedulerCore(
        max_in_engine=8, max_waiting=8, kv_budget=PER_TOKEN * budget_tokens,
        reply_reserve_tokens=reply_tokens, clock=clock or Clock(),
    )


def test_agents_long_max_tokens_run_together_within_the_budget():
    """Two requests of 100 prompt tokens asking for all the budget leaves them (the
    Session lowers a larger max_tokens to it): a budget of 400 tokens holds both with
    the reply reserve; reserving max_tokens whole, one at a time."""
    for reply_tokens, expect in ((50, [1, 2]), (0, [1])):
        core = core_with_budget(400, reply_tokens)
        for request_id in (1, 2):
            core.admit(make_submit(request_id, max_tokens=300))
        assert [s.request_id for s in core.to_start()] == expect


def test_a_sequence_that_outgrows_the_budget_preempts_the_latest_and_it_resumes():
    core = core_with_budget(330)
    first, second = make_submit(1, max_tokens=230), make_submit(2, max_tokens=230)
    core.admit(first)
    core.admit(second)
    assert [s.request_id for s in core.to_start()] == [1, 2]  # 150 + 150 of 330
    started = tuple(SequenceStarted(request_id=i, prompt_tokens=100, cached_tokens=0)
                    for i in (1, 2))
    seen, preempt = core.on_outputs(StepOutputs(started=started))
    assert seen.started == tuple(attrs.evolve(s, queued_seconds=0.0) for s in started)
    assert preempt == []
    # Both reply; the first fills its room and grows to 200: 350 > 330.
    seen, preempt = core.on_outputs(StepOutputs(tokens=tokens(1, 49) + tokens(2, 5, 2000)))
    assert preempt == [] and len(seen.tokens) == 54
    seen, preempt = core.on_outputs(StepOutputs(tokens=tokens(1, 1, 1049)))
    assert preempt == [Abort(request_id=2, reason=AbortReason.PREEMPTED)]
    assert core.kv_reserved == PER_TOKEN * (200 + 150)  # until it has left
    # The engine ran one more step before the abort reached it: that token counts.
    seen, preempt = core.on_outputs(StepOutputs(tokens=tokens(1, 1, 1050) + tokens(2, 1, 2005)))
    assert preempt == [] and len(seen.tokens) == 2
    seen, preempt = core.on_outputs(StepOutputs(aborted=(SequenceAborted(request_id=2),)))
    assert seen.aborted == ()  # the client's stream goes on
    resumed = core.waiting[2]
    assert resumed.prompt == first.prompt + tuple(range(2000, 2006))
    assert resumed.segments == (first.prompt, tuple(range(2000, 2006)))
    assert resumed.segment_types == ("system", "assistant")
    assert resumed.max_tokens == 230 - 6
    assert core.kv_reserved == PER_TOKEN * 200
    assert core.to_start() == []  # 200 + 156 would not fit
    # The first finishes: the resumed one starts, ahead of one that arrived meanwhile.
    core.admit(make_submit(3, max_tokens=230))
    core.on_outputs(StepOutputs(tokens=tokens(1, 1, 1051, finish="stop")))
    assert [s.request_id for s in core.to_start()] == [2, 3]
    assert core.reservations.preemptions == 1
    # Its SequenceStarted and prompt progress again are not the client's news; its tokens are.
    again = SequenceStarted(request_id=2, prompt_tokens=106, cached_tokens=100)
    seen, _ = core.on_outputs(StepOutputs(started=(again,)))
    assert seen.started == ()
    seen, _ = core.on_outputs(StepOutputs(tokens=tokens(2, 1, 2006)))
    assert seen.tokens == tokens(2, 1, 2006)


def two_started_the_second_preempted() -> SchedulerCore:
    """A budget of 330 tokens, two requests of 100 + 50 reserved started; the first's
    reply fills its room before the second has any: the second is preempted."""
    core = core_with_budget(330)
    core.admit(make_submit(1, max_tokens=230))
    core.admit(make_submit(2, max_tokens=230))
    core.to_start()
    _, preempt = core.on_outputs(StepOutputs(tokens=tokens(1, 50)))
    assert [a.request_id for a in preempt] == [2]
    return core


def test_a_client_that_leaves_while_its_sequence_is_preempted_gets_no_resumption():
    core = two_started_the_second_preempted()
    assert core.abort(2, AbortReason.CLOSED) == Abort(request_id=2, reason=AbortReason.CLOSED)
    seen, _ = core.on_outputs(StepOutputs(aborted=(SequenceAborted(request_id=2),)))
    assert seen.aborted == (SequenceAborted(request_id=2),)
    assert 2 not in core.waiting and core.in_engine == {1}


def test_one_preempted_before_its_start_was_seen_shows_its_resumed_start():
    core = two_started_the_second_preempted()
    core.on_outputs(StepOutputs(aborted=(SequenceAborted(request_id=2),)))
    assert core.waiting[2].prompt == make_submit(2).prompt  # nothing generated: as sent
    core.on_outputs(StepOutputs(tokens=tokens(1, 1, finish="length")))
    assert [s.request_id for s in core.to_start()] == [2]
    started = SequenceStarted(request_id=2, prompt_tokens=100, cached_tokens=0)
    seen, _ = core.on_outputs(StepOutputs(started=(started,)))
    assert seen.started == (attrs.evolve(started, queued_seconds=0.0),)


def test_each_start_carries_how_long_it_waited_for_a_place():
    """``SequenceStarted.queued_seconds``: from admission to the start the client sees
    (the access log's ``queued_ms``), the engine's own hold added; a wait for the KV
    budget shows in it."""
    clock = Clock()
    core = core_with_budget(330, clock=clock)
    core.admit(make_submit(1, max_tokens=230))
    clock.now = 0.5
    core.admit(make_submit(2, max_tokens=230))
    core.admit(make_submit(3, max_tokens=230))  # 150 x 3 tokens: over the budget
    clock.now = 1.0
    assert [s.request_id for s in core.to_start()] == [1, 2]
    # The engine says how long it held each before inserting it; the queue's wait adds.
    started = tuple(SequenceStarted(request_id=i, prompt_tokens=100, cached_tokens=0,
                                    queued_seconds=0.25) for i in (1, 2))
    clock.now = 1.2  # the engine's step: not the queue's
    seen, _ = core.on_outputs(StepOutputs(started=started))
    assert [s.queued_seconds for s in seen.started] == [1.25, 0.75]
    clock.now = 4.0
    core.on_outputs(StepOutputs(tokens=tokens(1, 1, finish="stop")))
    assert [s.request_id for s in core.to_start()] == [3]
    seen, _ = core.on_outputs(StepOutputs(
        started=(SequenceStarted(request_id=3, prompt_tokens=100, cached_tokens=0),)))
    assert seen.started[0].queued_seconds == 3.5
    # Nothing is kept for a request once its start was seen, or once it left the queue.
    core.admit(make_submit(4, max_tokens=230))
    core.abort(4, AbortReason.CLOSED)
    assert core._admitted_at == {} and core._queued == {}


def test_a_sequence_preempted_before_its_start_was_seen_reports_its_whole_wait():
    clock = Clock()
    core = core_with_budget(330, clock=clock)
    core.admit(make_submit(1, max_tokens=230))
    core.admit(make_submit(2, max_tokens=230))
    core.to_start()  # both at 0
    _, preempt = core.on_outputs(StepOutputs(tokens=tokens(1, 50)))
    assert [a.request_id for a in preempt] == [2]
    core.on_outputs(StepOutputs(aborted=(SequenceAborted(request_id=2),)))
    clock.now = 2.0
    core.on_outputs(StepOutputs(tokens=tokens(1, 1, finish="length")))
    assert [s.request_id for s in core.to_start()] == [2]
    started = SequenceStarted(request_id=2, prompt_tokens=100, cached_tokens=0)
    seen, _ = core.on_outputs(StepOutputs(started=(started,)))
    assert seen.started[0].queued_seconds == 2.0


def test_only_preemptible_sequences_leave_and_never_the_last_one():
    core = core_with_budget(400)
    core.admit(make_submit(1, max_tokens=300))  # reserves 150
    seeded = make_submit(2, max_tokens=150, sampling=SamplingParams(temperature=0.5, seed=1))
    core.admit(seeded)  # reserves 250: max_tokens whole
    assert [s.request_id for s in core.to_start()] == [1, 2]
    _, preempt = core.on_outputs(StepOutputs(tokens=tokens(1, 50)))
    # The later one cannot resume, so the one that grew leaves, however new.
    assert preempt == [Abort(request_id=1, reason=AbortReason.PREEMPTED)]
    # Alone over its budget (a reservation larger than the budget), one stays.
    alone = KvReservations(reply_tokens=50)
    alone.start(make_submit(3))
    assert alone.preempt(budget=PER_TOKEN) == []


# ------------------------------------------------------------ property test


class PreemptionMachine(RuleBasedStateMachine):
    """The core between clients and a fake engine (see the module's docstring)."""

    @initialize(
        budget=st.integers(100, 300),
        reply_tokens=st.integers(1, 16),
        max_in_engine=st.integers(1, 6),
    )
    def setup(self, budget, reply_tokens, max_in_engine):
        self.core = SchedulerCore(
            max_in_engine=max_in_engine, max_waiting=64, kv_budget=PER_TOKEN * budget,
            reply_reserve_tokens=reply_tokens,
        )
        self.engine: dict[int, list] = {}  # request id -> [submit, tokens generated]
        self.inbox: list = []  # commands the engine applies before its next step
        self.seen: dict[int, list] = {}  # what each client received: its events in order
        self.expected: dict[int, int] = {}  # the reply's length each client asked for
        self.prompt_tokens: dict[int, int] = {}

    @rule(prompt_tokens=st.integers(1, 60), max_tokens=st.integers(1, 200))
    def submit(self, prompt_tokens, max_tokens):
        # As the Session lowers it: the prompt and max_tokens fit the budget.
        max_tokens = min(max_tokens, self.core.kv_budget // PER_TOKEN - prompt_tokens)
        request_id = self.core.allocate_id()
        self.core.admit(make_submit(request_id, prompt_tokens, max_tokens))
        self.seen[request_id] = []
        self.expected[request_id] = max_tokens
        self.prompt_tokens[request_id] = prompt_tokens
        self.inbox.extend(self.core.to_start())

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def client_leaves(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.seen)))
        if any(kind == "end" for kind, _ in self.seen[request_id]):
            return
        self.seen[request_id].append(("end", "closed"))
        abort = self.core.abort(request_id, AbortReason.CLOSED)
        if abort is not None:
            self.inbox.append(abort)

    @rule()
    def engine_step(self):
        started, progress, aborted, events = [], [], [], []
        for command in self.inbox:
            if isinstance(command, Submit):
                self.engine[command.request_id] = [command, 0]
                total = len(command.prompt)
                started.append(SequenceStarted(
                    request_id=command.request_id, prompt_tokens=total, cached_tokens=0,
                ))
                progress.append(PromptProgress(request_id=command.request_id, done=total, total=total))
            elif self.engine.pop(command.request_id, None) is not None:
                aborted.append(SequenceAborted(request_id=command.request_id))
        self.inbox = []
        for request_id, running in list(self.engine.items()):
            submit, made = running
            # Each token is its place in the sequence: a resumed one's prompt holds its
            # reply so far, so its tokens go on counting from there.
            running[1] = made = made + 1
            finish = "length" if made == submit.max_tokens else None
            place = len(submit.prompt) + made
            events.append(TokenEvent(request_id=request_id, token=place, finish_reason=finish))
            if finish:
                del self.engine[request_id]
        seen, preempt = self.core.on_outputs(StepOutputs(
            started=tuple(started), progress=tuple(progress), tokens=tuple(events),
            aborted=tuple(aborted),
        ))
        for event in seen.started:
            self.seen[event.request_id].append(("started", None))
        for event in seen.progress:
            self.seen[event.request_id].append(("progress", event.done))
        for event in seen.tokens:
            self.seen[event.request_id].append(("token", event.token))
            if event.finish_reason:
                self.seen[event.request_id].append(("end", event.finish_reason))
        for event in seen.aborted:
            self.seen[event.request_id].append(("end", "aborted"))
        self.inbox.extend(preempt)
        self.inbox.extend(self.core.to_start())

    @invariant()
    def each_client_sees_one_stream(self):
        for request_id, events in self.seen.items():
            kinds = [kind for kind, _ in events]
            assert kinds.count("started") <= 1
            ends = [i for i, kind in enumerate(kinds) if kind == "end"]
            closed = ("end", "closed") in events
            if not closed:  # a client that left may still see what was on its way
                assert len(ends) <= 1 and (not ends or ends[0] == len(kinds) - 1)
                if "token" in kinds:
                    assert kinds.index("started") < kinds.index("token")
                    # The prompt's progress before the reply, never again (a resumed
                    # sequence's prefill is not the client's news).
                    assert "progress" not in kinds[kinds.index("token"):]
            replies = [value for kind, value in events if kind == "token"]
            if not closed:  # its reply so far, every token once, in order
                first = self.prompt_tokens[request_id] + 1
                assert replies == list(range(first, first + len(replies)))
                assert len(replies) <= self.expected[request_id]

    @invariant()
    def within_the_budget_but_for_one(self):
        core = self.core
        if len(core.in_engine) > 1 and not any(
            core.reservations.is_preempting(i) for i in core.in_engine
        ):
            assert core.kv_reserved <= core.kv_budget

    def teardown(self):
        # Run the engine dry: every client that stayed gets its whole reply, then its end.
        for _ in range(50_000):
            if not (self.engine or self.inbox or self.core.waiting):
                break
            self.engine_step()
        self.each_client_sees_one_stream()
        for request_id, events in self.seen.items():
            if ("end", "closed") in events:
                continue
            replies = [value for kind, value in events if kind == "token"]
            assert len(replies) == self.expected[request_id]
            assert events[-1] == ("end", "length")


PreemptionMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPreemption = PreemptionMachine.TestCase


def test_the_setting_reaches_the_scheduler():
    from runtime.config import ServerConfig

    assert ServerConfig().kv_reply_reserve_tokens == 4096
    with pytest.raises(ValueError):
        KvReservations(-1)


def test_a_prefix_held_once_admits_more_and_its_loss_preempts():
    """The engine's decoding batch holds its sessions' shared prefix once
    (``EngineStats.shared_kv_bytes``): the budget admits what that saves, and when the
    saving goes (the prefix given back to every row) the latest sequence is preempted."""
    from runtime.messages import EngineStats

    core = core_with_budget(360)
    for request_id in (1, 2, 3):
        core.admit(make_submit(request_id, max_tokens=230))
    assert [s.request_id for s in core.to_start()] == [1, 2]  # 150 + 150 of 360
    # Both decode over a 100-token prefix held once: one copy saved.
    saving = EngineStats(shared_kv_bytes=PER_TOKEN * 100)
    _, preempt = core.on_outputs(StepOutputs(stats=saving))
    assert preempt == [] and core.kv_reserved == PER_TOKEN * 200
    assert [s.request_id for s in core.to_start()] == [3]  # 200 + 150 of 360
    _, preempt = core.on_outputs(StepOutputs(stats=EngineStats(shared_kv_bytes=PER_TOKEN * 200)))
    assert preempt == [] and core.kv_reserved == PER_TOKEN * 250
    # The prefix given back: 450 of 360, the latest leaves.
    _, preempt = core.on_outputs(StepOutputs(stats=EngineStats()))
    assert preempt == [Abort(request_id=3, reason=AbortReason.PREEMPTED)]
