"""The prompt-cache policy (``actors.prompt_cache.PromptCachePolicy``) against the engine.

A stateful test drives a real ``EngineCore`` (``FakeBatchGenerator``, the real
``PromptCacheStore`` over fake trimmable KV layers) and the policy as the
runtime wires them: each step's outputs go to the policy, its evictions come
back to the engine as ``EvictCache`` before the next command. After every
decision: the budget holds (entries and bytes); the index is the store (the
same entries, the same bytes); the store holds exactly what mlx-lm's own
``LRUPromptCache`` holds when given the same inserts and admission trims with
the limits (so the eviction order is mlx-lm's); and every prediction made when
a request was opened is what the engine's lookup then reused, with the same
miss reason. Unit tests pin down each miss reason.
"""

from __future__ import annotations

import logging

import trio
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from mlx_lm.models.cache import LRUPromptCache

from actors.prompt_cache import CLOSED_KEPT, PromptCachePolicy
from actors.scheduler import Scheduler, SchedulerCore
from runtime.engine.core import EngineCore
from runtime.lifecycle import ModelInfo, ModelReady
from runtime.loaded_model import LoadedModel
from runtime.messages import (
    CacheEntryRemoved,
    CacheEntryStored,
    CacheMissReason,
    EngineStats,
    EvictCache,
    SamplingParams,
    SequenceStarted,
    StepOutputs,
    Submit,
)
from runtime.mlx_lm_internals import prompt_cache_has_entry
from runtime.prompt_cache_store import PromptCacheStore
from tests.fakes import FakeBatchGeneratorFactory, FakeKVCache

MODEL = "fake"
VOCAB = 6  # a small alphabet: prompts share prefixes often
BYTES_PER_TOKEN = 4


