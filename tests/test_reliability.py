"""Overload, memory admission, deadlines, engine crashes and failed loads, through the app."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel
import trio.testing

from api.server import create_app
from runtime.config import ServerConfig
from runtime.engine.loading import make_engine_core
from tests.conftest import poll_until, wait_ready
from tests.test_api import CHAT, chat_body, parse_sse, post, stream_post


async def test_deadline_finishes_with_length_and_a_complete_stream(tiny_model_path):
    app = create_app(ServerConfig(model=tiny_model_path, max_tokens=100000))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        with trio.fail_after(30):
            status, body, _ = await post(client, CHAT, chat_body("go on", timeout=0.3))
        assert status == 200
        assert body["choices"][0]["finish_reason"] == "length"
        assert 0 < body["usage"]["completion_tokens"] < 100000
        with trio.fail_after(30):
            _, _, raw = await stream_post(client, CHAT, chat_body("go on", timeout=0.3, stream=True))
        payloads, _, done = parse_sse(raw)
        assert done
        assert payloads[-1]["choices"][0]["finish_reason"] == "length"
        runtime = app.extensions["runtime"]
        await poll_until(lambda: runtime.scheduler.figures().in_flight == 0, 5)


async def test_overload_is_answered_with_429_and_retry_after(tiny_model_path):
    config = ServerConfig(
        model=tiny_model_path, decode_concurrency=1, prompt_concurrency=1, max_queued_requests=1
    )
    app = create_app(config)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        results = []

        async def one(i):
            response = await client.post(CHAT, json=chat_body(f"story {i}", max_tokens=200))
            results.append((response.status_code, response.headers.get("Retry-After"),
                            await response.get_json()))

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
        statuses = sorted(status for status, _, _ in results)
        assert statuses.count(200) == 3, statuses  # 2 in the engine + 1 waiting
        assert statuses.count(429) == 5
        for status, retry_after, body in results:
            if status == 429:
                assert retry_after is not None and int(retry_after) >= 1
                assert body["error"]["type"] == "rate_limit_error"


async def test_memory_admission_refuses_what_cannot_fit(tiny_model_path, tiny_tokenizer):
    # The tiny model: 2 layers x 2 kv heads x 16 dims x (K, V) x 4 bytes = 512 bytes a token.
    app = create_app(ServerConfig(model=tiny_model_path, kv_cache_budget_bytes=40_000))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        never_end = {str(e): -100 for e in tiny_tokenizer.eos_token_ids}
        # 40_000 bytes hold 78 tokens: a longer prompt can never fit (413, naming it) ...
        status, body, _ = await post(client, CHAT, chat_body("w " * 100, max_tokens=8))
        assert status == 413
        assert body["error"]["param"] == "messages"
        # ... while a large max_tokens is lowered to what the budget leaves, and served.
        status, body, _ = await post(client, CHAT, chat_body(max_tokens=1000, logit_bias=never_end))
        assert status == 200
        usage = body["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 40_000 // 512
        assert body["choices"][0]["finish_reason"] == "length"
        # Requests that fit alone but not together wait for room instead of overcommitting.
        runtime = app.extensions["runtime"]
        peak = []

        async def watch():
            while True:
                peak.append(runtime.scheduler.figures().kv_reserved_bytes)
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as inner:
                for i in range(4):
                    inner.start_soon(post, client, CHAT, chat_body(f"q{i}", max_tokens=40))
            nursery.cancel_scope.cancel()
        assert max(peak) <= 40_000


class CrashingCore:
    """A real engine core whose ``step`` raises once, outside the core's own guard."""

    def __init__(self, core, crash_on_step: int):
        self._core = core
        self._steps = 0
        self._crash_on = crash_on_step

    def step(self):
        self._steps += 1
        if self._steps == self._crash_on:
            raise RuntimeError("injected engine crash")
        return self._core.step()

    def __getattr__(self, name):
        return getattr(self._core, name)


