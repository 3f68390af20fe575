"""The request's ``model`` selects among the models on this machine, loaded on demand.

These tests opt in with ``--allowed-models '*'`` (by default a request may name
only the served model: see tests/test_model_policy.py)."""

from __future__ import annotations

import json

import pytest
import trio

from api.server import create_app
from runtime.config import ServerConfig
from runtime.tiny_model import build_tiny_model
from tests.conftest import wait_ready
from tests.test_api import CHAT, chat_body, post


@pytest.fixture(scope="module")
def other_model_path(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("other") / "m", seed=1))


@pytest.fixture
async def client(tiny_model_path):
    app = create_app(ServerConfig(model=tiny_model_path, allowed_models=("*",)))
    async with app.test_app() as test_app:
        c = test_app.test_client()
        await wait_ready(c)
        c.app = app
        yield c


async def answer(client, model, prompt="hello there"):
    status, body, _ = await post(client, CHAT, {**chat_body(prompt, max_tokens=10), "model": model})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


async def test_switch_to_another_model_and_back(client, tiny_model_path, other_model_path):
    first = await answer(client, "default_model")
    assert await answer(client, tiny_model_path) == first  # the served path is the same model
    other = await answer(client, other_model_path)
    assert other != first
    health = await (await client.get("/health")).get_json()
    assert health["model"] == other_model_path
    assert await answer(client, "default_model") == first
    assert await answer(client, other_model_path) == other


async def test_concurrent_requests_for_two_models_all_complete(
    client, tiny_model_path, other_model_path
):
    solo = {m: await answer(client, m, "same prompt") for m in (tiny_model_path, other_model_path)}
    results = []

    async def one(model):
        results.append((model, await answer(client, model, "same prompt")))

    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(one, (tiny_model_path, other_model_path)[i % 2])
    assert len(results) == 6
    assert all(text == solo[model] for model, text in results)


async def test_unknown_and_unloadable_models_are_404s_and_the_default_keeps_serving(
    client, tmp_path, tiny_model_path
):
    status, body, _ = await post(client, CHAT, {**chat_body(), "model": "gpt-4o"})
    assert status == 404 and body["error"]["param"] == "model"
    assert "gpt-4o" in body["error"]["message"]

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    status, body, _ = await post(client, CHAT, {**chat_body(), "model": str(broken)})
    assert status == 404, body
    assert "could not be loaded" in body["error"]["message"]
    await wait_ready(client)
    assert await answer(client, "default_model")  is not None


def build_lora_adapter(model_path: str, out_dir) -> str:
    """A random LoRA adapter for the tiny model, in mlx-lm's adapter format."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(model_path)
    params = {"rank": 4, "scale": 20.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(7)
    weights = {
        name: mx.random.normal(value.shape) * 0.5
        for name, value in tree_flatten(model.parameters())
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return str(out_dir)


async def test_a_request_can_name_a_lora_adapter(client, tiny_model_path, tmp_path):
    adapter = build_lora_adapter(tiny_model_path, tmp_path / "adapter")
    plain = await answer(client, "default_model")
    status, body, _ = await post(
        client, CHAT, {**chat_body("hello there", max_tokens=10), "adapters": adapter}
    )
    assert status == 200, body
    adapted = body["choices"][0]["message"]["content"]
    assert adapted != plain
    assert await answer(client, "default_model") == plain
    status, body, _ = await post(client, CHAT, {**chat_body(), "adapters": str(tmp_path / "nope")})
    assert status == 404 and body["error"]["param"] == "adapters"


async def test_a_request_can_name_a_draft_model(client, tiny_model_path):
    plain = await answer(client, "default_model")
    status, body, _ = await post(
        client,
        CHAT,
        {**chat_body("hello there", max_tokens=10), "draft_model": tiny_model_path},
    )
    assert status == 200, body
    # Greedy speculative decoding is exact: the model as its own draft changes nothing.
    assert body["choices"][0]["message"]["content"] == plain
    status, body, _ = await post(client, CHAT, {**chat_body(), "draft_model": "no/such-draft"})
    assert status == 404 and body["error"]["param"] == "draft_model"