class PolicyMachine(RuleBasedStateMachine):
    @initialize(
        max_entries=st.integers(0, 4),
        max_bytes=st.none() | st.integers(0, 400),
        min_reuse=st.integers(0, 5),
        per_segment=st.booleans(),
        batch=st.integers(1, 3),
        engine_knows_limit=st.booleans(),
    )
    def setup(self, max_entries, max_bytes, min_reuse, per_segment, batch, engine_knows_limit):
        self.factory = FakeBatchGeneratorFactory(
            vocab=VOCAB,
            completion_batch_size=batch,
            per_segment=per_segment,
            bytes_per_token=BYTES_PER_TOKEN,
        )
        self.store = PromptCacheStore(min_reuse_tokens=min_reuse)
        handle = LoadedModel(
            model=None, tokenizer=None, info=ModelInfo(model_key=MODEL, vocab_size=VOCAB)
        )
        # Knowing the limit, the engine stores no entry the limit evicts at once.
        self.engine = EngineCore(
            handle,
            batch_generator_factory=self.factory,
            prompt_cache=self.store,
            prompt_cache_max_entries=max_entries if engine_knows_limit else None,
        )
        self.policy = PromptCachePolicy(
            max_entries=max_entries, max_bytes=max_bytes, min_reuse=min_reuse
        )
        self.policy.engine_changed(MODEL)
        self.reference = LRUPromptCache(
            max_size=max_entries, max_bytes=(1 << 63) if max_bytes is None else max_bytes
        )
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.known: list[tuple[int, ...]] = [(1, 2, 3, 4, 5)]  # token runs to build prompts from
        self.predicted = {}
        self.next_id = 1

    @rule(data=st.data())
    def submit(self, data):
        base = data.draw(st.sampled_from(self.known), "base")
        keep = data.draw(st.integers(0, len(base)), "keep")
        tail = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=5), "tail")
        prompt = tuple(base[:keep]) + tuple(tail) or (0,)
        cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(prompt) - 1)), max_size=2)))
        bounds = [0, *(c for c in cuts if c < len(prompt)), len(prompt)]
        segments = tuple(prompt[a:b] for a, b in zip(bounds, bounds[1:], strict=False))
        template = data.draw(st.sampled_from(["plain", "tools"]), "template")
        conversation = data.draw(st.sampled_from(["x", "y"]), "conversation")
        rid = self.next_id
        self.next_id += 1
        self.predicted[rid] = self.policy.open(
            rid, MODEL, prompt, template_key=template, conversation_keys=(conversation,)
        )
        self.engine.handle_command(
            Submit(
                request_id=rid,
                prompt=prompt,
                segments=segments,
                segment_types=("system", "user", "assistant")[-len(segments) :],
                sampling=SamplingParams(),
                max_tokens=data.draw(st.integers(1, 3), "max_tokens"),
            )
        )
        self.known.append(prompt)

    @rule()
    def step(self):
        out, evicted = self.policy.on_step(self.engine.step())
        for started in out.started:
            self._started(started)
        for e in out.cache_events:
            if isinstance(e, CacheEntryStored):
                layer = FakeKVCache(e.tokens, BYTES_PER_TOKEN)
                self.reference.insert_cache(MODEL, list(e.tokens), [layer], cache_type=e.cache_type)
                self.known.append(e.tokens)
                event(f"stored {e.cache_type}")
            else:
                event(f"removed: {e.reason}")
        if self.max_bytes is not None and out.stats.batch_kv_bytes:
            # After each step too, the cache gives way to the batch's KV caches.
            self.reference.trim_to(n_bytes=self.max_bytes - out.stats.batch_kv_bytes)
        passed_over = self.engine.cache_entries.passed_over
        if passed_over:
            event("passed over")
        # Every entry the engine passed over is one the policy evicts in this step.
        assert passed_over <= set(evicted)
        if evicted:
            event("evicted")
            self.engine.handle_command(EvictCache(entry_ids=evicted))  # between steps
        assert not self.engine.cache_entries.passed_over

    def _started(self, started: SequenceStarted) -> None:
        predicted = self.predicted.pop(started.request_id)
        # Nothing changed between the prediction and the lookup: they agree.
        assert started.cached_tokens == predicted.reused_tokens, (started, predicted)
        assert started.miss_reason == predicted.miss_reason
        assert (started.miss_reason is None) == (started.cached_tokens > 0)
        event(f"miss: {started.miss_reason}" if started.miss_reason else "hit")
        if started.miss_reason is CacheMissReason.BELOW_FLOOR:
            assert 0 < predicted.shared_tokens < self.policy.min_reuse
        if started.miss_reason is CacheMissReason.NO_ENTRY:
            assert predicted.shared_tokens == 0
        if self.max_bytes is not None:  # mlx_lm.server trims after each admission
            self.reference.trim_to(n_bytes=self.max_bytes - started.batch_kv_bytes)

    @invariant()
    def within_budget(self):
        if not hasattr(self, "policy"):
            return
        assert len(self.policy) <= self.max_entries
        if self.max_bytes is not None:
            assert self.policy.bytes <= self.max_bytes

    @invariant()
    def the_index_is_the_store_and_mlx_lms_cache(self):
        if not hasattr(self, "policy"):
            return
        index = self.policy.entries()
        held = self.engine.cache_entries.held()
        assert {i: tokens for i, (tokens, _, _) in index.items()} == {
            i: tokens for i, (_, tokens) in held.items()
        }
        for tokens, nbytes, _ in index.values():
            assert nbytes == len(tokens) * BYTES_PER_TOKEN
        assert self.policy.bytes == self.store.nbytes and len(self.policy) == len(self.store)
        assert len(self.reference) == len(self.store)
        assert self.reference.nbytes == self.store.nbytes
        for _, tokens in held.values():
            assert prompt_cache_has_entry(self.reference, MODEL, list(tokens)), tokens


PolicyMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPolicy = PolicyMachine.TestCase


# ------------------------------------------------------------- miss reasons


def stored(
    entry_id, tokens, *, request_id=None, cache_type="assistant", trimmable=True, spans=()
):
    return CacheEntryStored(
        entry_id=entry_id,
        request_id=request_id,
        tokens=tuple(tokens),
        nbytes=len(tokens),
        cache_type=cache_type,
        trimmable=trimmable,
        spans=spans,
    )


