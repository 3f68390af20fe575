"""Prompt-cache transparency end to end, on the real tiny model: the ``x-prompt-cache``
header and the ``prompt_cache`` body field say how much of the prompt was reused
and, on a miss, why (docs/api.md#prompt-cache)."""

from __future__ import annotations

import pytest

from api.server import create_app
from runtime.config import ServerConfig
from tests.conftest import wait_ready
from tests.test_api import parse_sse, post, stream_post

CHAT = "/v1/chat/completions"
# Long enough (> 64 tokens, the --prompt-cache-min-reuse floor) to be worth reusing.
WEATHER = {"role": "system", "content": "You are a terse assistant who knows the weather. " * 4}
PETS = {"role": "system", "content": "You answer questions about cats and dogs only, kindly. " * 4}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


async def app_client(tiny_model_path, **settings):
    app = create_app(ServerConfig(model=tiny_model_path, max_tokens=8, **settings))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        yield client


@pytest.fixture
async def client(tiny_model_path):
    async for c in app_client(tiny_model_path):
        yield c


@pytest.fixture
async def one_entry_client(tiny_model_path):
    async for c in app_client(tiny_model_path, prompt_cache_size=1):
        yield c


def reported(body: dict, response) -> tuple[str, dict, int]:
    """(header, body field, usage's cached tokens), checked against each other."""
    header = response.headers["x-prompt-cache"]
    field = body["prompt_cache"]
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert field["reused_tokens"] == cached
    if cached:
        assert field["miss_reason"] is None and header == f"hit; reused={cached}"
    else:
        assert header == f"miss; reason={field['miss_reason']}"
    return header, field, cached


def next_turn(turn: list[dict], body: dict, question: str) -> list[dict]:
    reply = body["choices"][0]["message"]["content"] or ""
    return turn + [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]


async def test_a_second_turn_hits_and_says_how_much_it_reused(client):
    turn1 = [WEATHER, {"role": "user", "content": "what is the weather in Paris"}]
    status, first, response = await post(client, CHAT, {"messages": turn1})
    assert status == 200
    _, field, _ = reported(first, response)
    assert field == {"reused_tokens": 0, "miss_reason": "no_entry"}  # a fresh server

    turn2 = next_turn(turn1, first, "and in Rome")
    _, second, response = await post(client, CHAT, {"messages": turn2})
    _, field, cached = reported(second, response)
    assert cached >= first["usage"]["prompt_tokens"] - 1  # the whole first prompt at least

    # Streamed, the header is sent before the engine looks: the prediction, which
    # the final chunk's field (what the engine did) confirms.
    turn3 = next_turn(turn2, second, "and in Oslo")
    status, headers, raw = await stream_post(client, CHAT, {"messages": turn3, "stream": True})
    payloads, _, done = parse_sse(raw)
    assert status == 200 and done
    (final,) = [p for p in payloads if p["choices"] and p["choices"][0]["finish_reason"]]
    reused = final["prompt_cache"]["reused_tokens"]
    assert reused >= second["usage"]["prompt_tokens"] - 1
    assert headers["x-prompt-cache"] == f"hit; reused={reused}"

    health = await (await client.get("/health")).get_json()
    figures = health["prompt_cache"]
    assert figures["hits"] == 2 and figures["misses"]["no_entry"] == 1
    assert figures["cached_tokens"] == cached + reused


async def test_a_second_turn_with_thinking_off_reuses_the_first_up_to_its_think_block(
    client, tiny_tokenizer
):
    # With thinking off the template ends each prompt in an empty think block and
    # drops it from past turns; the first prompt has no cache entry of its own up
    # to that block (the finished entry, trimmed, serves it).
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    turn1 = [WEATHER, {"role": "user", "content": "what is the weather in Paris"}]
    _, first, _ = await post(client, CHAT, {"messages": turn1, **off})
    turn2 = next_turn(turn1, first, "and in Rome")
    _, second, response = await post(client, CHAT, {"messages": turn2, **off})
    _, _, cached = reported(second, response)
    rendered = tiny_tokenizer.apply_chat_template(
        turn1, add_generation_prompt=True, enable_thinking=False
    )
    think_start = tiny_tokenizer.convert_tokens_to_ids("<think>")
    assert rendered[-6:].count(think_start) == 1
    assert cached >= rendered.index(think_start, len(rendered) - 6)


async def test_a_text_completion_reports_the_reuse_too(client):
    body = {"prompt": "The weather in Paris is " * 20, "max_tokens": 2}
    _, first, response = await post(client, "/v1/completions", body)
    assert reported(first, response)[1]["miss_reason"] == "no_entry"
    _, again, response = await post(client, "/v1/completions", body)
    _, field, cached = reported(again, response)
    assert cached == again["usage"]["prompt_tokens"] - 1  # all but the token given back


