"""The per-request path before the engine, kept short: which thread prepares a prompt, the
served model's names resolved without a look on disk, and the heap frozen once a model is up
(``runtime.engine.loop.settle_heap``)."""

from __future__ import annotations

import gc
import threading
import weakref

import trio
from quart import Quart

from actors.system import Runtime
from api.http import INLINE_PREPARE_BYTES, small_body
from runtime.config import ServerConfig
from runtime.engine.core import EngineCore
from runtime.engine.loop import settle_heap
from runtime.grammar import ConstraintSpec
from runtime.lifecycle import ModelInfo
from runtime.loaded_model import LoadedModel
from runtime.messages import SamplingParams
from runtime.models import DEFAULT_ALIASES, names_served
from runtime.prompts import prepare_text
from tests.conftest import poll_until
from tests.fakes import FakeBatchGeneratorFactory, FakePromptCache, FakeTokenizer


def _runtime() -> Runtime:
    tokenizer = FakeTokenizer()

    def make_core():
        handle = LoadedModel(
            model=None, tokenizer=tokenizer, info=ModelInfo(model_key="fake", vocab_size=64)
        )
        return EngineCore(handle, batch_generator_factory=FakeBatchGeneratorFactory(),
                          prompt_cache=FakePromptCache())

    return Runtime(ServerConfig(model="fake"), make_core=make_core)


async def test_a_short_prompt_is_prepared_on_the_trio_thread_and_a_constrained_one_is_not():
    runtime = _runtime()
    trio_thread = threading.get_ident()
    seen: dict[str, tuple[int, int]] = {}

    def preparing(name):
        def prepare(tok):
            seen[name] = (threading.get_ident(), runtime.arrivals.preparing)
            return prepare_text(tok, [5, 6, 7])

        return prepare

    compiled: list[tuple[str, bool]] = []  # (what, on the trio thread)
    looked_up: list[bool] = []  # whether each lookup found a spec

    class Compiling:
        """A constrain step that compiles once, then finds its spec (as api.structured's)."""

        spec = None

        def recent(self, tok, prompt):
            looked_up.append(self.spec is not None)
            return self.spec

        def __call__(self, tok, prompt):
            compiled.append(("compile", threading.get_ident() == trio_thread))
            self.spec = ConstraintSpec(grammar="%json {}", kind="json")
            return self.spec

    compiling = Compiling()

    async def run(name, **options):
        session = runtime.session(prepare=preparing(name), sampling=SamplingParams(),
                                  max_tokens=2, **options)
        async with session:
            while True:
                try:
                    await session.receive()
                except trio.EndOfChannel:
                    return

    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        await poll_until(lambda: runtime.model_loader.status().info is not None)
        with trio.fail_after(10):
            await run("inline", prepare_inline=True)
            await run("threaded")
            await run("constrained", prepare_inline=True, constrain=compiling)
            await run("compiled lately", prepare_inline=True, constrain=compiling)
        nursery.cancel_scope.cancel()
    assert seen["inline"] == (trio_thread, 0)  # no hand-over, never counted as on its way
    assert seen["threaded"][0] != trio_thread and seen["threaded"][1] == 1
    # a short prompt is still prepared inline; its grammar compiles in a worker thread
    assert seen["constrained"] == (trio_thread, 0)
    assert compiled == [("compile", False)]
    # the same fields' spec, compiled lately: looked up on the trio thread, no hand-over
    assert seen["compiled lately"] == (trio_thread, 0)
    assert looked_up == [False, True]


async def test_only_a_small_body_with_a_declared_length_is_prepared_inline():
    app = Quart(__name__)
    cases = [(str(INLINE_PREPARE_BYTES), True), (str(INLINE_PREPARE_BYTES + 1), False), (None, False)]
    for length, inline in cases:
        headers = {"Content-Length": length} if length is not None else {}
        async with app.test_request_context("/v1/chat/completions", method="POST",
                                            headers=headers):
            assert small_body() is inline, length


def test_the_served_model_is_named_by_its_aliases_only():
    config = ServerConfig(model="org/repo")
    for name in (None, *DEFAULT_ALIASES, "served-id", "/models/served", "org/repo"):
        assert names_served(config, "served-id", "/models/served", name), name
    for name in ("other", "/models/other", "served"):
        assert not names_served(config, "served-id", "/models/served", name), name


async def test_resolving_the_served_model_needs_no_worker_thread(monkeypatch):
    runtime = _runtime()

    def no_thread(*args, **kwargs):
        raise AssertionError("the served model's names need no look on disk")

    monkeypatch.setattr(trio.to_thread, "run_sync", no_thread)
    for name in (None, "default_model", runtime.model_id, runtime.model_path):
        assert await runtime.resolve(name) == runtime.default_model
    assert await runtime.resolve(None, draft_model="default_model") == runtime.default_model


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def test_settling_the_heap_freezes_what_is_there_and_frees_cycles_of_an_earlier_model():
    try:
        old_model = _Node()
        gone = weakref.ref(old_model)
        settle_heap()  # a model is up: its objects, the cycle among them, frozen
        frozen = gc.get_freeze_count()
        assert frozen > 0
        del old_model
        gc.collect()
        assert gone() is not None  # frozen: a full collection passes it by
        settle_heap()  # the next model is up: the swapped-out one's cycle goes first
        assert gone() is None
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


async def test_the_encoder_is_chosen_when_the_model_is_ready_not_on_the_first_request(
    monkeypatch,
):
    import actors.model_loader

    chosen = []
    monkeypatch.setattr(actors.model_loader, "encoder_for", chosen.append)
    runtime = _runtime()
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        await poll_until(lambda: bool(chosen))
        assert len(chosen) == 1 and isinstance(chosen[0], FakeTokenizer)
        nursery.cancel_scope.cancel()
