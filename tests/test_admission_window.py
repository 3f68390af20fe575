"""EngineCore's admission window (``--admission-window-ms``), over the fake batch generator.

While at least ``admission_batch`` sequences decode, a new request waits in
the engine (not in the batch) until the window is over or ``admission_batch``
requests wait; then they all join in one step. A small batch admits at once,
unless a sequence waits for its first token after its prompt, or the request
says others are on their way (``Submit.followed``: it waits for the last of
them, into an idle engine or a small batch). With a burst wait
(``--burst-wait-ms``), a request into an idle engine waits that long for others.
Held requests count as active, can be aborted, and fail on close.
"""

from __future__ import annotations

import queue
import threading
import time

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.engine.commands import SharedCommands
from runtime.engine.core import EngineCore
from runtime.engine.loop import run_engine_loop
from runtime.lifecycle import ModelInfo
from runtime.loaded_model import LoadedModel
from runtime.messages import Abort, Shutdown
from tests.fakes import FakeBatchGeneratorFactory, FakePromptCache, scripted_token
from tests.test_properties_scheduler import EOS, VOCAB, Ledger, make_submit

FOREVER = 3600.0  # a window that only the batch-size rule ends


def engine(
    window: float, batch: int = 2, completion: int = 8, commands=None, burst_wait: float = 0.0
):
    factory = FakeBatchGeneratorFactory(
        vocab=VOCAB, eos_ids={EOS}, completion_batch_size=completion
    )
    core = EngineCore(
        LoadedModel(model=None, tokenizer=None, info=ModelInfo(model_key="fake", vocab_size=VOCAB)),
        batch_generator_factory=factory,
        prompt_cache=FakePromptCache(),
        admission_window=window,
        admission_batch=batch,
        commands=commands,
        burst_wait=burst_wait,
    )
    return core, factory


def long_submit(rid: int):
    # Prompt (1, 1): scripted tokens 2 + 7i (mod 64) never hit EOS within 30 tokens.
    return make_submit(rid, (1, 1), max_tokens=30)


def test_a_small_batch_admits_at_once():
    core, factory = engine(FOREVER, batch=2)
    core.handle_command(long_submit(1))
    core.handle_command(long_submit(2))  # one decoding (< 2): no wait
    assert len(factory.current.inserted) == 2


def test_arrivals_wait_for_each_other_while_the_batch_is_full():
    core, factory = engine(FOREVER, batch=2)
    ledger = Ledger()
    for rid in (1, 2):
        core.handle_command(long_submit(rid))
    ledger.record(core.step())
    core.handle_command(long_submit(3))
    gen = factory.current
    assert len(gen.inserted) == 2  # held, not in the batch
    assert 3 in core.active_request_ids and core.has_work
    out = core.step()
    ledger.record(out)
    assert len(gen.inserted) == 2 and out.stats.active_sequences == 3
    assert not any(e.request_id == 3 for e in out.started)
    core.handle_command(long_submit(4))  # two wait now: both join in the next step
    out = core.step()
    ledger.record(out)
    assert len(gen.inserted) == 4
    assert {e.request_id for e in out.started} == {3, 4}
    assert set(gen.steps[-1].prompt_uids) == set(gen.inserted[2:])


def test_an_arrival_waits_for_the_first_token_of_a_prompt_just_processed():
    """mlx-lm gives a sequence its first token a step after its prompt; a prefill
    started in that step would delay that token, so arrivals wait (a batch of one)."""
    core, factory = engine(FOREVER, batch=8)
    core.handle_command(long_submit(1))
    out = core.step()
    assert [p.request_id for p in out.progress] == [1] and not out.tokens
    core.handle_command(long_submit(2))
    assert len(factory.current.inserted) == 1  # held, though the batch is small
    out = core.step()
    assert [e.request_id for e in out.tokens] == [1] and not out.started
    out = core.step()
    assert [e.request_id for e in out.started] == [2]
    assert [p.request_id for p in out.progress] == [2]
    # Without a window it joins at once, and a lone request never waits.
    core, factory = engine(0.0, batch=8)
    core.handle_command(long_submit(1))
    core.step()
    core.handle_command(long_submit(2))
    assert len(factory.current.inserted) == 2


