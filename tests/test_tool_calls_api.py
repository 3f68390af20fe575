"""Tool calls and reasoning through the whole app, from scripted generations.

A random-weight model almost never writes a well-formed tool call, so the
engine here replays a script (``tests.fakes``) while everything else is real:
the tiny model's tokenizer, chat template, mlx-lm's tool parser and text state
machine, the actors and the HTTP edge.
"""

from __future__ import annotations

import json

import pytest

import tests.fakes as fakes
from actors.system import Runtime
from api.server import create_app
from runtime.config import ServerConfig
from runtime.engine.core import EngineCore
from runtime.lifecycle import ModelInfo
from runtime.loaded_model import LoadedModel
from tests.conftest import wait_ready
from tests.test_api import CHAT, parse_sse, post, stream_post

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
GENERATION = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.fixture
async def client(tiny_model_path, tiny_tokenizer, monkeypatch):
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    script = list(tiny_tokenizer.encode(GENERATION, add_special_tokens=False)) + [eos]
    monkeypatch.setattr(
        fakes, "scripted_token", lambda prompt, i, vocab: script[i] if i < len(script) else eos
    )

    def make_core():
        handle = LoadedModel(
            model=None,
            tokenizer=tiny_tokenizer,
            info=ModelInfo(model_key="scripted", vocab_size=len(tiny_tokenizer)),
        )
        return EngineCore(
            handle,
            batch_generator_factory=fakes.FakeBatchGeneratorFactory(
                vocab=len(tiny_tokenizer), eos_ids={eos}
            ),
            prompt_cache=fakes.FakePromptCache(),
        )

    config = ServerConfig(model=tiny_model_path)
    app = create_app(config, runtime=Runtime(config, make_core=make_core))
    async with app.test_app() as test_app:
        c = test_app.test_client()
        await wait_ready(c)
        yield c


BODY = {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": TOOLS,
        "max_tokens": 200}


async def test_tool_call_and_reasoning_non_streaming(client):
    status, body, _ = await post(client, CHAT, BODY)
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning"] == message["reasoning_content"]
    assert "The user wants the weather." in message["reasoning"]
    assert not (message["content"] or "").strip()
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


async def test_tool_call_and_reasoning_streaming(client):
    status, _, raw = await stream_post(client, CHAT, {**BODY, "stream": True})
    assert status == 200
    payloads, _, done = parse_sse(raw)
    assert done
    deltas = [p["choices"][0]["delta"] for p in payloads if p["choices"]]
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    assert "The user wants the weather." in reasoning
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1
    assert calls[0]["index"] == 0 and calls[0]["id"] and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert payloads[-1]["choices"][0]["finish_reason"] == "tool_calls"