def feed(core: PromptCachePolicy, *events) -> tuple[int, ...]:
    _, evicted = core.on_step(StepOutputs(cache_events=tuple(events)))
    return evicted


def core_with(**kwargs) -> PromptCachePolicy:
    core = PromptCachePolicy(**{"max_entries": 10, "min_reuse": 4, **kwargs})
    core.engine_changed(MODEL)
    return core


A = tuple(range(100, 120))
B = tuple(range(200, 220))


def test_a_prompt_that_extends_an_entry_is_a_hit_of_the_entry():
    core = core_with()
    feed(core, stored(1, A))
    outlook = core.explain(MODEL, A + (7, 8))
    assert (outlook.reused_tokens, outlook.miss_reason) == (len(A), None)
    exact = core.explain(MODEL, A)  # all of it: one token is given back to prefill
    assert exact.reused_tokens == len(A) - 1


def test_nothing_shared_is_no_entry_and_too_little_is_below_the_floor():
    core = core_with()
    assert core.explain(MODEL, A).miss_reason is CacheMissReason.NO_ENTRY  # empty
    feed(core, stored(1, A))
    assert core.explain(MODEL, B).miss_reason is CacheMissReason.NO_ENTRY
    short = core.explain(MODEL, A[:3] + (1, 2, 3, 4, 5))
    assert (short.miss_reason, short.shared_tokens) == (CacheMissReason.BELOW_FLOOR, 3)


def test_an_evicted_entry_explains_the_miss_and_the_order_is_mlx_lms():
    core = core_with(max_entries=3)
    events = stored(1, A, cache_type="system"), stored(2, B, cache_type="user")
    assert feed(core, *events, stored(3, (9,) * 10, cache_type="user")) == ()
    # mlx-lm takes from the first type (assistant, user, system) whose LRU is not
    # shorter than the next one's, else from system: user (2) >= system (1) here,
    assert feed(core, stored(4, (8,) * 10)) == (2,)
    # and now assistant (2) >= user (1).
    assert feed(core, stored(5, (7,) * 10)) == (4,)
    assert sorted(core.entries()) == [1, 3, 5]
    miss = core.explain(MODEL, B + (1,))
    assert (miss.reused_tokens, miss.miss_reason) == (0, CacheMissReason.EVICTED)
    figures = core.figures()
    assert figures["evictions"] == 2 and figures["evicted_bytes"] == len(B) + 10
    assert (figures["entries"], figures["bytes"]) == (3, len(A) + 20)


def test_evicted_entries_are_remembered_within_their_count_and_token_bounds():
    """The oldest ghosts go first once either bound is passed: their prompts then read
    ``no_entry``, the newer ones still ``evicted``."""
    prompts = [tuple(range(10 * i + 1000, 10 * i + 1010)) for i in range(5)]
    for bounds, remembered in (({"ghost_entries": 3}, 3), ({"ghost_tokens": 20}, 2)):
        core = core_with(max_entries=1, **bounds)
        for i, tokens in enumerate(prompts, start=1):
            feed(core, stored(i, tokens))
        assert list(core.entries()) == [5]  # entries 1-4 evicted, one after another
        reasons = [core.explain(MODEL, tokens + (1,)).miss_reason for tokens in prompts[:4]]
        forgotten = 4 - remembered
        assert reasons == [CacheMissReason.NO_ENTRY] * forgotten + [CacheMissReason.EVICTED] * remembered


def test_the_byte_budget_gives_way_to_the_running_sequences():
    core = core_with(max_bytes=50)
    feed(core, stored(1, A), stored(2, B))
    assert core.bytes == 40
    started = SequenceStarted(request_id=9, prompt_tokens=5, cached_tokens=0, batch_kv_bytes=25)
    _, evicted = core.on_step(StepOutputs(started=(started,)))
    assert evicted == (1,) and core.bytes == 20  # 50 - 25 left for the cache: the older goes