def test_no_window_when_distributed():
    """Every rank must run the same steps; a window on each rank's clock would not."""
    core, factory = engine(FOREVER, batch=2, commands=SharedCommands(lambda c: c or []))
    for rid in (1, 2):
        core.handle_command(long_submit(rid))
    core.step()
    core.handle_command(long_submit(3))  # two decoding: a window would hold it
    assert len(factory.current.inserted) == 3


def test_the_window_ends_the_wait():
    core, factory = engine(0.02, batch=2)
    for rid in (1, 2):
        core.handle_command(long_submit(rid))
    core.step()
    core.handle_command(long_submit(3))
    core.step()  # within the window (a fake step takes microseconds)
    assert len(factory.current.inserted) == 2
    time.sleep(0.03)
    out = core.step()
    assert len(factory.current.inserted) == 3
    assert [e.request_id for e in out.started] == [3]
    # Its start says how long the engine held it (the access log's queued_ms adds the
    # Scheduler's queue to it); one inserted at once waited next to nothing.
    assert out.started[0].queued_seconds >= 0.03
    assert core.admission.waited(3) is None  # forgotten once read


def test_arrivals_are_forgotten_past_a_bound_and_once_started():
    from runtime.engine import admission

    core, _ = engine(0.0)
    core.handle_command(long_submit(1))  # no window: inserted as it arrives
    assert core.step().started[0].queued_seconds < 0.5
    window = admission.AdmissionWindow()
    for rid in range(admission.ARRIVALS_KEPT + 10):
        window.holds(long_submit(rid), decoding=0, awaiting_first=False)
    assert window.waited(0) is None and window.waited(9) is None  # the oldest went
    assert window.waited(10) is not None and window.waited(10) is None


def test_a_held_request_can_be_aborted_and_never_enters_the_batch():
    core, factory = engine(FOREVER, batch=2)
    for rid in (1, 2):
        core.handle_command(long_submit(rid))
    core.step()
    core.handle_command(long_submit(3))
    core.handle_command(Abort(request_id=3))
    out = core.step()
    assert [e.request_id for e in out.aborted] == [3]
    assert 3 not in core.active_request_ids
    assert len(factory.current.inserted) == 2


def test_held_requests_join_when_the_batch_shrinks_and_fail_on_close():
    core, factory = engine(FOREVER, batch=2)
    core.handle_command(make_submit(1, (1, 1), max_tokens=2))
    core.handle_command(make_submit(2, (1, 1), max_tokens=2))
    core.step()
    core.handle_command(long_submit(3))
    for _ in range(3):  # 1 and 2 finish: the batch is below 2, so 3 joins
        core.step()
    assert len(factory.current.inserted) == 3
    core2, _ = engine(FOREVER, batch=2)
    for rid in (1, 2):
        core2.handle_command(long_submit(rid))
    core2.step()
    core2.handle_command(long_submit(3))
    out = core2.close()
    assert {e.request_id for e in out.failed} == {1, 2, 3}
    assert all(e.retryable for e in out.failed)


SUBMIT_OPS = st.tuples(st.just("submit"), st.integers(1, 6), st.integers(1, 8), st.booleans())
OPS = st.lists(
    st.one_of(
        SUBMIT_OPS, st.tuples(st.just("abort"), st.integers(0, 12)), st.tuples(st.just("step"))
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), ops=OPS)
def test_every_request_ends_once_with_its_own_tokens(batch, ops):
    """Random arrivals, aborts and steps with a window that only fills up: every
    request gets one terminal, finished ones exactly their scripted tokens."""
    core, _ = engine(FOREVER, batch=batch, completion=4)
    run_ops(core, ops, followed=False)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), ops=OPS)
def test_followed_requests_whose_burst_never_comes_still_end(batch, ops):
    """Requests that say more are on their way (``Submit.followed``), whether or not
    any come: the window's own bound ends every wait, and every request still gets
    one terminal and its own tokens."""
    core, _ = engine(0.004, batch=batch, completion=4)
    run_ops(core, ops, followed=True)


