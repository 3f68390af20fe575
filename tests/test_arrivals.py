"""``Submit.followed``: a request sent while others are on their way to the engine says so.

The counts (``actors.session.Arrivals``): generation requests the HTTP side is
answering (the API's ``RequestObserver``), Sessions that have submitted, Sessions
templating or tokenising. What the engine does with the flag is in
tests/test_admission_window.py."""

from __future__ import annotations

import threading

import trio

from actors.session import Arrivals
from actors.system import Runtime
from api.observability import is_generation
from runtime.config import ServerConfig
from runtime.engine.core import EngineCore
from runtime.lifecycle import ModelInfo
from runtime.loaded_model import LoadedModel
from runtime.messages import SamplingParams
from runtime.prompts import prepare_text
from tests.conftest import poll_until
from tests.fakes import FakeBatchGeneratorFactory, FakePromptCache, FakeTokenizer
from tests.test_api import CHAT, chat_body, post, stream_post


def test_others_pending_counts_everyone_but_the_caller():
    arrivals = Arrivals()
    assert not arrivals.others_pending(counted=False)  # a Session outside HTTP, alone
    arrivals.http = 1
    assert not arrivals.others_pending(counted=True)  # the caller's own request
    assert arrivals.others_pending(counted=False)  # someone else's
    arrivals.http = 2
    assert arrivals.others_pending(counted=True)
    arrivals.http = 0
    arrivals.preparing = 1  # a Session tokenising (inside HTTP or not)
    assert arrivals.others_pending(counted=False)


def test_generation_requests_are_the_posts_that_start_one():
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                 "/v1/chat/completions/"):
        assert is_generation("POST", path), path
    for method, path in (("GET", "/v1/responses"), ("POST", "/v1/tokenize"),
                         ("POST", "/v1/messages/count_tokens"), ("GET", "/health")):
        assert not is_generation(method, path), (method, path)


async def test_the_counts_follow_requests_and_return_to_zero(client):
    arrivals = client.app.extensions["runtime"].arrivals
    seen = []

    async def watch():
        while True:
            seen.append((arrivals.http, arrivals.preparing))
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        status, _, _ = await post(client, CHAT, chat_body("count me", max_tokens=8))
        assert status == 200
        status, _, _ = await stream_post(client, CHAT, chat_body("and me", stream=True,
                                                                 max_tokens=8))
        assert status == 200
        status, body, _ = await post(client, CHAT, {"messages": "not a list"})
        assert status == 400
        nursery.cancel_scope.cancel()
    assert (1, 1) in seen  # a request on its way: counted, tokenising
    assert (arrivals.http, arrivals.preparing) == (0, 0)  # each one out at its Submit or end


async def test_a_submit_sent_while_another_is_tokenised_is_followed():
    tokenizer = FakeTokenizer()
    submits = []

    class Recording(EngineCore):
        def handle_command(self, command):
            if hasattr(command, "followed"):
                submits.append((command.request_id, command.followed))
            super().handle_command(command)

    def make_core():
        handle = LoadedModel(
            model=None, tokenizer=tokenizer, info=ModelInfo(model_key="fake", vocab_size=64)
        )
        return Recording(handle, batch_generator_factory=FakeBatchGeneratorFactory(),
                         prompt_cache=FakePromptCache())

    runtime = Runtime(ServerConfig(model="fake"), make_core=make_core)
    second_started = threading.Event()
    first_submitted = threading.Event()

    def first_prepare(tok):
        second_started.wait(10)  # the second is tokenising when the first submits
        return prepare_text(tok, [5, 6, 7])

    def second_prepare(tok):
        second_started.set()
        first_submitted.wait(10)
        return prepare_text(tok, [5, 6, 8])

    async def run(prepare, after_submit=None):
        session = runtime.session(prepare=prepare, sampling=SamplingParams(), max_tokens=3)
        async with session:
            if after_submit is not None:
                after_submit()
            while True:
                try:
                    await session.receive()
                except trio.EndOfChannel:
                    return session.request_id

    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.run)
        await poll_until(lambda: runtime.model_loader.status().info is not None)
        with trio.fail_after(10):
            async with trio.open_nursery() as requests:
                requests.start_soon(run, first_prepare, first_submitted.set)
                requests.start_soon(run, second_prepare)
        await poll_until(lambda: len(submits) == 2)
        nursery.cancel_scope.cancel()
    assert [followed for _, followed in sorted(submits)] == [True, False]
    assert runtime.arrivals.preparing == 0 and runtime.arrivals.http == 0