def test_entries_stored_while_the_batch_holds_its_caches_give_way_to_it():
    core = core_with(max_bytes=50)
    feed(core, stored(1, A))
    # A step that stores an entry while the batch holds 25 bytes: 20 + 20 > 50 - 25.
    _, evicted = core.on_step(
        StepOutputs(cache_events=(stored(2, B),), stats=EngineStats(batch_kv_bytes=25))
    )
    assert evicted == (1,) and core.bytes == 20
    # Once the batch is gone the limit is the whole budget again.
    assert feed(core, stored(3, (9,) * 20)) == () and core.bytes == 40


def test_a_span_several_entries_lie_in_counts_once_and_goes_with_the_last_of_them():
    system = tuple(range(300, 316))  # 16 tokens: span 1, 16 bytes
    a, b = system + (1, 2, 3, 4), system + (5, 6, 7, 8)  # their own 4 tokens: spans 2, 3
    core = core_with(max_bytes=34)
    # Counted whole they are 40 bytes, over the limit; held, 16 + 4 + 4.
    assert feed(core, stored(1, a, spans=((1, 16), (2, 4))),
                stored(2, b, spans=((1, 16), (3, 4)))) == ()
    assert (core.bytes, core.entry_bytes) == (24, 40)
    figures = core.figures()
    assert (figures["bytes"], figures["entry_bytes"]) == (24, 40)
    # A third conversation's entry of 10 tokens of its own fits (34); a fourth's does not,
    # and the oldest goes, freeing its own span only.
    c, d = system + tuple(range(10)), system + (20, 21, 22, 23)
    assert feed(core, stored(3, c, spans=((1, 16), (4, 10)))) == ()
    assert core.bytes == 34 and core.figures()["evictions"] == 0
    assert feed(core, stored(4, d, spans=((1, 16), (5, 4)))) == (1,)
    assert core.bytes == 16 + 4 + 10 + 4 and core.stats.evicted_bytes == 4
    # The system prompt's span goes only with the last entry that lies in it.
    for entry_id in (2, 3):
        feed(core, CacheEntryRemoved(entry_id=entry_id, reason="superseded"))
    assert (core.bytes, core.entry_bytes) == (20, 20)
    feed(core, CacheEntryRemoved(entry_id=4, reason="superseded"))
    assert (core.bytes, core.entry_bytes) == (0, 0)


def test_a_new_conversation_is_predicted_to_reuse_the_system_prompt_alone():
    system = tuple(range(1000, 1100))  # 100 tokens, a stored system segment: span 1
    session = system + tuple(range(2000, 2080))  # its own 80 tokens: span 2
    core = core_with()
    # The system entry comes first; the session's entry, which covers it, supersedes it
    # (reported after it), and lies in its span.
    feed(core, stored(1, system, cache_type="system", spans=((1, 100),)),
         CacheEntryRemoved(entry_id=1, reason="superseded"),
         stored(2, session, spans=((1, 100), (2, 80))))
    # Another session shares the system prompt and a user turn's few opening tokens:
    # the engine's fetch reuses the system prompt's span alone, and so says the index.
    opening = session[:105] + (7,) * 40
    assert core.explain(MODEL, opening).reused_tokens == 100
    # Sharing more than FIRST_SPAN_REACH (64) tokens past it: all of them.
    far = session[:170] + (7,) * 5
    assert core.explain(MODEL, far).reused_tokens == 170
    # The session's next turn reuses its whole entry, the span not in the way.
    assert core.explain(MODEL, session + (9,) * 5).reused_tokens == 180
    # A system entry that no other entry lies in (too short to be shared): no trim.
    plain = core_with()
    feed(plain, stored(1, session, spans=((1, 180),)))
    assert plain.explain(MODEL, opening).reused_tokens == 105