async def test_engine_crash_fails_inflight_requests_and_restarts(tiny_model_path):
    config = ServerConfig(model=tiny_model_path)
    cores = []

    def make_core():
        core = make_engine_core(config, tiny_model_path)
        cores.append(core)
        return CrashingCore(core, crash_on_step=5) if len(cores) == 1 else core

    from actors.system import Runtime

    runtime = Runtime(config, make_core=make_core)
    app = create_app(config, runtime=runtime)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        status, body, _ = await post(client, CHAT, chat_body("crash me", max_tokens=200))
        assert status == 503, body
        assert "engine crashed" in body["error"]["message"]
        response = await client.get("/health")  # down until the new engine is ready
        assert response.status_code == 503
        await wait_ready(client)
        health = await (await client.get("/health")).get_json()
        assert health["engine_restarts"] == 1
        status, body, _ = await post(client, CHAT, chat_body("and again", max_tokens=4))
        assert status == 200
        metrics = (await (await client.get("/metrics")).get_data(as_text=True)).splitlines()
        assert "mlx_trio_engine_restarts_total 1.0" in metrics
        assert "mlx_trio_active_sequences 0.0" in metrics
        assert health["active_sequences"] == 0 and health["requests_in_flight"] == 0
        assert len(cores) == 2


async def test_a_model_that_fails_to_load_leaves_the_server_answering_503():
    def make_core():
        raise FileNotFoundError("no model at /nowhere")

    from actors.system import Runtime

    config = ServerConfig(model="/nowhere")
    app = create_app(config, runtime=Runtime(config, make_core=make_core))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        runtime = app.extensions["runtime"]
        await poll_until(lambda: runtime.model_loader.status().state.value == "failed", 10)
        response = await client.get("/health")
        body = await response.get_json()
        assert response.status_code == 503
        assert "no model at /nowhere" in body["reason"]
        status, body, response = await post(client, CHAT, chat_body())
        assert status == 503
        assert "no model at /nowhere" in body["error"]["message"]
        assert response.headers["Retry-After"]
        # Every actor has ended (no engine is coming back); shutdown can still drain.
        runtime.drain(0.0)
        await trio.testing.wait_all_tasks_blocked()
        assert runtime.health()[1]["reason"] == "shutting down"


@pytest.mark.parametrize("path", ["/metrics"])
async def test_metrics_report_the_runtime(tiny_model_path, path):
    app = create_app(ServerConfig(model=tiny_model_path))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        await post(client, CHAT, chat_body(max_tokens=3))
        text = await (await client.get(path)).get_data(as_text=True)
        assert "mlx_trio_model_ready 1" in text
        assert "mlx_trio_active_sequences 0" in text
        assert 'mlx_trio_http_responses_total{route="/v1/chat/completions",status="200"} 1' in text
        values = {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        # The request took steps; at least one processed its prompt; they took time.
        assert values["mlx_trio_engine_steps_total"] >= 3
        assert 1 <= values["mlx_trio_engine_prefill_steps_total"] < values["mlx_trio_engine_steps_total"]
        assert values["mlx_trio_engine_busy_seconds_total"] > 0


def test_only_recent_restarts_count_against_the_restart_budget():
    """``max_restarts`` crashes within ``RESTART_WINDOW_SECONDS`` mark the model failed;
    a crash now and then over a long life does not add up to that."""
    from actors.model_loader import RESTART_WINDOW_SECONDS, ModelLoaderCore, ModelState

    async def main():
        core = ModelLoaderCore(max_restarts=3)
        core.handle = object()  # loaded once
        for _ in range(6):  # one crash every 1.5 windows: always restarted
            assert core.engine_exited(RuntimeError("crash")) is True
            core.handle = object()
            await trio.sleep(1.5 * RESTART_WINDOW_SECONDS)
        assert core.restarts == 6 and core.backoff() == pytest.approx(0.2)
        for _ in range(3):  # three within the window: restarted, backing off
            assert core.engine_exited(RuntimeError("crash")) is True
            core.handle = object()
            await trio.sleep(1.0)
        assert core.backoff() == pytest.approx(0.8)
        assert core.engine_exited(RuntimeError("crash")) is False  # the fourth: failed
        assert core.state is ModelState.FAILED and core.restarts == 9

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
