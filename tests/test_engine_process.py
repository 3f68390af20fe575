"""The engine in its own process (``--engine-mode process``, the default).

A real child process with the tiny model: it serves what the in-process engine
thread serves, a killed engine process is a crash (503, restart, serving
again), and the engine process never outlives the server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import trio

from api.server import create_app
from runtime.config import ServerConfig
from tests.conftest import poll_until, wait_ready
from tests.test_api import CHAT, chat_body, parse_sse, post, stream_post
from tests.test_server_process import spawn_server

pytestmark = pytest.mark.server  # starts engine processes (and kills them) and servers


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _health(client) -> dict:
    return await (await client.get("/health")).get_json()


async def test_process_and_thread_engines_give_the_same_answers(tiny_model_path):
    answers = {}
    for mode in ("process", "thread"):
        app = create_app(ServerConfig(model=tiny_model_path, max_tokens=24, engine_mode=mode))
        async with app.test_app() as test_app:
            client = test_app.test_client()
            await wait_ready(client)
            health = await _health(client)
            assert health["engine"]["mode"] == mode
            assert (health["engine"]["pid"] == os.getpid()) == (mode == "thread")
            got = []
            for i in range(3):
                status, body, _ = await post(client, CHAT, chat_body(f"tell me {i}"))
                assert status == 200
                got.append(body["choices"][0]["message"]["content"])
            status, _, raw = await stream_post(client, CHAT, chat_body("tell me 0", stream=True))
            payloads, _, done = parse_sse(raw)
            assert status == 200 and done
            text = "".join(
                p["choices"][0]["delta"].get("content") or "" for p in payloads if p["choices"]
            )
            assert text == got[0]
            answers[mode] = got
    assert answers["process"] == answers["thread"]


async def test_a_killed_engine_process_is_a_crash_then_a_restart(tiny_model_path):
    app = create_app(ServerConfig(model=tiny_model_path, max_tokens=100000))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        pid = (await _health(client))["engine"]["pid"]
        assert pid != os.getpid() and _alive(pid)
        raw = []

        async def long_stream():
            raw.append(await stream_post(client, CHAT, chat_body("go on", stream=True)))

        runtime = app.extensions["runtime"]
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_stream)
                await poll_until(lambda: runtime.scheduler.figures().stats.active_sequences == 1, 10)
                os.kill(pid, signal.SIGKILL)
        # The running stream ends (no hang) with an error event and [DONE].
        status, _, body = raw[0]
        payloads, _, done = parse_sse(body)
        assert status == 200 and done
        assert "engine process died" in payloads[-1]["error"]["message"]
        assert "SIGKILL" in payloads[-1]["error"]["message"]
        with trio.fail_after(60):
            await wait_ready(client)
        health = await _health(client)
        assert health["engine_restarts"] == 1
        assert health["engine"]["pid"] not in (pid, os.getpid())
        # Nothing is in flight now, and both /health and /metrics say so (not the
        # dead engine's last figures).
        assert health["active_sequences"] == 0
        assert health["requests_in_flight"] == 0 and health["waiting"] == 0
        metrics = await (await client.get("/metrics")).get_data(as_text=True)
        for line in ("mlx_trio_active_sequences 0.0", "mlx_trio_requests_in_flight 0.0",
                     "mlx_trio_requests_running 0.0", "mlx_trio_engine_restarts_total 1.0",
                     'mlx_trio_requests_finished_total{outcome="error"} 1.0',
                     "mlx_trio_model_load_seconds_count 2.0"):
            assert line in metrics.splitlines(), line
        status, body, _ = await post(client, CHAT, chat_body("and again", max_tokens=4))
        assert status == 200, body
    assert not _alive(health["engine"]["pid"])  # the app's exit stopped the new one


def _engine_pid(base: str) -> int:
    return httpx.get(f"{base}/health", timeout=5).json()["engine"]["pid"]


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_engine_process_leaves_when_the_server_is_killed(tiny_model_path):
    proc, base = spawn_server(
        lambda port: ["-m", "api.cli", "--model", tiny_model_path, "--port", str(port)]
    )
    try:
        pid = _engine_pid(base)
        assert pid != proc.pid and _alive(pid)
        proc.kill()  # SIGKILL: no cleanup in the server at all
        proc.wait(timeout=10)
        assert _wait_gone(pid, 15), "the engine process outlived its server"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_to_the_process_group_stops_server_and_engine(tiny_model_path):
    port_args = ["-m", "api.cli", "--model", tiny_model_path, "--port"]
    proc, base = spawn_server(lambda port: [*port_args, str(port)])
    try:
        pid = _engine_pid(base)
        body = {
            "messages": [{"role": "user", "content": "a story"}],
            "max_tokens": 200,
            "stream": True,
        }
        raw = b""
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            for chunk in r.iter_bytes():
                if not raw:
                    # What a terminal's Ctrl-C does: SIGINT to server and engine at once.
                    os.kill(proc.pid, signal.SIGINT)
                    os.kill(pid, signal.SIGINT)
                raw += chunk
        # The engine ignored its SIGINT: the stream finished, then both left.
        assert raw.rstrip().endswith(b"data: [DONE]")
        assert b'"error"' not in raw
        assert proc.wait(timeout=30) == 0
        assert _wait_gone(pid, 15)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_engine_mode_flag(mode, tiny_model_path):
    proc, base = spawn_server(
        lambda port: [
            "-m",
            "api.cli",
            "--model",
            tiny_model_path,
            "--port",
            str(port),
            "--engine-mode",
            mode,
        ]
    )
    try:
        health = httpx.get(f"{base}/health", timeout=5).json()
        assert health["engine"]["mode"] == mode
        assert (health["engine"]["pid"] == proc.pid) == (mode == "thread")
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_a_bad_engine_mode_is_refused():
    done = subprocess.run(
        [sys.executable, "-m", "api.cli", "--engine-mode", "fork"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--engine-mode" in done.stderr


# ------------------------------------------------ ProcessInbox (no engine needed)


def _socket_connections():
    import socket
    from multiprocessing.connection import Connection

    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def _submit(rid: int, n_tokens: int):
    from runtime.messages import SamplingParams, Submit

    prompt = tuple(range(n_tokens))
    return Submit(
        request_id=rid,
        prompt=prompt,
        segments=(prompt,),
        segment_types=("assistant",),
        sampling=SamplingParams(),
        max_tokens=4,
    )


def test_a_small_command_goes_straight_into_the_socket():
    import queue

    from runtime.engine.process import ProcessInbox
    from runtime.messages import Abort

    here, there = _socket_connections()
    queued = queue.SimpleQueue()
    inbox = ProcessInbox(here, queued)  # no writer thread: only the direct path can deliver
    inbox.put(Abort(request_id=7))
    assert queued.empty()
    assert there.poll(5) and there.recv() == Abort(request_id=7)
    inbox.put(_submit(1, 20000))  # too big to write from the caller: queued
    assert not queued.empty() and not there.poll(0.1)


def test_commands_arrive_in_the_order_they_were_put():
    import queue
    import random
    import threading

    from runtime.engine.process import ProcessInbox, _forward_commands
    from runtime.messages import Abort

    here, there = _socket_connections()
    queued = queue.SimpleQueue()
    inbox = ProcessInbox(here, queued)
    writer = threading.Thread(target=_forward_commands, args=(queued, here, inbox), daemon=True)
    writer.start()
    rng = random.Random(0)
    sent = []
    received = []

    def read():
        while len(received) < 400:
            received.append(there.recv())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for i in range(400):
        # Big Submits go through the writer thread, Aborts straight when they can:
        # an Abort must never overtake the Submit put before it.
        command = _submit(i, rng.choice([5, 30000])) if rng.random() < 0.5 else Abort(request_id=i)
        sent.append(command)
        inbox.put(command)
    reader.join(30)
    queued.put(None)
    assert received == sent


def test_a_command_goes_straight_in_with_a_descriptor_past_1024():
    """A busy server's sockets can be numbered past select()'s limit of 1024."""
    import queue
    import resource

    from runtime.engine.process import ProcessInbox
    from runtime.messages import Abort

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("cannot open more than 1200 files here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    spare = []
    try:
        while True:
            spare.append(os.open(os.devnull, os.O_RDONLY))
            if spare[-1] > 1030:
                break
        here, there = _socket_connections()
        assert here.fileno() > 1024
        inbox = ProcessInbox(here, queue.SimpleQueue())
        inbox.put(Abort(request_id=3))
        assert there.poll(5) and there.recv() == Abort(request_id=3)
    finally:
        for fd in spare:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
