"""The engine thread: one thread owns MLX for the model's lifetime, and stops with the runtime."""

from __future__ import annotations

import threading

import trio

from runtime.config import ServerConfig
from runtime.messages import SamplingParams
from runtime.mlx_backend import make_engine_core
from runtime.prompts import prepare_text
from runtime.supervisor import Runtime
from tests.conftest import poll_until
from tests.fakes import FakeBatchGeneratorFactory, FakePromptCache


class RecordingCore:
    """Wraps a real EngineCore and records the thread of every call into it."""

    def __init__(self, core):
        self._core = core
        self.threads: set[int] = set()

    def __getattr__(self, name):
        attr = getattr(self._core, name)
        if callable(attr):
            def call(*args, **kwargs):
                self.threads.add(threading.get_ident())
                return attr(*args, **kwargs)
            return call
        return attr


async def test_all_mlx_work_runs_on_one_engine_thread_and_stops_with_the_runtime(tiny_model_path):
    config = ServerConfig(model=tiny_model_path, max_tokens=8)
    made: list[RecordingCore] = []
    load_threads: list[int] = []

    def make_core():
        load_threads.append(threading.get_ident())
        core = RecordingCore(make_engine_core(config, tiny_model_path))
        made.append(core)
        return core

    runtime = Runtime(config, make_core=make_core)
    trio_thread = threading.get_ident()
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.run)
            await poll_until(lambda: runtime.model_loader.core.handle is not None, 60)
            for i in range(3):
                session = runtime.session(
                    prepare=lambda tok, i=i: prepare_text(tok, f"hello {i}"),
                    sampling=SamplingParams(),
                    max_tokens=5,
                )
                async with session:
                    while True:
                        try:
                            await session.receive()
                        except trio.EndOfChannel:
                            break
            engine_threads = [t for t in threading.enumerate() if t.name == "mlx-engine"]
            assert len(engine_threads) == 1
            scope.cancel()
    (core,) = made
    assert core.threads == {load_threads[0]}
    assert load_threads[0] != trio_thread
    await poll_until(
        lambda: not any(t.name == "mlx-engine" and t.is_alive() for t in threading.enumerate()), 5
    )


async def test_a_failing_engine_step_fails_only_its_requests_and_the_engine_keeps_serving():
    from runtime.engine import EngineCore, ModelHandle
    from tests.fakes import FakeTokenizer

    factory = FakeBatchGeneratorFactory(fail_on_step=2)
    tokenizer = FakeTokenizer()

    def make_core():
        handle = ModelHandle(model=None, tokenizer=tokenizer, model_key="fake", vocab_size=64)
        return EngineCore(handle, batch_generator_factory=factory, prompt_cache=FakePromptCache())

    runtime = Runtime(ServerConfig(model="fake"), make_core=make_core)

    async def run_one(max_tokens):
        session = runtime.session(
            prepare=lambda tok: prepare_text(tok, [5, 6, 7]),
            sampling=SamplingParams(),
            max_tokens=max_tokens,
        )
        events = []
        async with session:
            while True:
                try:
                    events.extend(await session.receive())
                except trio.EndOfChannel:
                    return events

    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        await poll_until(lambda: runtime.model_loader.core.handle is not None)
        with trio.fail_after(10):
            first = await run_one(10)
            second = await run_one(3)
        nursery.cancel_scope.cancel()
    assert type(first[-1]).__name__ == "Failed"
    assert type(second[-1]).__name__ == "Finished"
    assert second[-1].usage.completion_tokens == 3


def test_an_abort_is_applied_at_the_next_step_and_its_wait_is_counted():
    import time

    from runtime.engine import EngineCore, ModelHandle
    from runtime.messages import Abort, Submit

    factory = FakeBatchGeneratorFactory(completion_batch_size=4)
    core = EngineCore(
        ModelHandle(model=None, tokenizer=None, model_key="fake", vocab_size=512),
        batch_generator_factory=factory,
        prompt_cache=FakePromptCache(),
    )
    for rid in (1, 2):
        core.handle_command(Submit(request_id=rid, prompt=(5, 6, 7), segments=((5, 6, 7),),
                                   segment_types=("user",), sampling=SamplingParams(),
                                   max_tokens=50))
    core.step()
    posted = Abort(request_id=1)  # posted while the next step runs
    core.step()
    core.handle_command(posted)
    out = core.step()
    assert [a.request_id for a in out.aborted] == [1]
    assert len(factory.current.removed) == 1 and 1 not in core.active_request_ids
    assert out.stats.aborts == 1
    assert out.stats.abort_wait_steps_max == 1  # it waited for the one step in progress
    assert 0 <= out.stats.abort_wait_ms_max < 10_000
    # An abort posted after the last step ends waits for none; a finished one counts nothing.
    core.handle_command(Abort(request_id=2, posted_at=time.monotonic() + 1))
    core.handle_command(Abort(request_id=99))
    assert core.stats().aborts == 2
    assert core.stats().abort_wait_steps_max == 1
