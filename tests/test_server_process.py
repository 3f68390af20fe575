"""A real ``hypercorn api:app --worker-class trio`` on a loopback port.

Driven by the official ``openai`` SDK and by raw sockets (for disconnects
and bursts). Sync tests: the server runs in its own process.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import raw_chat_request, read_sse_chunks, wait_healthy

pytestmark = pytest.mark.server  # starts hypercorn and mlx-trio-server subprocesses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(args, env: dict | None = None, *, log=subprocess.DEVNULL):
    """Start ``python ARGS(port)`` on a free port; wait (bounded) for /health 200."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, *args(port)],
        env={**os.environ, **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    if not wait_healthy(base, [proc]):
        proc.kill()
        pytest.fail("server did not start")
    return proc, base


def hypercorn_args(port: int) -> list[str]:
    return ["-m", "hypercorn", "api:app", "--worker-class", "trio",
            "--bind", f"127.0.0.1:{port}", "--backlog", "1024"]


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("server did not stop on SIGTERM")


@pytest.fixture(scope="module")
def server(tiny_model_path):
    env = {"MLX_TRIO_MODEL": tiny_model_path, "MLX_TRIO_MAX_TOKENS": "64"}
    proc, base = spawn_server(hypercorn_args, env)
    yield base
    stop_server(proc)


def health(base) -> dict:
    return httpx.get(f"{base}/health", timeout=5).json()


def test_openai_sdk_chat_and_completions(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model="default_model",
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
    completion = client.completions.create(model="default_model", prompt="the time in Rome", max_tokens=6)
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
    # max_tokens beyond the server default is allowed: clients choose
    request = raw_chat_request(host, {
        "messages": [{"role": "user", "content": "tell me a very long story"}],
        "max_tokens": 100000,
        "stream": True,
    })
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(request)
            read_sse_chunks(sock, 3)
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


def test_a_burst_of_128_connections_is_all_answered(server):
    def ask(i):
        r = httpx.post(
            f"{server}/v1/completions",
            json={"prompt": f"burst {i}", "max_tokens": 2},
            timeout=120,
        )
        return r.status_code

    with ThreadPoolExecutor(128) as pool:
        statuses = list(pool.map(ask, range(128)))
    # Everything is answered: served, or refused with a status (never a reset connection).
    assert all(s in (200, 429) for s in statuses), statuses
    assert statuses.count(200) >= 64


def test_sigterm_lets_a_running_stream_finish_then_exits_zero(tiny_model_path):
    proc, base = spawn_server(
        lambda port: ["-m", "api.cli", "--model", tiny_model_path, "--port", str(port)]
    )
    try:
        body = {"messages": [{"role": "user", "content": "a story"}], "max_tokens": 300,
                "stream": True}
        raw = b""
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            for chunk in r.iter_bytes():
                if not raw:
                    proc.send_signal(15)  # SIGTERM after the first bytes
                raw += chunk
        assert raw.rstrip().endswith(b"data: [DONE]")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def small_prefill_server(tiny_model_path):
    """A server that processes prompts 16 tokens at a time, so a prefill spans many steps."""
    env = {"MLX_TRIO_MODEL": tiny_model_path, "MLX_TRIO_PREFILL_STEP_SIZE": "16"}
    proc, base = spawn_server(hypercorn_args, env)
    yield base
    stop_server(proc)


def _wait_idle(base: str, seconds: float = 5.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        h = health(base)
        if h["active_sequences"] == 0 and h["requests_in_flight"] == 0:
            return h
        assert time.monotonic() < deadline, f"engine not idle: {h}"
        time.sleep(0.02)


def test_disconnect_during_a_long_prefill_stops_it(small_prefill_server):
    base = small_prefill_server
    host, port = base.removeprefix("http://").split(":")
    long_prompt = " ".join(f"word{i}" for i in range(300))  # ~1700 tokens: inside the window
    request = raw_chat_request(host, {
        "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 50, "stream": True,
    })
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request)
        received = b""
        while not (done := _prefilled(received)) or done < 320:
            chunk = sock.recv(65536)
            assert chunk
            received += chunk
        assert b"data: {" not in received, "still prefilling when we leave"
    _wait_idle(base)
    # The part computed before the client left is in the prompt cache
    # (--aborted-prefill-min-tokens 256): the same request sent again resumes from it.
    retry = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2})
    assert retry.status_code == 200
    assert retry.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= done
    metrics = httpx.get(f"{base}/metrics", timeout=5).text
    assert "mlx_trio_prompt_cache_aborted_prefills_total 1.0" in metrics


def _prefilled(received: bytes) -> int:
    """The last ``: keepalive DONE/TOTAL`` progress in a stream so far (0: none)."""
    notes = re.findall(rb": keepalive (\d+)/\d+", received)
    return int(notes[-1]) if notes else 0


def test_disconnect_storm_leaves_the_engine_idle(small_prefill_server):
    base = small_prefill_server
    host, port = base.removeprefix("http://").split(":")

    def streaming_client(i):
        request = raw_chat_request(host, {
            "messages": [{"role": "user", "content": f"storm {i}"}], "max_tokens": 2000,
            "stream": True,
        })
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(request)
            received = b""
            while received.count(b"data: {") < 2:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk

    def impatient_client(i):
        try:
            httpx.post(f"{base}/v1/chat/completions", timeout=0.5, json={
                "messages": [{"role": "user", "content": f"slow {i}"}], "max_tokens": 2000})
        except httpx.TimeoutException:
            pass

    with ThreadPoolExecutor(80) as pool:
        list(pool.map(streaming_client, range(64)))
        list(pool.map(impatient_client, range(16)))
    _wait_idle(base, 10)
    started = time.monotonic()
    r = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "after the storm"}], "max_tokens": 4})
    assert r.status_code == 200
    assert time.monotonic() - started < 5


def test_a_system_prompt_outlives_a_restart_with_a_prompt_cache_dir(tiny_model_path, tmp_path):
    env = {"MLX_TRIO_MODEL": tiny_model_path, "MLX_TRIO_PROMPT_CACHE_DIR": str(tmp_path / "kv")}
    system = {"role": "system", "content": " ".join(f"rule{i}" for i in range(200))}

    def ask(base, question):
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": [system, {"role": "user", "content": question}], "max_tokens": 2})
        assert r.status_code == 200
        return r.json()["usage"]

    proc, base = spawn_server(hypercorn_args, env)
    try:
        first = ask(base, "first question")
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        stop_server(proc)
    assert list((tmp_path / "kv").glob("*.json")), "the system prompt's entry on disk"
    proc, base = spawn_server(hypercorn_args, env)
    try:
        usage = ask(base, "a question after the restart")
        # The system prompt (most of the first prompt) came back from disk.
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0.9 * first["prompt_tokens"]
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert "mlx_trio_prompt_cache_disk_reads_total 1.0" in metrics
        disk = health(base)["prompt_cache"]["disk"]
        assert disk["reads"] == 1 and disk["entries"] >= 1 and disk["bytes"] > 0
    finally:
        stop_server(proc)


def test_huge_body_is_a_413(server):
    body = b'{"prompt": "' + b"x" * (9 * 2**20) + b'"}'
    r = httpx.post(f"{server}/v1/completions", content=body,
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "invalid_request_error"
