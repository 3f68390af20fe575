"""Properties of the whole runtime: many concurrent Sessions against one ``Runtime``.

1. With the fake engine (``EngineCore`` over ``FakeBatchGenerator`` and
   ``FakeTokenizer``, stepped on the real engine thread through ``Runtime``):
   random mixes of requests that read to the end, disconnect (their cancel
   scope is cancelled while they wait in ``receive()``, as quart-trio does when
   a client goes away) or hit their deadline, with an optional engine-step
   failure. Every request that was not cancelled gets exactly one terminal and
   nothing after it, with the text and token count the fake's script implies,
   and the runtime returns to idle with no sequence left in the batch and the
   engine's prompt cache holding exactly the prompt-cache policy's index, within
   its count limit (its evictions went through the engine's inbox).
2. With the real tiny model: each surviving request of a concurrent, greedy
   mix gets exactly the text and finish reason it gets when served alone on
   the same runtime (answers never leak between concurrent prompts: the class
   of bug of mlx-lm #965).

Also a regression test for a bug found on the way: a reader slower than the
engine was not held to its deadline.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio
import trio.lowlevel
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from actors.system import Runtime
from runtime.config import ServerConfig
from runtime.engine.core import EngineCore
from runtime.errors import Overloaded
from runtime.lifecycle import ModelInfo
from runtime.loaded_model import LoadedModel
from runtime.messages import Delta, Failed, Finished, Progress, SamplingParams
from runtime.prompts import prepare_text
from tests.conftest import poll_until
from tests.fakes import (
    FAKE_EOS_ID,
    FakeBatchGeneratorFactory,
    FakePromptCache,
    FakeTokenizer,
    scripted_token,
)

TOKENIZER = FakeTokenizer()
VOCAB = len(TOKENIZER)
EOS_IDS = frozenset({FAKE_EOS_ID})
QUIET_SECONDS = 0.1  # > the engine's idle wait: long enough for in-flight Aborts to land


# ------------------------------------------------------------------ clients


@attrs.define
class Plan:
    """One request of an example, and how its client behaves."""

    prompt: tuple[int, ...] | str
    max_tokens: int
    arrival: tuple[str, float]  # ("checkpoints", n) or ("sleep", seconds)
    behaviour: str = "read"  # "read" | "disconnect" | "deadline"
    receives_before_disconnect: int = 0  # -1: while the Session is being entered
    cancel_lag: int = 0  # checkpoints between the disconnect and the cancel landing
    timeout: float | None = None
    markup: bool = False
    stop: tuple[str, ...] = ()


@attrs.define
class Outcome:
    request_id: int | None = None
    refused: BaseException | None = None
    batches: list[tuple] = attrs.Factory(list)
    end_of_channel: bool = False
    again_end_of_channel: bool = False  # receive() after EndOfChannel raises it again
    cancelled: bool = False
    left_at: object = None  # the engine's position when the Session closed (aborting it)

    @property
    def events(self) -> list:
        return [event for batch in self.batches for event in batch]

    @property
    def terminals(self) -> list[Finished | Failed]:
        return [e for e in self.events if isinstance(e, Finished | Failed)]

    @property
    def content(self) -> str:
        return "".join(e.content for e in self.events if isinstance(e, Delta))


async def arrive(arrival: tuple[str, float]) -> None:
    kind, amount = arrival
    if kind == "checkpoints":
        for _ in range(int(amount)):
            await trio.lowlevel.checkpoint()
    else:
        await trio.sleep(amount)


async def cancel_after(scope: trio.CancelScope, checkpoints: int) -> None:
    for _ in range(checkpoints):
        await trio.lowlevel.checkpoint()
    scope.cancel()


async def client(
    runtime: Runtime,
    plan: Plan,
    out: Outcome,
    nursery: trio.Nursery,
    engine_position: Callable[[], object] = lambda: None,
) -> None:
    """What an HTTP handler does with a Session; a disconnect cancels ``scope``
    (from a task in ``nursery``, as quart-trio's disconnect watcher does)."""
    await arrive(plan.arrival)
    prompt = plan.prompt if isinstance(plan.prompt, str) else list(plan.prompt)
    with trio.CancelScope() as scope:
        if plan.behaviour == "disconnect" and plan.receives_before_disconnect < 0:
            nursery.start_soon(cancel_after, scope, plan.cancel_lag)
        session = runtime.session(
            prepare=lambda tokenizer: prepare_text(tokenizer, prompt),
            sampling=SamplingParams(),
            max_tokens=plan.max_tokens,
            stop=plan.stop,
            markup=plan.markup,
            timeout=plan.timeout,
        )
        try:
            async with session:
                out.request_id = session.request_id
                assert out.request_id is not None
                receives = 0
                while True:
                    if (
                        plan.behaviour == "disconnect"
                        and receives == plan.receives_before_disconnect
                    ):
                        nursery.start_soon(cancel_after, scope, plan.cancel_lag)
                    try:
                        batch = await session.receive()
                    except trio.EndOfChannel:
                        out.end_of_channel = True
                        break
                    assert batch, "receive() never returns an empty batch"
                    receives += 1
                    out.batches.append(batch)
                try:
                    await session.receive()
                except trio.EndOfChannel:
                    out.again_end_of_channel = True
        except Overloaded as exc:
            out.refused = exc
        finally:
            # No checkpoint since the Session's (synchronous) exit: where the engine was then.
            out.left_at = engine_position()
    out.cancelled = scope.cancelled_caught


def check_stream_shape(plan: Plan, out: Outcome) -> None:
    """At most one terminal, nothing after it; exactly one unless cancelled."""
    events = out.events
    terminals = out.terminals
    assert len(terminals) <= 1, (plan, events)
    if terminals:
        assert events[-1] is terminals[0], f"events after the terminal: {events}"
    for batch in out.batches:  # each batch: progress, then a delta, then the terminal
        kinds = [0 if isinstance(e, Progress) else 1 if isinstance(e, Delta) else 2 for e in batch]
        assert kinds == sorted(set(kinds)), batch
    if not out.cancelled:
        assert len(terminals) == 1, (plan, out)
        assert out.end_of_channel and out.again_end_of_channel, (plan, out)


async def wait_idle(runtime: Runtime, seconds: float = 10.0) -> None:
    """Poll until the runtime is idle, let in-flight engine commands land, and recheck."""

    def idle() -> bool:
        inbox = runtime.model_loader.inbox
        return (
            runtime.scheduler.figures().in_flight == 0
            and runtime.detokenizer.open_requests() == 0
            and runtime.scheduler.figures().stats.active_sequences == 0
            and (inbox is None or inbox.empty())
        )

    await poll_until(idle, seconds)
    await trio.sleep(QUIET_SECONDS)
    assert runtime.scheduler.figures().in_flight == 0
    assert runtime.scheduler.figures().waiting == 0 and runtime.scheduler.figures().running == 0
    assert runtime.scheduler.figures().kv_reserved_bytes == 0
    assert runtime.detokenizer.open_requests() == 0
    assert runtime.scheduler.figures().stats.active_sequences == 0
    assert runtime.model_loader.status().leases == 0, "a Session kept its model lease"


# ------------------------------------------------------- 1. the fake engine


def script(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """The tokens the fake generates for ``prompt`` when left to finish."""
    tokens = []
    for i in range(max_tokens):
        token = scripted_token(prompt, i, VOCAB)
        tokens.append(token)
        if token in EOS_IDS:
            break
    return tokens


arrivals = st.one_of(
    st.tuples(st.just("checkpoints"), st.integers(0, 3)),
    st.tuples(st.just("sleep"), st.sampled_from([0.0, 0.0005, 0.002, 0.005])),
)


@st.composite
def fake_plans(draw) -> Plan:
    behaviour = draw(st.sampled_from(["read", "disconnect", "deadline"]))
    return Plan(
        prompt=(),  # made unique per example below
        max_tokens=draw(st.integers(1, 20)),
        arrival=draw(arrivals),
        behaviour=behaviour,
        receives_before_disconnect=draw(st.integers(-1, 4)) if behaviour == "disconnect" else 0,
        cancel_lag=draw(st.integers(0, 2)),
        timeout=(
            draw(st.sampled_from([0.0, 0.0005, 0.002, 0.01, 0.05]))
            if behaviour == "deadline"
            else None
        ),
        markup=draw(st.booleans()),
    )


@st.composite
def fake_examples(draw):
    # Unique prompts: the fake's sequences are matched to their requests by prompt.
    prompts = draw(
        st.lists(
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8).map(tuple),
            min_size=1,
            max_size=12,
            unique=True,
        )
    )
    plans = [attrs.evolve(draw(fake_plans()), prompt=p) for p in prompts]
    config = ServerConfig(
        model="fake",
        decode_concurrency=draw(st.integers(1, 4)),
        prompt_concurrency=draw(st.integers(1, 2)),
        max_queued_requests=draw(st.sampled_from([256, 1, 2, 4])),
        prompt_cache_size=draw(st.sampled_from([3, 10, 1, 0])),
    )
    batch_size = draw(st.integers(1, 4))
    fail_on_step = draw(st.none() | st.integers(1, 25))
    return plans, config, batch_size, fail_on_step


def fake_runtime(
    config: ServerConfig, factory: FakeBatchGeneratorFactory, caches: list | None = None
) -> Runtime:
    """A Runtime over fake engines; each engine's prompt cache is appended to ``caches``."""

    def make_core() -> EngineCore:
        handle = LoadedModel(
            model=None, tokenizer=TOKENIZER, info=ModelInfo(model_key="fake", vocab_size=VOCAB)
        )
        cache = FakePromptCache()
        if caches is not None:
            caches.append(cache)
        return EngineCore(handle, batch_generator_factory=factory, prompt_cache=cache)

    return Runtime(config, make_core=make_core)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(example=fake_examples())
async def test_concurrent_sessions_each_get_one_terminal_and_the_runtime_returns_to_idle(example):
    plans, config, batch_size, fail_on_step = example
    factory = FakeBatchGeneratorFactory(
        fail_on_step=fail_on_step, vocab=VOCAB, eos_ids=EOS_IDS, completion_batch_size=batch_size
    )

    def engine_position() -> tuple[int, int]:
        return len(factory.instances) - 1, factory.current.next_calls

    caches: list[FakePromptCache] = []
    runtime = fake_runtime(config, factory, caches)
    outcomes = [Outcome() for _ in plans]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.run)
            await poll_until(lambda: runtime.model_loader.status().info is not None)
            async with trio.open_nursery() as clients:
                for plan, out in zip(plans, outcomes, strict=True):
                    clients.start_soon(client, runtime, plan, out, clients, engine_position)
            await wait_idle(runtime)
            assert not factory.current.active_uids, "sequences left in the batch"
            index = runtime.prompt_cache.entries().values()
            assert sorted(t for t, _, _ in index) == sorted(t for _, t in caches[-1].entries)
            assert len(caches[-1]) <= config.prompt_cache_size
            if caches[-1].removals:
                event("prompt cache entries evicted")
            # Generators closed while serving were replaced after a failed step
            # (shutting down closes the rest).
            failed = [gen for gen in factory.instances if gen.closed]
            nursery.cancel_scope.cancel()
    assert runtime.dead is None
    if fail_on_step is None:
        assert not failed
    for plan, out in zip(plans, outcomes, strict=True):
        if out.refused is not None:
            event("refused (429)")
            assert out.request_id is None and not out.batches
            continue
        if out.cancelled:
            event("disconnected")
        if out.request_id is None:  # disconnected while the Session was being entered
            event("disconnected while entering")
            assert out.cancelled and not out.batches
            assert not placements(factory, plan)
            continue
        check_stream_shape(plan, out)

        expected = script(plan.prompt, plan.max_tokens)
        (terminal,) = out.terminals or (None,)
        deadline_hit = (
            plan.behaviour == "deadline"
            and isinstance(terminal, Finished)
            and terminal.finish_reason == "length"
            and terminal.usage.completion_tokens < len(expected)
        )
        check_left_the_batch(factory, failed, plan, out, aborted=out.cancelled or deadline_hit)

        text = TOKENIZER.decode([t for t in expected if t not in EOS_IDS])
        if not plan.markup:
            assert text.startswith(out.content), (out.content, text)
        if isinstance(terminal, Failed):
            event("failed by the engine step")
            assert fail_on_step is not None, terminal
            assert "injected failure" in terminal.message
            continue
        if terminal is None:
            assert out.cancelled
            continue
        assert terminal.finish_reason != "abort"
        usage = terminal.usage
        assert usage.prompt_tokens == len(plan.prompt)
        assert usage.completion_tokens <= plan.max_tokens
        if deadline_hit:
            event("deadline hit")
            continue
        event(f"served to the end: {terminal.finish_reason}")
        # Served to the end: exactly what the fake's script says.
        reason = "stop" if expected[-1] in EOS_IDS else "length"
        if reason == "stop" and plan.markup and terminal.finish_reason == "tool_calls":
            reason = "tool_calls"
        assert (terminal.finish_reason, usage.completion_tokens) == (reason, len(expected)), (
            plan,
            terminal,
        )
        if reason == "length":
            assert usage.completion_tokens == plan.max_tokens
        if not plan.markup:
            assert out.content == text
        ((gen, uid),) = placements(factory, plan)
        assert gen.finished.get(uid) == ("stop" if reason != "length" else "length")