def run_ops(core: EngineCore, ops, *, followed: bool) -> None:
    """Apply ``ops`` (submit / abort / step), then step until nothing is left (waiting
    out the window's holds, as the engine loop does) and check the ledger."""
    ledger = Ledger()
    submitted: dict[int, tuple] = {}
    for op in ops:
        if op[0] == "submit":
            rid = len(submitted) + 1
            prompt = tuple(range(1, op[1] + 1))
            submitted[rid] = (prompt, op[2])
            sub = make_submit(rid, prompt, max_tokens=op[2])
            core.handle_command(attrs.evolve(sub, followed=followed and op[3]))
        elif op[0] == "abort":
            core.handle_command(Abort(request_id=op[1]))
        else:
            ledger.record(core.step())
        assert core.stats().active_sequences == len(core.active_request_ids)
    for _ in range(200):
        if not core.has_work:
            break
        wait = core.hold_timeout()
        if wait:
            time.sleep(wait)
        ledger.record(core.step())
    assert not core.has_work
    ledger.record(core.step())  # what the last aborts produced goes out with a step
    assert set(ledger.terminal) == set(submitted)
    for rid, (kind, _) in ledger.terminal.items():
        if kind != "finish":
            assert kind == "aborted"
            continue
        prompt, max_tokens = submitted[rid]
        want = []
        for i in range(max_tokens):
            want.append(scripted_token(prompt, i, VOCAB))
            if want[-1] == EOS:
                break
        assert ledger.tokens(rid) == want


def followed_submit(rid: int):
    return attrs.evolve(long_submit(rid), followed=True)


def test_a_burst_of_arrivals_starts_its_prefill_together():
    """``Submit.followed``: others were being tokenised when it was sent. Even into an
    idle engine it waits (the window) for the rest of its burst, whose last one (not
    followed) lets them all in at the next step, in one prefill group."""
    core, factory = engine(FOREVER, batch=8)
    core.handle_command(followed_submit(1))
    core.handle_command(followed_submit(2))
    gen = factory.current
    assert not gen.inserted and core.has_work
    assert core.hold_timeout() > 0  # nothing decodes: the loop may wait for the rest
    out = core.step()
    assert not gen.inserted and not out.started  # still waiting for those behind
    core.handle_command(long_submit(3))
    out = core.step()
    assert {e.request_id for e in out.started} == {1, 2, 3}
    assert len(gen.steps[-1].prompt_uids) == 3
    assert core.hold_timeout() is None


def test_a_followed_request_waits_no_longer_than_the_window():
    core, factory = engine(0.02, batch=8)
    core.handle_command(followed_submit(1))
    core.step()
    assert not factory.current.inserted
    assert 0 < core.hold_timeout() <= 0.02
    time.sleep(0.03)
    assert core.hold_timeout() == 0.0
    out = core.step()
    assert [e.request_id for e in out.started] == [1]
    # Without a window nothing waits, followed or not.
    core, factory = engine(0.0, batch=8)
    core.handle_command(followed_submit(1))
    assert len(factory.current.inserted) == 1


def run_until_first_output(core, inbox) -> tuple[float, list[float], float, object]:
    """Run the engine loop over ``inbox`` until a step starts a sequence (5 s at most):
    (when the loop began, when each step began, when that output came, the output)."""
    steps: list[float] = []
    real_step = core.step

    def counted_step():
        steps.append(time.monotonic())
        return real_step()

    core.step = counted_step
    emitted = []
    began = time.monotonic()

    def check_cancelled():
        if emitted or time.monotonic() - began > 5:
            inbox.put(Shutdown())

    def emit(out):
        if out.started:
            emitted.append((time.monotonic(), out))

    run_engine_loop(lambda: core, inbox, emit, check_cancelled, idle_wait=0.001)
    at, first_out = emitted[0]
    return began, steps, at, first_out


def test_the_engine_loop_waits_for_a_held_burst_without_spinning():
    """Held requests and nothing decoding: the loop blocks on its inbox until the window
    ends (or a command comes), instead of stepping an empty batch in a tight loop."""
    core, factory = engine(0.2, batch=8)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    inbox.put(followed_submit(1))
    began, steps, _, first_out = run_until_first_output(core, inbox)
    assert [e.request_id for e in first_out.started] == [1]
    held_steps = [t for t in steps if t - began < 0.19]
    assert len(held_steps) <= 2, len(held_steps)  # a spinning loop makes thousands


