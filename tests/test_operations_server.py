"""A real ``mlx-trio-server`` with an API key: auth, request ids and its log, one line per event.

The server's output goes to a file, read after it stopped: Hypercorn's start-up
line appears once (it logs through our handlers, not its own as well), and
each request has exactly one ``mlx_trio.access`` line with its id, a client
that left mid-stream included (``finish=abandoned``).
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.conftest import raw_chat_request, read_sse_chunks
from tests.test_server_process import hypercorn_args, spawn_server, stop_server

pytestmark = pytest.mark.server  # starts hypercorn subprocesses

KEY = "sk-test-operations"


def test_auth_request_ids_and_one_log_line_per_event(tiny_model_path, tmp_path):
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc, base = spawn_server(
            lambda port: ["-m", "api.cli", "--model", tiny_model_path, "--port", str(port),
                          "--api-key", "other-key," + KEY, "--max-tokens", "8"],
            log=log,
        )
        try:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            refused = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30,
                                 headers={"x-request-id": "no-key-1"})
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert refused.headers["x-request-id"] == "no-key-1"

            served = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30,
                                headers={"Authorization": f"Bearer {KEY}",
                                         "x-request-id": "served-1"})
            assert served.status_code == 200, served.text
            assert served.headers["x-request-id"] == "served-1"

            with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=30,
                              json={**body, "stream": True},
                              headers={"x-api-key": KEY, "x-request-id": "stream-1"}) as r:
                assert r.headers["x-request-id"] == "stream-1"
                assert b"data: [DONE]" in r.read()

            # A client that leaves mid-stream: its line comes when the response ends.
            host, port = base.removeprefix("http://").split(":")
            request = raw_chat_request(host, {**body, "max_tokens": 100000, "stream": True})
            request = request.replace(
                b"\r\n\r\n", f"\r\nx-api-key: {KEY}\r\nx-request-id: left-1\r\n\r\n".encode(), 1
            )
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(request)
                read_sse_chunks(sock, 2)
            deadline = time.monotonic() + 10
            while httpx.get(f"{base}/health", timeout=5).json()["requests_in_flight"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert httpx.get(f"{base}/metrics", timeout=5).status_code == 200  # open
        finally:
            stop_server(proc)
    output = log_path.read_text()
    assert output.count("Running on http://") == 1, output
    access = [line for line in output.splitlines() if "mlx_trio.access:" in line]
    for request_id, status, finish in (("no-key-1", 401, None), ("served-1", 200, "length"),
                                       ("stream-1", 200, "length"), ("left-1", 200, "abandoned")):
        (line,) = [a for a in access if f"request_id={request_id} " in a]
        assert f"status={status} " in line, line
        if finish == "abandoned":
            assert "finish=abandoned " in line, line
        elif finish is not None:  # the tiny model may also end with its end-of-sequence token
            assert ("finish=length " in line or "finish=stop " in line), line
            assert "prompt_tokens=" in line and "ttft_ms=" in line, line
    assert KEY not in output


def test_under_hypercorn_the_key_comes_from_the_environment_and_lines_print_once(
    tiny_model_path, tmp_path
):
    log_path = tmp_path / "hypercorn.log"
    with open(log_path, "wb") as log:
        proc, base = spawn_server(
            hypercorn_args,
            {"MLX_TRIO_MODEL": tiny_model_path, "MLX_TRIO_API_KEY": KEY},
            log=log,
        )
        try:
            assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401
            listed = httpx.get(f"{base}/v1/models", timeout=10, headers={"x-api-key": KEY})
            assert listed.status_code == 200
            assert [card["id"] for card in listed.json()["data"]] == [tiny_model_path]
        finally:
            stop_server(proc)
    output = log_path.read_text()
    assert output.count("Running on http://") == 1, output
    assert output.count("mlx_trio.access:") == 2 + output.count("endpoint=/health"), output
