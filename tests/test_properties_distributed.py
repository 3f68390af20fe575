"""Lockstep property of distributed serving, with fakes: every rank runs the same steps.

Rank 0 runs ``run_engine_loop`` (commands from its inbox, at random times, with
idle gaps that trigger heartbeats); a follower runs ``run_follower_loop`` in
another thread. The collective is replaced by a rendezvous of the two threads
(``Rendezvous``: both block until both have arrived, like an ``all_sum``), and
the batch generators are ``FakeBatchGenerator``s that record every step. After
a ``Shutdown`` both generators must hold identical records: the same
sequences inserted and removed, and the same steps with the same contents.
With a prompt-cache policy deciding evictions from rank 0's outputs
(``EvictCache`` into rank 0's inbox, shared like any command), both ranks'
prompt caches also hold the same entries and removed the same ones.
"""

from __future__ import annotations

import pickle
import queue
import random
import threading
import time

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from actors.prompt_cache import PromptCachePolicy
from runtime.engine.commands import SharedCommands
from runtime.engine.core import EngineCore
from runtime.engine.loop import run_engine_loop, run_follower_loop
from runtime.lifecycle import ModelInfo
from runtime.loaded_model import LoadedModel
from runtime.messages import Abort, EvictCache, SamplingParams, Shutdown, Submit
from tests.fakes import FakeBatchGeneratorFactory, FakePromptCache

VOCAB = 64


class Rendezvous:
    """Two parties exchange rank 0's list; both block until both have arrived."""

    def __init__(self) -> None:
        self._barrier = threading.Barrier(2, timeout=20)
        self._payload = b""
        self.exchanges = 0

    def share(self, commands: list | None, *, leader: bool) -> list:
        if leader:
            self._payload = pickle.dumps(commands or [])
            self.exchanges += 1
        self._barrier.wait()  # rank 0's payload is written
        got = pickle.loads(self._payload)
        self._barrier.wait()  # both have read it
        return got


def make_core(factory: FakeBatchGeneratorFactory, share, cache=None) -> EngineCore:
    handle = LoadedModel(
        model=None, tokenizer=None, info=ModelInfo(model_key="fake", vocab_size=VOCAB)
    )
    return EngineCore(
        handle,
        batch_generator_factory=factory,
        prompt_cache=cache if cache is not None else FakePromptCache(),
        # several heartbeats in the idle gaps
        commands=SharedCommands(share, heartbeat=0.01),
    )


def submit(request_id: int, prompt: list[int], max_tokens: int) -> Submit:
    return Submit(
        request_id=request_id,
        prompt=tuple(prompt),
        segments=(tuple(prompt),),
        segment_types=("user",),
        sampling=SamplingParams(),
        max_tokens=max_tokens,
    )


@st.composite
def schedules(draw):
    """A list of (delay before, command) for rank 0's inbox, ending in Shutdown."""
    n = draw(st.integers(1, 8))
    events = []
    for request_id in range(n):
        prompt = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6))
        events.append((draw(st.sampled_from([0.0, 0.0, 0.002, 0.03])),
                       submit(request_id, prompt, draw(st.integers(1, 12)))))
        if draw(st.booleans()):
            events.append((draw(st.sampled_from([0.0, 0.001, 0.01])), Abort(request_id=request_id)))
    random.Random(draw(st.integers(0, 1000))).shuffle(events)
    events.append((draw(st.sampled_from([0.0, 0.05, 0.12])), Shutdown()))
    return events, draw(st.integers(1, 4))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=schedules())
def test_rank0_and_a_follower_run_identical_steps(plan):
    events, batch_size = plan
    rendezvous = Rendezvous()
    leader_gens = FakeBatchGeneratorFactory(completion_batch_size=batch_size, vocab=VOCAB)
    follower_gens = FakeBatchGeneratorFactory(completion_batch_size=batch_size, vocab=VOCAB)
    follower_core = make_core(follower_gens, lambda c: rendezvous.share(c, leader=False))
    errors: list[BaseException] = []

    def follower() -> None:
        try:
            run_follower_loop(follower_core)
        except BaseException as exc:  # reported below
            errors.append(exc)

    inbox: queue.SimpleQueue = queue.SimpleQueue()
    steps_emitted: list = []
    thread = threading.Thread(target=follower)
    thread.start()

    def feed() -> None:
        for delay, command in events:
            time.sleep(delay)
            inbox.put(command)

    feeder = threading.Thread(target=feed)
    feeder.start()
    run_engine_loop(
        lambda: make_core(leader_gens, lambda c: rendezvous.share(c, leader=True)),
        inbox,
        steps_emitted.append,
        lambda: None,
        idle_wait=0.001,
    )
    feeder.join()
    thread.join(20)
    assert not thread.is_alive(), "the follower did not stop with rank 0"
    assert not errors, errors

    lead, follow = leader_gens.instances, follower_gens.instances
    assert len(lead) == len(follow) == 1
    lead, follow = lead[0], follow[0]
    assert follow.inserted == lead.inserted
    assert follow.removed == lead.removed
    assert follow.finished == lead.finished
    assert follow.steps == lead.steps
    assert follower_core.stats().steps == rendezvous.exchanges


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=schedules(), max_entries=st.integers(0, 3))
def test_every_rank_evicts_the_prompt_cache_entries_rank_0s_policy_picks(plan, max_entries):
    events, batch_size = plan
    rendezvous = Rendezvous()
    caches = FakePromptCache(), FakePromptCache()
    leader_gens = FakeBatchGeneratorFactory(completion_batch_size=batch_size, vocab=VOCAB)
    follower_gens = FakeBatchGeneratorFactory(completion_batch_size=batch_size, vocab=VOCAB)
    follower_core = make_core(
        follower_gens, lambda c: rendezvous.share(c, leader=False), caches[1]
    )
    policy = PromptCachePolicy(max_entries=max_entries)
    policy.engine_changed("fake")
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def emit(outputs) -> None:  # what the Scheduler does with rank 0's steps
        _, evicted = policy.on_step(outputs)
        if evicted:
            inbox.put(EvictCache(entry_ids=evicted))

    errors: list[BaseException] = []

    def follower() -> None:
        try:
            run_follower_loop(follower_core)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def feed() -> None:
        for delay, command in events:
            time.sleep(delay)
            inbox.put(command)

    threads = [threading.Thread(target=follower), threading.Thread(target=feed)]
    for thread in threads:
        thread.start()
    run_engine_loop(
        lambda: make_core(leader_gens, lambda c: rendezvous.share(c, leader=True), caches[0]),
        inbox,
        emit,
        lambda: None,
        idle_wait=0.001,
    )
    for thread in threads:
        thread.join(20)
    assert not errors, errors
    lead, follow = caches
    assert follow.inserts == lead.inserts
    assert follow.removals == lead.removals
    assert follow.entries.keys() == lead.entries.keys()
    if lead.removals:
        event("entries evicted")
    # What rank 0 holds is what the policy kept, save evictions still in the inbox.
    kept = {tokens for tokens, _, _ in policy.entries().values()}
    assert kept <= {tokens for _, tokens in lead.entries}
