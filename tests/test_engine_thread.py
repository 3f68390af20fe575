"""The engine thread: one thread owns MLX for the model's lifetime, and stops with the runtime."""

from __future__ import annotations

import re
import threading

import pytest
import trio

from actors.system import Runtime
from runtime.config import ServerConfig
from runtime.engine.loading import make_engine_core
from runtime.messages import SamplingParams
from runtime.prompts import prepare_text
from tests.conftest import poll_until
from tests.fakes import FakeBatchGeneratorFactory, FakePromptCache


async def run_one(runtime, max_tokens: int) -> list:
    """One text request through ``runtime``: its events, the terminal last."""
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
            await poll_until(lambda: runtime.model_loader.status().info is not None, 60)
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
    from runtime.engine.core import EngineCore
    from runtime.lifecycle import ModelInfo
    from runtime.loaded_model import LoadedModel
    from tests.fakes import FakeTokenizer

    factory = FakeBatchGeneratorFactory(fail_on_step=2)
    tokenizer = FakeTokenizer()

    def make_core():
        handle = LoadedModel(
            model=None, tokenizer=tokenizer, info=ModelInfo(model_key="fake", vocab_size=64)
        )
        return EngineCore(handle, batch_generator_factory=factory, prompt_cache=FakePromptCache())

    runtime = Runtime(ServerConfig(model="fake"), make_core=make_core)

    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        await poll_until(lambda: runtime.model_loader.status().info is not None)
        with trio.fail_after(10):
            first = await run_one(runtime, 10)
            second = await run_one(runtime, 3)
        nursery.cancel_scope.cancel()
    assert type(first[-1]).__name__ == "Failed"
    assert type(second[-1]).__name__ == "Finished"
    assert second[-1].usage.completion_tokens == 3