def test_the_engines_default_byte_limit_holds_where_none_was_configured():
    core = core_with()
    assert core.max_bytes is None
    core.device_budget(30)
    assert core.max_bytes == 30 and core.figures()["max_bytes"] == 30
    feed(core, stored(1, A), stored(2, B))
    assert list(core.entries()) == [2]  # 40 bytes > 30: the older goes
    core.device_budget(0)  # an engine with no default: no limit
    assert core.max_bytes is None
    configured = core_with(max_bytes=50)
    configured.device_budget(30)
    assert configured.max_bytes == 50


def test_other_template_args_for_the_same_conversation_explain_the_miss():
    core = core_with()
    core.open(1, MODEL, A, template_key="t1", conversation_keys=("c1",))
    feed(core, stored(1, A + (5, 6), request_id=1))
    # The next turn of that conversation, rendered with other arguments: other tokens.
    other = core.open(2, MODEL, B, template_key="t2", conversation_keys=("c1", "c2"))
    assert (other.reused_tokens, other.miss_reason) == (0, CacheMissReason.TEMPLATE_ARGS)
    # Another conversation with other arguments is just not cached.
    fresh = core.open(3, MODEL, B, template_key="t2", conversation_keys=("c9",))
    assert fresh.miss_reason is CacheMissReason.NO_ENTRY
    # The same arguments: the reason is what the tokens say.
    same = core.open(4, MODEL, B, template_key="t1", conversation_keys=("c1", "c2"))
    assert same.miss_reason is CacheMissReason.NO_ENTRY


def test_entries_of_a_stopped_engine_explain_the_miss_and_the_count_limit_zero_disables():
    core = core_with()
    feed(core, stored(1, A))
    core.engine_changed(MODEL)  # the engine restarted: its cache is gone
    assert len(core) == 0
    assert core.explain(MODEL, A + (1,)).miss_reason is CacheMissReason.ENGINE_RESTARTED
    disabled = core_with(max_entries=0)
    assert feed(disabled, stored(1, A)) == (1,)
    assert disabled.explain(MODEL, A).miss_reason is CacheMissReason.DISABLED


def test_misses_are_counted_by_reason_and_the_reason_reaches_the_step():
    core = core_with()
    core.open(1, MODEL, A)
    _, _ = core.on_step(StepOutputs(cache_events=(stored(1, A, request_id=1),)))
    core.open(2, MODEL, A + (1,))
    core.open(3, MODEL, B)
    out, _ = core.on_step(
        StepOutputs(
            started=(
                SequenceStarted(request_id=2, prompt_tokens=21, cached_tokens=20),
                SequenceStarted(request_id=3, prompt_tokens=20, cached_tokens=0),
            )
        )
    )
    assert [s.miss_reason for s in out.started] == [None, CacheMissReason.NO_ENTRY]
    figures = core.figures()
    assert (figures["hits"], figures["cached_tokens"]) == (1, 20)
    assert figures["misses"]["no_entry"] == 1 and figures["header_mismatches"] == 0


def test_requests_are_forgotten_when_they_end_or_are_closed():
    core = core_with()
    core.open(1, MODEL, A)
    core.open(2, MODEL, B)
    started = SequenceStarted(request_id=1, prompt_tokens=20, cached_tokens=0)
    core.on_step(StepOutputs(started=(started,)))
    core.close(1)  # started: forgotten at once
    core.close(2)  # never started: kept a while for a late start, then dropped
    assert core.remembered_requests == 1
    for rid in range(3, 3 + 1100):
        core.open(rid, MODEL, A)
        core.close(rid)
    assert core.remembered_requests == CLOSED_KEPT


def test_superseded_entries_leave_the_index_without_a_ghost():
    core = core_with()
    feed(
        core,
        stored(1, A[:10]),
        CacheEntryRemoved(entry_id=1, reason="superseded"),
        stored(2, A),
    )
    assert sorted(core.entries()) == [2]
    assert core.explain(MODEL, A[:10] + (1, 2)).reused_tokens == 10  # served by the longer one


class ListInbox(list):
    """An engine inbox that keeps what it was given."""

    def put(self, command) -> None:
        self.append(command)


