"""Request ids and the access log: one ``mlx_trio.access`` line per request, streams included.

A client that leaves mid-stream, and the log of a real server (one line per
event), are in tests/test_operations_server.py."""

from __future__ import annotations

import json
import logging

import pytest

from api.observability import MAX_REQUEST_ID, access_line, request_id_from
from api.server import create_app
from runtime.config import ServerConfig
from tests.conftest import wait_ready
from tests.test_api import CHAT, chat_body, post


@pytest.fixture
async def client(tiny_model_path):
    app = create_app(ServerConfig(model=tiny_model_path, max_tokens=8))
    async with app.test_app() as test_app:
        c = test_app.test_client()
        await wait_ready(c)
        yield c


def access_records(caplog) -> list[dict]:
    return [r.access for r in caplog.records if r.name == "mlx_trio.access"]


async def test_one_line_per_request_with_tokens_and_times(client, caplog):
    caplog.set_level(logging.INFO, logger="mlx_trio.access")
    caplog.clear()
    status, body, response = await post(client, CHAT, chat_body("log me", max_tokens=5))
    assert status == 200
    (line,) = access_records(caplog)
    usage = body["usage"]
    assert line["request_id"] == response.headers["x-request-id"]
    assert len(line["request_id"]) == 32  # made here: the client sent none
    assert line["method"] == "POST" and line["endpoint"] == CHAT and line["status"] == 200
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["generated_tokens"] == usage["completion_tokens"]
    assert line["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert line["finish"] == body["choices"][0]["finish_reason"]
    assert 0 < line["submit_ms"] < line["ttft_ms"] <= line["duration_ms"]
    # After the submit, the wait for a place in the engine; both before the first token
    assert 0 <= line["queued_ms"] and line["submit_ms"] + line["queued_ms"] <= line["ttft_ms"] + 0.2
    text = [r.getMessage() for r in caplog.records if r.name == "mlx_trio.access"][0]
    assert text.startswith(f"request_id={line['request_id']} method=POST endpoint={CHAT} status=200")
    assert f"prompt_tokens={usage['prompt_tokens']}" in text


async def test_the_clients_request_id_is_echoed_on_streams_too(client, caplog):
    caplog.set_level(logging.INFO, logger="mlx_trio.access")
    caplog.clear()
    async with client.request(
        CHAT, method="POST", headers={"Content-Type": "application/json", "x-request-id": "req-42"}
    ) as conn:
        await conn.send(json.dumps(chat_body("stream", max_tokens=4, stream=True)).encode())
        await conn.send_complete()
        raw = b""
        try:
            while True:
                raw += await conn.receive()
        except Exception:
            pass
    assert conn.status_code == 200 and raw.rstrip().endswith(b"data: [DONE]")
    assert conn.headers["x-request-id"] == "req-42"
    (line,) = access_records(caplog)
    assert line["request_id"] == "req-42" and line["generated_tokens"] > 0


async def test_errors_and_other_routes_get_a_line(client, caplog):
    caplog.set_level(logging.DEBUG, logger="mlx_trio.access")  # /health's line is DEBUG
    caplog.clear()
    status, _, _ = await post(client, CHAT, chat_body(temperature=-1))
    assert status == 400
    await client.get("/health")
    await client.get("/nowhere\nforged=1")
    lines = access_records(caplog)
    assert [(x["endpoint"], x["status"]) for x in lines] == [
        (CHAT, 400), ("/health", 200), ("unmatched", 404)
    ]
    assert "prompt_tokens" not in lines[0]  # no generation happened
    assert lines[2]["path"] == "/nowhere\nforged=1"
    levels = [r.levelno for r in caplog.records if r.name == "mlx_trio.access"]
    assert levels == [logging.INFO, logging.DEBUG, logging.INFO]  # probes do not drown requests
    message = [r.getMessage() for r in caplog.records if r.name == "mlx_trio.access"][2]
    assert "\n" not in message and 'path="/nowhere\\nforged=1"' in message


def test_request_ids_are_cleaned_and_bounded():
    assert request_id_from([(b"x-request-id", b"abc-DEF_1.2:3")]) == "abc-DEF_1.2:3"
    assert request_id_from([(b"X-Request-Id", b"a b\"c<d>\x01e")]) == "abcde"
    assert len(request_id_from([(b"x-request-id", b"x" * 1000)])) == MAX_REQUEST_ID
    made = request_id_from([(b"x-request-id", b"  <> ")])
    assert len(made) == 32 and made != request_id_from([])


def test_access_lines_quote_what_needs_quoting():
    line = access_line({"a": 1, "b": "two words", "c": 'q"uote', "d": "", "e": "plain"})
    assert line == 'a=1 b="two words" c="q\\"uote" d="" e=plain'
