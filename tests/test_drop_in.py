"""Drop-in details clients rely on, and a shutdown that ends every open request properly.

Through the app on the real tiny model: a stream names the assistant's role
in its first delta only (as OpenAI does); answers carry the model id that
``/v1/models`` lists, whatever alias the request used; and once shutdown
begins (``Runtime.drain``), new requests get 503 with ``Retry-After``, a
running stream ends with a last chunk (``finish_reason``), its usage when
asked, an error event saying why, and ``[DONE]``, and a waiting
non-streaming request gets a 503.
"""

from __future__ import annotations

import json

import pytest
import trio

from api.server import create_app
from runtime.config import ServerConfig
from tests.conftest import poll_until, wait_ready
from tests.test_api import CHAT, parse_sse, post, stream_post


@pytest.fixture
async def client(tiny_model_path, tiny_tokenizer):
    app = create_app(ServerConfig(model=tiny_model_path, max_tokens=32))
    async with app.test_app() as test_app:
        c = test_app.test_client()
        await wait_ready(c)
        c.app = app
        c.never_end = {str(e): -100 for e in tiny_tokenizer.eos_token_ids}
        yield c


def body(**extra):
    return {"messages": [{"role": "user", "content": "hello there"}], **extra}


async def test_a_stream_names_the_role_in_its_first_delta_only(client):
    status, _, raw = await stream_post(
        client, CHAT, body(stream=True, max_tokens=12, logit_bias=client.never_end)
    )
    assert status == 200
    payloads, _, done = parse_sse(raw)
    deltas = [p["choices"][0]["delta"] for p in payloads if p["choices"]]
    with_text = [d for d in deltas if d.get("content")]
    assert done and len(with_text) >= 2
    assert deltas[0]["role"] == "assistant"
    assert all("role" not in d for d in deltas[1:]), deltas


@pytest.mark.parametrize("model", [None, "default_model", "path"])
async def test_answers_name_the_model_id_that_v1_models_lists(client, tiny_model_path, model):
    listed = (await (await client.get("/v1/models")).get_json())["data"][0]["id"]
    request = body(max_tokens=2)
    if model is not None:
        request["model"] = tiny_model_path if model == "path" else model
    status, answer, _ = await post(client, CHAT, request)
    assert status == 200, answer
    assert answer["model"] == listed
    status, _, raw = await stream_post(client, CHAT, {**request, "stream": True})
    payloads, _, _ = parse_sse(raw)
    assert {p["model"] for p in payloads} == {listed}


async def read_until_text(conn) -> bytes:
    data = b""
    with trio.fail_after(30):
        while b'"content"' not in data:
            data += await conn.receive()
    return data


async def test_shutdown_ends_a_running_stream_properly(client):
    runtime = client.app.extensions["runtime"]
    request = body(
        stream=True,
        max_tokens=100_000,
        logit_bias=client.never_end,
        stream_options={"include_usage": True},
    )
    async with client.request(
        CHAT, method="POST", headers={"Content-Type": "application/json"}
    ) as conn:
        await conn.send(json.dumps(request).encode())
        await conn.send_complete()
        raw = await read_until_text(conn)
        runtime.drain(0.0)
        with trio.fail_after(30):
            try:
                while True:
                    raw += await conn.receive()
            except trio.EndOfChannel:
                pass
    payloads, _, done = parse_sse(raw)
    assert done
    final, usage, error = payloads[-3:]
    assert final["choices"][0]["finish_reason"] == "abort"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert "shutting down" in error["error"]["message"]
    assert error["error"]["type"] == "service_unavailable"
    # Nothing new is taken meanwhile, and /health says why.
    status, answer, response = await post(client, CHAT, body(max_tokens=2))
    assert status == 503 and response.headers["Retry-After"]
    assert "shutting down" in answer["error"]["message"]
    health = await client.get("/health")
    assert health.status_code == 503


async def test_shutdown_answers_a_waiting_request_with_503(client):
    runtime = client.app.extensions["runtime"]
    outcome = {}

    async def ask():
        outcome["answer"] = await post(
            client, CHAT, body(max_tokens=100_000, logit_bias=client.never_end)
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await poll_until(lambda: runtime.scheduler.figures().stats.active_sequences > 0, 30)
        runtime.drain(0.0)
    status, answer, response = outcome["answer"]
    assert status == 503, answer
    assert response.headers["Retry-After"] == "5"
    assert "shutting down" in answer["error"]["message"]