def test_the_scheduler_sends_a_steps_evictions_as_one_command():
    policy = core_with(max_entries=1)
    send, _ = trio.open_memory_channel(4)
    scheduler = Scheduler(
        SchedulerCore(max_in_engine=2, max_waiting=2), to_detokenizer=send, prompt_cache=policy
    )
    inbox = ListInbox()
    scheduler.on_model_ready(ModelReady(info=ModelInfo(model_key=MODEL, vocab_size=VOCAB), inbox=inbox))
    scheduler.on_step(StepOutputs(cache_events=(stored(1, A), stored(2, B), stored(3, A[:3]))))
    assert inbox == [EvictCache(entry_ids=(1, 2))]
    scheduler.on_step(StepOutputs())  # nothing to evict: no command
    assert len(inbox) == 1


def test_a_new_engine_gives_the_policy_its_default_byte_limit():
    policy = core_with()
    send, _ = trio.open_memory_channel(4)
    scheduler = Scheduler(
        SchedulerCore(max_in_engine=2, max_waiting=2), to_detokenizer=send, prompt_cache=policy
    )
    info = ModelInfo(model_key=MODEL, vocab_size=VOCAB, prompt_cache_budget=30)
    scheduler.on_model_ready(ModelReady(info=info, inbox=ListInbox()))
    assert policy.max_bytes == 30


def test_the_policy_logs_its_figures_after_a_step_at_most_every_period(caplog):
    now = [0.0]
    policy = core_with(max_entries=1, log_every=30.0, clock=lambda: now[0])
    policy.engine_changed(MODEL)
    caplog.set_level(logging.INFO, logger="actors.prompt_cache")
    policy.on_step(StepOutputs(cache_events=(stored(1, A),)))
    now[0] = 29.0
    policy.on_step(StepOutputs(cache_events=(stored(2, B),)))
    assert not caplog.records  # within the period
    now[0] = 31.0
    policy.on_step(StepOutputs())
    assert [r.getMessage() for r in caplog.records] == [policy.log_line()]
    now[0] = 70.0
    policy.on_step(StepOutputs())  # unchanged: not logged again
    assert len(caplog.records) == 1


# ------------------------------------------------------------- the engine side


def test_an_evict_command_removes_entries_before_the_next_lookup():
    store = PromptCacheStore(min_reuse_tokens=2)
    handle = LoadedModel(
        model=None, tokenizer=None, info=ModelInfo(model_key=MODEL, vocab_size=VOCAB)
    )
    engine = EngineCore(
        handle, batch_generator_factory=FakeBatchGeneratorFactory(vocab=VOCAB), prompt_cache=store
    )
    prompt = (1, 2, 3, 4)

    def serve(rid: int) -> StepOutputs:
        engine.handle_command(
            Submit(
                request_id=rid,
                prompt=prompt,
                segments=(prompt,),
                segment_types=("assistant",),
                sampling=SamplingParams(),
                max_tokens=1,
            )
        )
        steps = [engine.step() for _ in range(3)]
        return StepOutputs(
            started=tuple(s for out in steps for s in out.started),
            cache_events=tuple(e for out in steps for e in out.cache_events),
        )

    (first,) = serve(1).cache_events
    assert isinstance(first, CacheEntryStored) and first.tokens[:4] == prompt
    engine.handle_command(EvictCache(entry_ids=(first.entry_id, 999)))  # 999: unknown
    assert len(store) == 0 and store.nbytes == 0
    second = serve(2)
    assert second.started[0].cached_tokens == 0  # gone before the next lookup
    (stored2,) = second.cache_events
    third = serve(3)  # the entry serves it (all but the token given back), and is replaced
    assert third.started[0].cached_tokens == len(prompt) - 1
    assert third.cache_events[0] == CacheEntryRemoved(entry_id=stored2.entry_id, reason="replaced")
    engine.handle_command(EvictCache(entry_ids=(stored2.entry_id,)))  # stale: a no-op
    assert len(store) == 1 and set(engine.cache_entries.held()) == {third.cache_events[1].entry_id}
    assert engine.stats().prompt_cache_entries == 1