def placements(factory: FakeBatchGeneratorFactory, plan: Plan) -> list[tuple[object, int]]:
    """Where the request's sequence went in the fake: (generator, uid), matched by prompt."""
    return [
        (gen, uid)
        for gen in factory.instances
        for uid, seq in gen.sequences.items()
        if tuple(seq.prompt) == plan.prompt
    ]


def finish_step(gen, uid: int) -> int:
    return next(
        record.index
        for record in gen.steps
        for u, _, reason in record.generated
        if u == uid and reason is not None
    )


def check_left_the_batch(factory, failed, plan: Plan, out: Outcome, *, aborted: bool) -> None:
    """The sequence entered the batch at most once and was never left behind in it.

    An aborted request (disconnected, or past its deadline) was removed from the
    batch, failed with its generator, or had already finished: at the latest in
    the step the engine was in (or about to start) when the Session aborted it.
    """
    placed = placements(factory, plan)
    assert len(placed) <= 1, f"request {out.request_id} entered the batch {len(placed)} times"
    for gen, uid in placed:
        assert uid in gen.finished or uid in gen.removed or gen in failed, (plan, out)
        if not aborted or uid in gen.removed or gen in failed:
            continue
        generation, steps = out.left_at
        index = factory.instances.index(gen)
        assert index < generation or (index == generation and finish_step(gen, uid) <= steps + 1), (
            f"request {out.request_id} was aborted when the engine was at step {steps}, "
            f"but its sequence was never removed and ran to its end at step "
            f"{finish_step(gen, uid)}: {plan}"
        )