def test_a_followed_request_waits_for_its_burst_while_a_small_batch_decodes():
    """A burst waits for its last request while a few sequences decode too: one prefill
    group joins them instead of one per request (each slowing the decoding rows)."""
    core, factory = engine(FOREVER, batch=8)
    core.handle_command(long_submit(1))
    for _ in range(3):  # past its prompt and its first token
        core.step()
    core.handle_command(followed_submit(2))
    core.handle_command(followed_submit(3))
    core.step()
    assert len(factory.current.inserted) == 1  # held: more are on their way
    assert core.hold_timeout() is None  # a sequence decodes: the loop keeps stepping
    core.handle_command(long_submit(4))  # the burst's last
    out = core.step()
    assert {e.request_id for e in out.started} == {2, 3, 4}
    assert len(factory.current.steps[-1].prompt_uids) == 3
    for _ in range(2):  # their first tokens
        core.step()
    # A lone request (not followed) into the small batch still joins at once.
    core.handle_command(long_submit(5))
    assert len(factory.current.inserted) == 5


def test_requests_held_behind_a_full_batch_join_as_soon_as_it_empties():
    """Held only because the batch was full: when its last rows finish, the engine loop
    steps at once (``hold_timeout`` None) and they join, without waiting out the window."""
    core, factory = engine(FOREVER, batch=2)
    for rid in (1, 2):
        core.handle_command(make_submit(rid, (1, 1), max_tokens=3))
    core.step()
    core.handle_command(long_submit(3))  # two decoding: held
    ledger = Ledger()
    while {1, 2} - set(ledger.terminal):
        assert len(factory.current.inserted) == 2
        ledger.record(core.step())
    assert core.has_work and core.hold_timeout() is None
    out = core.step()
    assert [e.request_id for e in out.started] == [3]


def test_an_idle_engine_waits_the_burst_wait_for_a_lone_requests_companions():
    """``burst_wait``: into an idle engine, a request that says nothing of others waits
    that long, so that a burst whose first Submit came before the rest had reached the
    API still starts its prefill together; a lone request then starts alone."""
    core, factory = engine(FOREVER, batch=8, burst_wait=0.05)
    core.handle_command(long_submit(1))
    gen = factory.current
    assert not gen.inserted and core.has_work
    assert 0 < core.hold_timeout() <= 0.05  # the loop may sleep until it ends
    out = core.step()
    assert not gen.inserted and not out.started
    core.handle_command(followed_submit(2))  # the rest of the burst: the window holds it
    core.handle_command(long_submit(3))  # its last
    out = core.step()
    assert {e.request_id for e in out.started} == {1, 2, 3}
    assert len(gen.steps[-1].prompt_uids) == 3
    # While sequences decode, a lone request of a small batch joins at once.
    core.step()
    core.handle_command(long_submit(4))
    assert len(gen.inserted) == 4


def test_the_burst_wait_ends_and_a_lone_request_starts_alone():
    core, factory = engine(FOREVER, batch=8, burst_wait=0.02)
    core.handle_command(long_submit(1))
    core.step()
    assert not factory.current.inserted
    time.sleep(0.03)
    assert core.hold_timeout() is not None and core.hold_timeout() == 0.0
    out = core.step()
    assert [e.request_id for e in out.started] == [1]
    assert core.hold_timeout() is None
    # Off (the default), or without the window, an idle engine admits at once.
    for window, wait in ((FOREVER, 0.0), (0.0, 0.02)):
        core, factory = engine(window, batch=8, burst_wait=wait)
        core.handle_command(long_submit(1))
        assert len(factory.current.inserted) == 1


def test_the_engine_loop_sleeps_through_the_burst_wait():
    """The loop blocks on its inbox for the burst wait (no busy stepping), and a request
    that arrives meanwhile ends it and joins the first one's prefill."""
    core, factory = engine(FOREVER, batch=8, burst_wait=1.0)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    inbox.put(long_submit(1))
    second = threading.Timer(0.05, inbox.put, args=(long_submit(2),))  # another thread posts
    second.start()
    try:
        began, steps, at, first_out = run_until_first_output(core, inbox)
    finally:
        second.cancel()
    assert {e.request_id for e in first_out.started} == {1, 2}
    assert at - began < 0.9  # the second request ended the wait, not its second
    held_steps = [t for t in steps if t - began < 0.045]
    assert len(held_steps) <= 2, len(held_steps)  # a spinning loop makes thousands
