"""``POST /tokenize`` and ``POST /detokenize`` on the tiny model: round trips, the chat
template as chat completions applies it, and 400s that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.server import create_app
from runtime.config import ServerConfig
from tests.conftest import wait_ready
from tests.test_api import CHAT, chat_body, post

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture
async def client(tiny_model_path):
    app = create_app(ServerConfig(model=tiny_model_path, max_tokens=4))
    async with app.test_app() as test_app:
        c = test_app.test_client()
        await wait_ready(c)
        yield c


@pytest.mark.parametrize(
    "text", ["hello world, how are you?", "Ünïcode ☃ and\nnew lines\t", " leading space"]
)
async def test_text_round_trips(client, tiny_tokenizer, text):
    status, body, _ = await post(client, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200, body
    assert body["tokens"] == tiny_tokenizer.encode(text, add_special_tokens=False)
    assert body["count"] == len(body["tokens"])
    status, back, _ = await post(client, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": text}


async def test_the_count_is_the_prompt_a_completion_is_charged_for(client, tiny_model_path):
    status, body, _ = await post(client, "/tokenize", {"prompt": "count these words"})
    status, done, _ = await post(
        client, "/v1/completions", {"prompt": "count these words", "max_tokens": 1}
    )
    assert status == 200
    assert body["count"] == done["usage"]["prompt_tokens"]
    config = json.loads((Path(tiny_model_path) / "config.json").read_text())
    assert body["max_model_len"] == config["max_position_embeddings"]


async def test_messages_go_through_the_chat_template_as_chat_completions_apply_it(client):
    status, body, _ = await post(client, "/tokenize", {"messages": MESSAGES})
    assert status == 200, body
    status, chat, _ = await post(client, CHAT, {**chat_body(), "messages": MESSAGES})
    assert status == 200
    assert body["count"] == chat["usage"]["prompt_tokens"]
    status, bare, _ = await post(
        client, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}
    )
    assert status == 200
    assert bare["count"] < body["count"]
    assert body["tokens"][: bare["count"]] == bare["tokens"]
    status, text, _ = await post(client, "/detokenize", {"tokens": body["tokens"]})
    assert "What is the weather in Paris?" in text["prompt"]
    assert "You are terse." in text["prompt"]


async def test_tools_and_template_arguments_change_the_rendering(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    plain = (await post(client, "/tokenize", {"messages": MESSAGES}))[1]
    with_tools = (await post(client, "/tokenize", {"messages": MESSAGES, "tools": tools}))[1]
    assert with_tools["count"] > plain["count"]
    text = (await post(client, "/detokenize", {"tokens": with_tools["tokens"]}))[1]["prompt"]
    assert "get_weather" in text
    no_thinking = (
        await post(
            client,
            "/tokenize",
            {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
        )
    )[1]
    assert no_thinking["tokens"] != plain["tokens"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": "x", "messages": MESSAGES}, "messages"),
        ({"prompt": 5}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"messages": MESSAGES, "tools": [{"type": "retrieval"}]}, "tools[0]"),
    ],
)
async def test_tokenize_400s_name_the_field(client, body, param):
    status, answer, _ = await post(client, "/tokenize", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [({}, "tokens"), ({"tokens": "1 2"}, "tokens"), ({"tokens": [1, "a"]}, "tokens[1]"),
     ({"tokens": [1, 2, 10**6]}, "tokens[2]"), ({"tokens": [-1]}, "tokens[0]")],
)
async def test_detokenize_400s_name_the_field(client, body, param):
    status, answer, _ = await post(client, "/detokenize", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param


async def test_a_model_that_is_not_served_is_a_404(client):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        status, answer, _ = await post(client, path, {**body, "model": "/some/other/model"})
        assert status == 404 and answer["error"]["param"] == "model"