async def test_a_receive_after_the_deadline_finishes_the_request_even_if_events_are_pending():
    """A slow reader (a client slower than the engine) is still held to its deadline.

    "Past the request's deadline the request is finished with 'length' (its
    text so far, then the terminal)": the first receive() after the deadline
    must return the terminal. Today it returns only the pending text whenever
    there is some, and the sequence keeps generating (until a receive happens to
    find the mailbox empty, or max_tokens).
    """
    runtime = fake_runtime(ServerConfig(model="fake"), FakeBatchGeneratorFactory(vocab=VOCAB))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.run)
            await poll_until(lambda: runtime.model_loader.status().info is not None)
            session = runtime.session(
                prepare=lambda tokenizer: prepare_text(tokenizer, [5, 6]),
                sampling=SamplingParams(),
                max_tokens=100_000,
                markup=False,
                timeout=0.05,
            )
            try:
                async with session:
                    await session.receive()
                    await trio.sleep(0.2)  # the client is slow: the deadline passes meanwhile
                    batch = await session.receive()
                    assert isinstance(batch[-1], Finished), batch
                    assert batch[-1].finish_reason == "length"
            finally:
                nursery.cancel_scope.cancel()


# ------------------------------------------------ 2. the real tiny model


WORDS = (
    "the cat sat on a mat and the dog ran far away hello world quick brown fox "
    "jumps over lazy river stone light dark seven apples weather in Paris"
).split()
STOPS = (" ", "e", "o", "a", "\n", ",", "is", "the", "12", "fo", "in", "wind")