def test_an_abort_is_applied_at_the_next_step_and_its_wait_is_counted():
    import time

    from runtime.engine.core import EngineCore
    from runtime.lifecycle import ModelInfo
    from runtime.loaded_model import LoadedModel
    from runtime.messages import Abort, Submit

    factory = FakeBatchGeneratorFactory(completion_batch_size=4)
    core = EngineCore(
        LoadedModel(model=None, tokenizer=None, info=ModelInfo(model_key="fake", vocab_size=512)),
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


async def test_steps_that_keep_failing_restart_the_engine():
    """One failed step fails its batch and the engine goes on; when the batches after
    it fail too (``FAILED_STEPS_TO_RESTART`` in a row), the engine itself is broken:
    its loop ends as a crash, /health turns 503 and the ModelLoader makes a new one,
    which serves. Every request gets its one terminal."""
    from runtime.engine.core import EngineCore
    from runtime.engine.failures import FAILED_STEPS_TO_RESTART
    from runtime.lifecycle import ModelInfo
    from runtime.loaded_model import LoadedModel
    from tests.fakes import FakeTokenizer

    # The first engine's generators all fail at their first step; the second's never.
    broken = FakeBatchGeneratorFactory(fail_on_step=[1] * 10)
    healthy = FakeBatchGeneratorFactory()
    factories = [broken, healthy]
    tokenizer = FakeTokenizer()

    def make_core():
        handle = LoadedModel(
            model=None, tokenizer=tokenizer, info=ModelInfo(model_key="fake", vocab_size=64)
        )
        factory = factories.pop(0)
        return EngineCore(handle, batch_generator_factory=factory, prompt_cache=FakePromptCache())

    runtime = Runtime(ServerConfig(model="fake"), make_core=make_core)

    async def run_or_refused():
        try:
            return await run_one(runtime, 3)
        except Exception as exc:  # refused while the engine restarts
            return [exc]

    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        await poll_until(lambda: runtime.model_loader.status().info is not None)
        with trio.fail_after(10):
            failed = [await run_or_refused() for _ in range(FAILED_STEPS_TO_RESTART)]
            await poll_until(lambda: runtime.model_loader.status().restarts == 1, 5)
            await poll_until(lambda: runtime.model_loader.status().info is not None, 5)
            served = await run_or_refused()
        nursery.cancel_scope.cancel()
    assert all(type(events[-1]).__name__ == "Failed" for events in failed), failed
    # The first generator and one after each failure (the last closed with its engine).
    assert len(broken.instances) == FAILED_STEPS_TO_RESTART + 1
    assert type(served[-1]).__name__ == "Finished" and served[-1].usage.completion_tokens == 3


def test_a_step_that_succeeds_between_failures_keeps_the_engine():
    """Only failures in a row count: a step that runs resets the count."""
    import pytest

    from runtime.engine.core import EngineCore
    from runtime.engine.failures import FAILED_STEPS_TO_RESTART, EngineBroken
    from runtime.lifecycle import ModelInfo
    from runtime.loaded_model import LoadedModel
    from runtime.messages import Submit

    assert FAILED_STEPS_TO_RESTART == 3
    # Generator by generator: the step on which it fails (None: never).
    factory = FakeBatchGeneratorFactory(fail_on_step=[1, 1, 2, 1, 1])
    core = EngineCore(
        LoadedModel(model=None, tokenizer=None, info=ModelInfo(model_key="fake", vocab_size=64)),
        batch_generator_factory=factory,
        prompt_cache=FakePromptCache(),
    )
    failed: list[int] = []

    def submit(rid: int) -> None:
        core.handle_command(Submit(request_id=rid, prompt=(5, 6, 7), segments=((5, 6, 7),),
                                   segment_types=("user",), sampling=SamplingParams(),
                                   max_tokens=5))

    def step() -> None:
        failed.extend(f.request_id for f in core.step().failed)

    for rid in (1, 2):  # two failures in a row
        submit(rid)
        step()
    submit(3)
    step()  # this one runs: the count starts again
    step()  # and the next fails it
    submit(4)
    step()  # a second failure in a row, not a third
    assert failed == [1, 2, 3, 4]
    submit(5)
    with pytest.raises(EngineBroken):
        step()  # the third in a row
    assert [f.request_id for f in core.close("broken").failed] == [5]


def _core_failing_its_first_step(failure: str):
    """An engine core whose generator raises ``failure`` at its first step, with one
    request submitted."""
    from runtime.engine.core import EngineCore
    from runtime.lifecycle import ModelInfo
    from runtime.loaded_model import LoadedModel
    from runtime.messages import Submit

    core = EngineCore(
        LoadedModel(model=None, tokenizer=None, info=ModelInfo(model_key="fake", vocab_size=64)),
        batch_generator_factory=FakeBatchGeneratorFactory(fail_on_step=1, failure=failure),
        prompt_cache=FakePromptCache(),
    )
    core.handle_command(Submit(request_id=1, prompt=(5, 6, 7), segments=((5, 6, 7),),
                               segment_types=("user",), sampling=SamplingParams(),
                               max_tokens=5))
    return core


def test_a_device_error_that_stays_with_the_process_restarts_the_engine_at_once():
    """CUDA's sticky errors (an illegal memory access) fail every later step of the
    process: the first such step ends the engine, its requests told to retry."""
    from runtime.engine.failures import EngineBroken

    core = _core_failing_its_first_step(
        "cudaLaunchHostFunc(signal_stream_, signal, this) failed: an illegal memory "
        "access was encountered")
    with pytest.raises(EngineBroken, match="the device failed"):
        core.step()
    (failed,) = core.close("broken").failed
    assert failed.request_id == 1 and failed.retryable
    assert "the engine restarts, retry shortly" in failed.message


@pytest.mark.parametrize("failure,retryable", [
    ("cudaMallocAsync(&data, size, stream) failed: out of memory", True),
    ("[metal::malloc] Attempting to allocate 9 bytes which is greater than the maximum "
     "allowed buffer size of 8 bytes.", True),
    ("[matmul] Last dimension of first input with shape (1,4) must match ...", False),
])
def test_a_step_that_ran_out_of_memory_fails_its_requests_as_retryable(failure, retryable,
                                                                        caplog):
    """A step that raised one of MLX's failed allocations fails its batch with a message
    that says so, retryable (the API's 503 with Retry-After); another error does not.
    The log line says what MLX's memory held."""
    with caplog.at_level("ERROR", logger="runtime.engine.core"):
        (failed,) = _core_failing_its_first_step(failure).step().failed
    (record,) = [r for r in caplog.records if "engine step failed" in r.getMessage()]
    assert re.search(r"MLX memory: active [\d.]+ GB, peak [\d.]+ GB, cached [\d.]+ GB",
                     record.getMessage())
    assert failed.request_id == 1 and failed.retryable is retryable
    assert failure in failed.message
    assert ("ran out of memory" in failed.message) is retryable
