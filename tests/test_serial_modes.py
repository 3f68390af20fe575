"""Requests that cannot share a batch: speculative decoding and a quantized KV cache."""

from __future__ import annotations

import pytest
import trio

from api.server import create_app
from runtime.config import ServerConfig
from tests.conftest import poll_until, wait_ready
from tests.test_api import CHAT, chat_body, parse_sse, post, stream_post


async def outputs(config: ServerConfig, prompts: list[str], max_tokens: int = 12) -> list[str]:
    app = create_app(config)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        texts = {}

        async def one(i, p):
            status, body, _ = await post(client, CHAT, chat_body(p, max_tokens=max_tokens))
            assert status == 200, body
            texts[i] = body["choices"][0]["message"]["content"]

        async with trio.open_nursery() as nursery:
            for i, p in enumerate(prompts):
                nursery.start_soon(one, i, p)
        return [texts[i] for i in range(len(prompts))]


PROMPTS = ["the weather in Paris", "what time is it", "say a word", "add 3 and 4"]


async def test_speculative_decoding_with_the_model_as_its_own_draft_is_exact(tiny_model_path):
    plain = await outputs(ServerConfig(model=tiny_model_path), PROMPTS)
    speculative = await outputs(
        ServerConfig(model=tiny_model_path, draft_model=tiny_model_path, num_draft_tokens=3),
        PROMPTS,
    )
    assert speculative == plain


@pytest.fixture(scope="module")
def wide_model_path(tmp_path_factory) -> str:
    """head_dim 32: the smallest that mlx's quantized KV cache (groups of 32+) accepts."""
    from runtime.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("wide") / "m", hidden_size=128))


async def test_quantized_kv_cache_serves_and_streams(wide_model_path):
    config = ServerConfig(model=wide_model_path, kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    texts = await outputs(config, PROMPTS)
    assert all(isinstance(t, str | None) for t in texts)
    app = create_app(config)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        _, _, raw = await stream_post(client, CHAT, chat_body("stream it", max_tokens=6, stream=True))
        payloads, _, done = parse_sse(raw)
        assert done and payloads[-1]["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("extra", [{"draft_model": "SELF"}, {"kv_bits": 8, "kv_group_size": 32}])
async def test_serial_requests_can_be_cut_short(wide_model_path, extra):
    extra = {k: (wide_model_path if v == "SELF" else v) for k, v in extra.items()}
    app = create_app(ServerConfig(model=wide_model_path, **extra))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        with trio.fail_after(30):
            status, body, _ = await post(
                client, CHAT, chat_body("go on", max_tokens=100000, timeout=0.3)
            )
        assert status == 200
        assert body["choices"][0]["finish_reason"] == "length"
        runtime = app.extensions["runtime"]
        await poll_until(lambda: runtime.scheduler.figures().stats.active_sequences == 0, 5)
