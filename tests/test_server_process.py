"""A real ``hypercorn api:app --worker-class trio`` on a loopback port.

Driven by the official ``openai`` SDK and by raw sockets (for disconnects
and bursts). Sync tests: the server runs in its own process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    port = free_port()
    env = {**os.environ, "MLX_TRIO_MODEL": tiny_model_path, "MLX_TRIO_MAX_TOKENS": "64"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hypercorn", "api:app", "--worker-class", "trio",
         "--bind", f"127.0.0.1:{port}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.stdout.read().decode(errors="replace")
            pytest.fail(f"server did not start:\n{out[-3000:]}")
        time.sleep(0.1)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("server did not stop on SIGTERM")


def health(base) -> dict:
    return httpx.get(f"{base}/health", timeout=5).json()


def test_openai_sdk_chat_and_completions(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == (chat.choices[0].message.content or "")
    assert usage.completion_tokens == chat.usage.completion_tokens
    completion = client.completions.create(model="tiny", prompt="the time in Rome", max_tokens=6)
    assert completion.choices[0].finish_reason in ("length", "stop")
    models = client.models.list()
    assert len(models.data) >= 1


def test_sixteen_concurrent_clients_get_their_solo_outputs(server):
    prompts = [f"client {i} asks about {w}" for i, w in enumerate(
        ["rain", "cats", "Paris", "time", "snow", "Rome", "dogs", "sun"] * 2)]

    def ask(prompt):
        r = httpx.post(
            f"{server}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 16},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    solo = [ask(p) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, prompts))
    assert together == solo
    assert len(set(solo)) > 1


def test_client_disconnect_mid_stream_frees_the_engine(server):
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps({
        "messages": [{"role": "user", "content": "tell me a very long story"}],
        "max_tokens": 100000,
        "stream": True,
    }).encode()
    # max_tokens beyond the server default is allowed: clients choose
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(request)
            received = b""
            while received.count(b"data: {") < 3:
                chunk = sock.recv(65536)
                assert chunk, "server closed the stream early"
                received += chunk
            assert health(server)["active_sequences"] >= 1
        deadline = time.monotonic() + 5
        while True:
            h = health(server)
            if h["active_sequences"] == 0 and h["requests_in_flight"] == 0:
                break
            assert time.monotonic() < deadline, f"sequence still running after disconnect: {h}"
            time.sleep(0.02)
    r = httpx.post(
        f"{server}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=30,
    )
    assert r.status_code == 200


def test_malformed_requests_then_still_serving(server):
    bad = [
        b"{not json",
        b'{"messages": [{"role": "user", "content": "x"}], "stop": 123}',
        b'{"messages": [{"role": "user", "content": "x"}], "seed": -1}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}',
        b"\xff\xfe",
    ]
    for raw in bad:
        r = httpx.post(f"{server}/v1/chat/completions", content=raw,
                       headers={"Content-Type": "application/json"}, timeout=10)
        assert r.status_code == 400, (raw, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert health(server)["status"] == "ok"