@st.composite
def real_plans(draw) -> Plan:
    disconnect = draw(st.integers(0, 3))  # 0: one in four disconnects
    return Plan(
        prompt=" ".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=40))),
        max_tokens=draw(st.integers(4, 24)),
        arrival=draw(st.tuples(st.just("sleep"), st.sampled_from([0.0, 0.002, 0.01, 0.03]))),
        behaviour="disconnect" if disconnect == 0 else "read",
        receives_before_disconnect=draw(st.integers(0, 3)),
        cancel_lag=draw(st.integers(0, 2)),
        stop=tuple(draw(st.lists(st.sampled_from(STOPS), max_size=2, unique=True))),
    )


async def serve_alone(runtime: Runtime, plan: Plan) -> Outcome:
    out = Outcome()
    async with trio.open_nursery() as nursery:
        plan = attrs.evolve(plan, behaviour="read", arrival=("checkpoints", 0))
        await client(runtime, plan, out, nursery)
    return out


@settings(max_examples=7, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plans=st.lists(real_plans(), min_size=4, max_size=8),
    prefill_step_size=st.sampled_from([2048, 8]),
    prompt_concurrency=st.sampled_from([8, 2]),
)
async def test_concurrent_greedy_requests_get_the_answer_they_get_alone(
    tiny_model_path, plans, prefill_step_size, prompt_concurrency
):
    config = ServerConfig(
        model=tiny_model_path,
        prefill_step_size=prefill_step_size,
        prompt_concurrency=prompt_concurrency,
    )
    runtime = Runtime(config)
    outcomes = [Outcome() for _ in plans]
    with trio.fail_after(50):
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.run)
            await poll_until(lambda: runtime.model_loader.status().info is not None, 30)
            alone = [await serve_alone(runtime, plan) for plan in plans]
            hits = runtime.prompt_cache_figures()["hits"]
            async with trio.open_nursery() as clients:
                for plan, out in zip(plans, outcomes, strict=True):
                    clients.start_soon(client, runtime, plan, out, clients)
            await wait_idle(runtime)
            if runtime.prompt_cache_figures()["hits"] > hits:
                event("prompt cache hits while concurrent")
            nursery.cancel_scope.cancel()
    assert runtime.dead is None

    for plan, solo, out in zip(plans, alone, outcomes, strict=True):
        check_stream_shape(attrs.evolve(plan, behaviour="read"), solo)
        (solo_end,) = solo.terminals
        assert isinstance(solo_end, Finished), solo_end
        assert out.refused is None
        check_stream_shape(plan, out)
        assert solo.content.startswith(out.content), (plan, solo.content, out.content)
        if out.cancelled:
            event("disconnected")
            continue
        event(f"finished alone with {solo_end.finish_reason}")
        (end,) = out.terminals
        assert isinstance(end, Finished), end
        assert (out.content, end.finish_reason, end.usage.completion_tokens) == (
            solo.content,
            solo_end.finish_reason,
            solo_end.usage.completion_tokens,
        ), plan