async def test_other_template_args_for_the_same_conversation_miss_with_that_reason(client):
    question = {"role": "user", "content": "Tell me about the weather in Paris today. " * 6}
    _, first, _ = await post(client, CHAT, {"messages": [question]})
    # The same conversation, now with tools: the template renders a tools block first.
    turn2 = next_turn([question], first, "and in Rome")
    _, second, response = await post(client, CHAT, {"messages": turn2, "tools": TOOLS})
    header, field, cached = reported(second, response)
    assert (header, cached) == ("miss; reason=template_args", 0)
    # Without the tools again: the first turn's entry serves it.
    _, third, response = await post(client, CHAT, {"messages": turn2})
    assert reported(third, response)[2] >= first["usage"]["prompt_tokens"] - 1


async def test_an_evicted_entry_misses_with_evicted(one_entry_client):
    client = one_entry_client  # --prompt-cache-size 1
    weather = [WEATHER, {"role": "user", "content": "what is the weather in Paris"}]
    _, first, _ = await post(client, CHAT, {"messages": weather})
    # Another conversation's entries take the one place.
    await post(client, CHAT, {"messages": [PETS, {"role": "user", "content": "tell me of cats"}]})
    _, second, response = await post(
        client, CHAT, {"messages": next_turn(weather, first, "and in Rome")}
    )
    header, field, cached = reported(second, response)
    assert (header, cached) == ("miss; reason=evicted", 0)
    health = await (await client.get("/health")).get_json()
    figures = health["prompt_cache"]
    assert figures["entries"] == 1 and figures["evictions"] >= 1
    assert figures["misses"]["evicted"] == 1
    scrape = (await (await client.get("/metrics")).get_data()).decode()
    assert 'mlx_trio_prompt_cache_misses_total{reason="evicted"} 1.0' in scrape
    assert f"mlx_trio_prompt_cache_evictions_total {float(figures['evictions'])}" in scrape


@pytest.fixture
async def byte_limited_client(tiny_model_path):
    # 600 kB: four of the entries below counted whole (about 185 kB each) pass it; what
    # they hold (one system prompt and four short tails, about 230 kB) fits it beside a
    # running request's KV cache.
    async for c in app_client(tiny_model_path, prompt_cache_bytes=600_000):
        yield c


async def test_sessions_over_one_system_prompt_hold_and_count_it_once(byte_limited_client):
    client = byte_limited_client
    # About 330 tokens: past the 256 a segment needs to be shared.
    system = {"role": "system", "content": "You are a coding agent; keep every answer short. " * 10}
    for city in ("Paris", "Rome", "Oslo", "Lima"):
        messages = [system, {"role": "user", "content": f"what is the weather in {city}"}]
        status, _, _ = await post(client, CHAT, {"messages": messages})
        assert status == 200
    figures = (await (await client.get("/health")).get_json())["prompt_cache"]
    assert figures["evictions"] == 0 and figures["entries"] >= 4
    # Counted whole, every entry repeats the system prompt; held, it is there once.
    assert figures["entry_bytes"] > figures["max_bytes"] > figures["bytes"]
    assert figures["bytes"] * 2 < figures["entry_bytes"]
    # The Paris conversation's next turn still finds its entry.
    messages = [system, {"role": "user", "content": "what is the weather in Paris"}]
    _, body, response = await post(client, CHAT, {"messages": messages})
    _, _, cached = reported(body, response)
    assert cached >= body["usage"]["prompt_tokens"] - 1
    # Every reuse was what the index predicted when the request came in (the new
    # sessions': the system prompt alone, without the user turn's opening tokens).
    figures = (await (await client.get("/health")).get_json())["prompt_cache"]
    assert figures["hits"] == 4 and figures["header_mismatches"] == 0


async def test_the_agent_apis_carry_the_header(client):
    long = "Tell me about the weather in Paris today, please. " * 6
    body = {"model": "default_model", "max_tokens": 4, "messages": [{"role": "user", "content": long}]}
    response = await client.post("/v1/messages", json=body)
    assert response.status_code == 200, await response.get_data()
    assert response.headers["x-prompt-cache"] == "miss; reason=no_entry"
    response = await client.post("/v1/messages", json=body)
    usage = (await response.get_json())["usage"]
    cached = usage["cache_read_input_tokens"]
    assert cached > 64 and response.headers["x-prompt-cache"] == f"hit; reused={cached}"
    response = await client.post("/v1/responses", json={"input": long, "max_output_tokens": 4})
    usage = (await response.get_json())["usage"]
    cached = usage["input_tokens_details"]["cached_tokens"]
    assert cached > 64 and response.headers["x-prompt-cache"] == f"hit; reused={cached}"
