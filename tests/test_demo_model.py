"""The trained demo model (demo_model/mlx-trio-demo) through the whole app, and its data.

The app tests serve the committed weights with greedy decoding on the CPU:
a weather tool call with the city copied into its arguments, the answer
from the tool's result in the next turn, a time tool call, arithmetic with
the ``<think>`` trace split off as reasoning and, with thinking off, the
bare answer. The data tests check the properties the held-out evaluation
relies on (disjoint split, exact think traces, digits as single tokens).
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from api.server import create_app
from demo_model import data
from runtime.config import ServerConfig
from tests.conftest import wait_ready
from tests.test_api import CHAT, post

DEMO_DIR = pathlib.Path(__file__).resolve().parents[1] / "demo_model" / "mlx-trio-demo"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}


@pytest.fixture
async def client():
    app = create_app(ServerConfig(model=str(DEMO_DIR), max_tokens=80))
    async with app.test_app() as test_app:
        c = test_app.test_client()
        await wait_ready(c)
        yield c


async def chat(client, messages, **extra) -> dict:
    status, body, _ = await post(client, CHAT, {"messages": messages, **extra})
    assert status == 200, body
    return body["choices"][0]


def test_model_dir_is_small_and_loads():
    import mlx_lm

    size = sum(p.stat().st_size for p in DEMO_DIR.iterdir())
    assert size <= 20 * 2**20
    config = json.loads((DEMO_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    _, tokenizer = mlx_lm.load(str(DEMO_DIR))
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.has_tool_calling and tokenizer.has_thinking


async def test_weather_tool_call_then_answer_from_the_result(client):
    # Stockholm is a held-out city: the training data never names it.
    messages = [{"role": "user", "content": "What's the weather in Stockholm?"}]
    choice = await chat(client, messages, tools=[WEATHER, TIME])
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Stockholm"}

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"],
         "content": json.dumps({"temperature": 12, "condition": "rainy"})},
    ]  # fmt: skip
    choice = await chat(client, messages, tools=[WEATHER, TIME])
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "It is 12 degrees and rainy in Stockholm."


async def test_time_tool_call(client):
    messages = [{"role": "user", "content": "What time is it in Tokyo?"}]
    choice = await chat(client, messages, tools=[WEATHER, TIME])
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {"timezone": "Asia/Tokyo"}


async def test_arithmetic_thinking_on_and_off(client):
    messages = [{"role": "user", "content": "What is 47 + 85?"}]
    choice = await chat(client, messages)
    assert choice["finish_reason"] == "stop"
    message = choice["message"]
    assert "7 + 5 = 12" in message["reasoning"] and "<think>" not in message["content"]
    assert message["content"].strip() == "132"

    messages = [{"role": "user", "content": "What is 23 - 58?"}]
    choice = await chat(client, messages, chat_template_kwargs={"enable_thinking": False})
    assert choice["finish_reason"] == "stop"
    assert not choice["message"].get("reasoning")
    assert choice["message"]["content"].strip() == "-35"


async def test_greeting(client):
    choice = await chat(client, [{"role": "user", "content": "Hello"}])
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"].strip() == "Hello! How can I help you today?"


# --- the data the model is trained and evaluated on -------------------------


def test_split_is_disjoint():
    split = data.Split.make()
    assert not set(split.cities["train"]) & set(split.cities["heldout"])
    train_pairs = set(data.Generator("train", 0)._pairs)
    assert train_pairs and not train_pairs & split.heldout_pairs
    assert len(split.heldout_pairs) == round(0.1 * 2 * 100 * 100)
    gen = data.Generator("train", 0)
    held_cities = set(split.cities["heldout"])
    for _ in range(2000):
        example = gen.example()
        text = json.dumps(example.messages) + example.target
        assert not any(re.search(rf"\b{c}\b", text) for c in held_cities), text


def test_think_traces_are_right_for_every_pair():
    for op in "+-":
        for a in range(100):
            for b in range(100):
                trace = data.arith_trace(op, a, b)
                assert trace.endswith(f"so {a + b if op == '+' else a - b}"), trace
                for x, y, z in re.findall(r"(\d+) \+ (\d+)(?: \+ \d+)? = (\d+)", trace):
                    assert int(z) >= int(x) + int(y)


def test_digits_are_single_tokens_and_names_copy_as_the_same_tokens():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    digits = tokenizer.encode("1234 + 5678").tokens
    assert [t for t in digits if t.strip("Ġ")] == ["1", "2", "3", "4", "Ġ+", "5", "6", "7", "8"]
    asked = tokenizer.encode("weather in Zanzibar").tokens
    called = tokenizer.encode('{"city": "Zanzibar"}').tokens
    name = asked[asked.index("Ġ") + 1 :]
    assert called[called.index('Ġ"') + 1 : -1] == name
