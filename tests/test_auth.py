"""API keys: every API route needs one; /health, the chat page, preflights (and /metrics) do not.

Through the app's test client (no engine work is needed to refuse a request:
the 401 comes before the body is read).
"""

from __future__ import annotations

import hmac

import pytest

from api.auth import ApiKeys
from api.server import create_app
from runtime.config import ServerConfig
from tests.conftest import wait_ready
from tests.test_api import CHAT, chat_body

KEYS = ("key-one", "key-two")


@pytest.fixture
async def client(tiny_model_path):
    app = create_app(ServerConfig(model=tiny_model_path, max_tokens=4, api_key=KEYS))
    async with app.test_app() as test_app:
        c = test_app.test_client()
        await wait_ready(c)
        yield c


async def test_a_request_without_a_key_is_a_401_in_the_openai_shape(client):
    for path, method in ((CHAT, "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET"),
                         ("/v1/responses", "POST"), ("/tokenize", "POST"),
                         ("/openapi.json", "GET"), ("/no/such/path", "GET")):
        response = await client.open(path, method=method, json=chat_body())
        assert response.status_code == 401, path
        body = await response.get_json()
        assert body["error"]["code"] == "invalid_api_key", path
        assert body["error"]["type"] == "invalid_request_error"
        assert "API key is required" in body["error"]["message"]
        assert response.headers["WWW-Authenticate"] == "Bearer"


async def test_a_wrong_key_is_a_401(client):
    for headers in ({"Authorization": "Bearer nope"}, {"x-api-key": "key-one-and-more"},
                    {"Authorization": "Basic key-one"}, {"Authorization": "Bearer "}):
        response = await client.post(CHAT, json=chat_body(), headers=headers)
        assert response.status_code == 401, headers
        assert (await response.get_json())["error"]["code"] == "invalid_api_key"


async def test_either_header_with_any_key_is_accepted(client):
    for headers in ({"Authorization": "Bearer key-one"}, {"Authorization": "bearer  key-two "},
                    {"x-api-key": "key-two"}, {"x-api-key": "wrong", "Authorization": "Bearer key-one"}):
        response = await client.post(CHAT, json=chat_body(), headers=headers)
        assert response.status_code == 200, (headers, await response.get_data(as_text=True))
    response = await client.get("/v1/models", headers={"x-api-key": "key-one"})
    assert response.status_code == 200


async def test_anthropic_routes_answer_in_anthropics_shape(client):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = await client.post(path, json={}, headers={"x-api-key": "nope"})
        assert response.status_code == 401
        body = await response.get_json()
        assert body == {"type": "error", "error": {"type": "authentication_error",
                                                   "message": "invalid API key"}}


async def test_health_the_chat_page_metrics_and_preflights_stay_open(client):
    for path in ("/health", "/", "/assets/chat.js", "/metrics"):
        response = await client.get(path)
        assert response.status_code == 200, path
    response = await client.options(CHAT)
    assert response.status_code == 204


async def test_metrics_can_require_the_key(tiny_model_path):
    config = ServerConfig(model=tiny_model_path, api_key=KEYS, metrics_require_key=True)
    app = create_app(config)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/metrics", headers={"x-api-key": "key-two"})).status_code == 200
        assert (await client.get("/health")).status_code == 200


async def test_without_keys_nothing_is_checked(tiny_model_path):
    app = create_app(ServerConfig(model=tiny_model_path, max_tokens=2))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        response = await client.post(CHAT, json=chat_body(), headers={"x-api-key": "anything"})
        assert response.status_code == 200


def test_keys_come_from_flags_and_a_file(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# the team's keys\n\nfile-key-1\n  file-key-2  \n")
    keys = ApiKeys.from_config(ServerConfig(api_key=("flag-key",), api_key_file=str(key_file)))
    assert len(keys) == 3
    for key in ("flag-key", "file-key-1", "file-key-2"):
        assert keys.accepts([key])
    assert not keys.accepts(["# the team's keys"]) and not keys.accepts([""]) and not keys.accepts([])
    with pytest.raises(SystemExit, match="api-key-file"):
        ApiKeys.from_config(ServerConfig(api_key_file=str(tmp_path / "missing")))
    assert "flag-key" not in repr(ServerConfig(api_key=("flag-key",)))


def test_every_key_is_compared_even_after_a_match(monkeypatch):
    """Constant time: no early exit on the first match, nor on the first key presented."""
    calls = []
    compare = hmac.compare_digest

    def counting(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr("api.auth.hmac.compare_digest", counting)
    keys = ApiKeys(["a1", "b2", "c3"])
    assert keys.accepts(["a1", "zz"])
    assert len(calls) == 6
    calls.clear()
    assert not keys.accepts(["zz"])
    assert len(calls) == 3


def test_the_flags_take_several_keys():
    from api.cli import parse_config

    config = parse_config(["--api-key", "a", "--api-key", "b,c", "--metrics-require-key"])
    assert config.api_key == ("a", "b", "c") and config.metrics_require_key
