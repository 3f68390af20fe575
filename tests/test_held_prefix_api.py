"""Sessions over one system prompt through the API, on the real tiny model, with the
decoding batch holding their shared prefix once (``--decode-shared-prefix-tokens``): the
KV budget counts the prefix once, so more sessions run at once than it holds whole
copies of; ``/health`` says what that saves; every answer is the one the server gives
holding a copy per session."""

from __future__ import annotations

import trio

from api.server import create_app
from runtime.config import ServerConfig
from tests.conftest import wait_ready

BYTES_PER_TOKEN = 512  # the tiny model: 2 layers x 2 kv heads x 16 dims x (K, V) x 4 bytes
SYSTEM = "You are a careful coding agent. Read every file before you edit it. " * 10
REPLY = 60


def body(i: int, never_end: dict) -> dict:
    return {"model": "default_model", "max_tokens": REPLY, "logit_bias": never_end,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"task {i}: fix the failing test"}]}


async def sessions_at_once(tiny_model_path, config: ServerConfig, never_end: dict):
    """Four sessions at once: the most running together, the most that holding the
    prefix once saved (``/health``'s ``kv_cache.shared_bytes``), and the answers."""
    app = create_app(config)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        scheduler = app.extensions["runtime"].scheduler
        running, shared, answers = [], [0], {}
        asked = trio.Event()

        # It ends between requests once every session is answered: quart-trio's test
        # client cannot have a request it is making cancelled.
        async def watch():
            while not asked.is_set():
                running.append(scheduler.figures().running)
                health = await (await client.get("/health")).get_json()
                shared[0] = max(shared[0], health["kv_cache"]["shared_bytes"])
                await trio.sleep(0.005)

        async def ask(i: int):
            response = await client.post("/v1/chat/completions", json=body(i, never_end))
            answers[i] = (response.status_code, await response.get_json())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as inner:
                for i in range(4):
                    inner.start_soon(ask, i)
            asked.set()
    return max(running), shared[0], answers


async def test_the_budget_counts_a_prefix_held_once_once(tiny_model_path, tiny_tokenizer):
    never_end = {str(e): -100 for e in tiny_tokenizer.eos_token_ids}
    prompt = tiny_tokenizer.apply_chat_template(body(0, never_end)["messages"],
                                                add_generation_prompt=True)
    system = tiny_tokenizer.apply_chat_template(body(0, never_end)["messages"][:1])
    whole = len(prompt) + REPLY  # what one session reserves (no reply reserve)
    assert len(system) > 200
    # Two sessions' whole reservations and a half: held once, the prefix (most of each
    # prompt) counts once, and all four fit.
    results = {}
    for tokens in (0, 200):
        config = ServerConfig(model=tiny_model_path, kv_reply_reserve_tokens=0,
                              kv_cache_budget_bytes=int(2.5 * whole) * BYTES_PER_TOKEN,
                              decode_shared_prefix_tokens=tokens,
                              decode_shared_prefix_budget_share=0)
        results[tokens] = await sessions_at_once(tiny_model_path, config, never_end)
    (most, shared, plain), (most_held, shared_held, held) = results[0], results[200]
    assert most == 2 and shared == 0
    assert most_held > 2
    assert shared_held >= (len(system) - 10) * BYTES_PER_TOKEN  # a prefix's copy at least
    for i in range(4):
        assert plain[i][0] == held[i][0] == 200
        assert held[i][1]["choices"][0]["message"]["content"] == \
            plain[i][1]["choices"][0]["message"]["content"], i
        assert held[i][1]["usage"]["completion_tokens"] == REPLY
