"""Prompt-cache scopes: requests of different scopes never reuse each other's entries.

A shared prefix cache tells one tenant, by its time to first token, whether
another sent a prompt. ``Submit.cache_scope`` partitions the engine's prompt
cache (and the prompt-cache policy's index, and who may wait behind whose
prefill); the API derives it from the API key and a request's ``cache_salt``.
Here the engine on the tiny real model, then the API.
"""

from __future__ import annotations

import random

import attrs
import pytest

from runtime.config import ServerConfig
from runtime.engine.loading import make_engine_core
from runtime.messages import SamplingParams, Submit
from tests.test_engine_sampling import run


def conversation(vocab: int, seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    rng = random.Random(seed)
    system = tuple(rng.randrange(10, vocab - 10) for _ in range(300))
    user = tuple(rng.randrange(10, vocab - 10) for _ in range(20))
    return system, user


def submit(request_id: int, system, user, scope: str = "") -> Submit:
    return Submit(
        request_id=request_id,
        prompt=system + user,
        segments=(system, user),
        segment_types=("system", "user"),
        max_tokens=4,
        sampling=SamplingParams(),
        cache_scope=scope,
    )


@pytest.fixture(scope="module")
def core(tiny_model_path):
    config = ServerConfig(model=tiny_model_path, admission_window_ms=0, prompt_cache_min_reuse=16)
    return make_engine_core(config, tiny_model_path)


def cached_of(core, sub: Submit) -> int:
    started = {}

    def on_step(core, out, calls):
        started.update((s.request_id, s.cached_tokens) for s in out.started)

    run(core, [sub], on_step=on_step)
    return started[sub.request_id]


def test_a_scope_reuses_its_own_entries_and_no_other(core):
    system, user = conversation(core.handle.info.vocab_size, seed=1)
    assert cached_of(core, submit(1, system, user, scope="tenant-a")) == 0
    # The same prompt again: within the scope, all but its last token.
    assert cached_of(core, submit(2, system, user, scope="tenant-a")) == len(system + user) - 1
    # Another tenant, the shared scope: nothing.
    assert cached_of(core, submit(3, system, user, scope="tenant-b")) == 0
    assert cached_of(core, submit(4, system, user)) == 0
    # Unscoped requests share among themselves as before.
    assert cached_of(core, submit(5, system, user)) == len(system + user) - 1


def test_a_request_waits_only_behind_a_prefill_of_its_own_scope(core):
    system, user = conversation(core.handle.info.vocab_size, seed=2)
    other_user = user[:-1] + (user[-1] + 1,)
    started = {}

    def on_step(core, out, calls):
        started.update((s.request_id, s.cached_tokens) for s in out.started)

    leader = submit(11, system, user, scope="a")
    same = submit(12, system, other_user, scope="a")
    other = attrs.evolve(submit(13, system, other_user, scope="b"), prompt=system + other_user)
    run(core, [leader, same, other], on_step=on_step)
    # The same scope's follower started from the leader's system prompt; the other
    # tenant computed its own.
    assert started == {11: 0, 12: len(system), 13: 0}


def test_the_prompt_cache_actor_predicts_within_a_scope():
    from actors.prompt_cache import PromptCachePolicy
    from tests.test_prompt_cache_policy import MODEL, feed, stored

    core = PromptCachePolicy(max_entries=10, min_reuse=4)
    core.engine_changed(MODEL)
    tokens = tuple(range(100, 140))
    first = core.open(1, MODEL, tokens, scope="a")
    assert first.reused_tokens == 0
    feed(core, stored(1, tokens, request_id=1))  # request 1's entry, in scope "a"
    assert core.open(2, MODEL, tokens + (5,), scope="a").reused_tokens == len(tokens)
    assert core.open(3, MODEL, tokens + (5,), scope="b").reused_tokens == 0
    assert core.open(4, MODEL, tokens + (5,)).reused_tokens == 0


# ------------------------------------------------------------------- the API

SYSTEM = {"role": "system", "content": "You are a terse assistant who knows the weather. " * 4}
TURN = [SYSTEM, {"role": "user", "content": "what is the weather in Paris"}]


async def scoped_client(tiny_model_path, **settings):
    from api.server import create_app
    from tests.conftest import wait_ready

    app = create_app(ServerConfig(model=tiny_model_path, max_tokens=4, **settings))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)  # /health needs no key
        yield client


async def cached_tokens(client, key: str | None, **fields) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = await client.post(
        "/v1/chat/completions", json={"messages": TURN, **fields}, headers=headers
    )
    assert response.status_code == 200, await response.get_data()
    return (await response.get_json())["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
async def two_keys(tiny_model_path):
    async for c in scoped_client(tiny_model_path, api_key=("key-a", "key-b")):
        yield c


@pytest.fixture
async def two_keys_shared(tiny_model_path):
    async for c in scoped_client(
        tiny_model_path, api_key=("key-a", "key-b"), prompt_cache_scope="shared"
    ):
        yield c


async def test_with_keys_one_tenant_does_not_reuse_anothers_prompt(two_keys):
    assert await cached_tokens(two_keys, "key-a") == 0
    assert await cached_tokens(two_keys, "key-b") == 0  # key A's entry is not key B's
    assert await cached_tokens(two_keys, "key-a") > 0  # key A's own


async def test_a_shared_scope_reuses_across_keys(two_keys_shared):
    assert await cached_tokens(two_keys_shared, "key-a") == 0
    assert await cached_tokens(two_keys_shared, "key-b") > 0


@pytest.fixture
async def no_keys(tiny_model_path):
    async for c in scoped_client(tiny_model_path):
        yield c


async def test_a_cache_salt_scopes_a_request_without_keys(no_keys):
    assert await cached_tokens(no_keys, None) == 0
    assert await cached_tokens(no_keys, None, cache_salt="s1") == 0  # a salt: its own scope
    assert await cached_tokens(no_keys, None, cache_salt="s1") > 0
    assert await cached_tokens(no_keys, None) > 0  # the shared scope kept its entry
