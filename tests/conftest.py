"""Shared fixtures: a tiny random Qwen3 model built offline, and a running app."""

from __future__ import annotations

import pytest
import trio

from runtime.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", seed=0))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(Path(tiny_model_path))


async def wait_ready(client) -> None:
    with trio.fail_after(60):
        while True:
            response = await client.get("/health")
            if response.status_code == 200:
                return
            await trio.sleep(0.05)


async def poll_until(predicate, seconds: float = 10.0) -> None:
    """Wait (bounded) for a condition another thread or task will make true."""
    with trio.fail_after(seconds):
        while True:
            if predicate():
                return
            await trio.sleep(0.01)


def wait_healthy(base: str, procs, seconds: float = 90.0) -> bool:
    """Poll ``base``/health until it answers 200 (True), or until one of ``procs``
    exits or ``seconds`` pass (False; the caller cleans up and fails)."""
    import time

    import httpx

    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def raw_chat_request(host: str, body: dict) -> bytes:
    """An HTTP/1.1 POST of ``body`` to /v1/chat/completions, for tests that drop the socket."""
    import json

    data = json.dumps(body).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data


def read_sse_chunks(sock, n: int) -> bytes:
    """Read from a raw streaming response until ``n`` data frames have arrived."""
    received = b""
    while received.count(b"data: {") < n:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the stream early"
        received += chunk
    return received


# ------------------------------------------------------------------ markers
# Three kinds of test, so that a quick loop can run the first alone:
#   (no marker)  unit and property tests: fakes, or the tiny model in-process;
#   server       starts real servers or engine processes (sockets, subprocesses);
#   distributed  launches several ranks with mlx.launch.
# The quick subset: python -m pytest -m "not server and not distributed"
SERVER_MODULES = {
    "test_server_process",
    "test_demo_model",
    "test_reference_parity",
    "test_engine_process",
    "test_fuzz",
    "test_distributed",
    "test_chat_page",
    "test_agent_apis",
    "test_agent_clis",
    "test_structured_outputs_server",
    "test_operations_server",
    "test_limits",
    "test_shutdown",
    "test_model_fetch",
}
DISTRIBUTED_MODULES = {"test_distributed"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if module in SERVER_MODULES:
            item.add_marker(pytest.mark.server)
        if module in DISTRIBUTED_MODULES:
            item.add_marker(pytest.mark.distributed)


# The two standard demo tools, as README.md declares them (chat-completions shape).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"]}}}


@pytest.fixture
async def client(tiny_model_path):
    """An in-process app on the tiny model (``max_tokens`` 32), ready; ``.app`` is the app."""
    from api.server import create_app
    from runtime.config import ServerConfig

    app = create_app(ServerConfig(model=tiny_model_path, max_tokens=32))
    async with app.test_app() as test_app:
        c = test_app.test_client()
        await wait_ready(c)
        c.app = app
        yield c
