"""Shutdown and start-up failures through real server processes.

SIGTERM during a long stream: the client sees the last chunk (``finish_reason``
``abort``), the usage, an error event and ``[DONE]``, a clean end of the HTTP
body; a waiting non-streaming request gets 503 with ``Retry-After``; the
process exits 0. Through ``mlx-trio-server`` (it drains on the signal, after
``--shutdown-grace``) and ``hypercorn api:app`` (it drains when a request
sees Hypercorn's graceful deadline). A served model that is not on this
machine and cannot be downloaded (offline), or that fails to load, ends the
process with status 1 and says why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.test_server_process import free_port, hypercorn_args, spawn_server

pytestmark = pytest.mark.server  # starts server subprocesses, stopped with SIGTERM


@pytest.fixture(scope="module")
def never_end(tiny_tokenizer) -> dict[str, float]:
    return {str(e): -100 for e in tiny_tokenizer.eos_token_ids}


@pytest.fixture(scope="module")
def long_window_model(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model with a 65,536-token window (its config's and its tokenizer's; the
    server takes the smaller). In its own 2,048 a stream ends by "length" about 2.5 s
    after its first token on this repository's CPU, which races the drain these tests
    are meant to see (2 s after SIGTERM under Hypercorn): "length" instead of "abort"."""
    path = tmp_path_factory.mktemp("long-window") / "qwen3"
    shutil.copytree(tiny_model_path, path)
    for name, key in (("config.json", "max_position_embeddings"),
                      ("tokenizer_config.json", "model_max_length")):
        settings = json.loads((path / name).read_text())
        settings[key] = 1 << 16
        (path / name).write_text(json.dumps(settings))
    return str(path)


def _sigterm_during_a_stream(proc, base: str, never_end, *, signal_to=None) -> None:
    """A stream and a waiting non-streaming request, SIGTERM, and what each client saw."""
    signal_to = signal_to or proc
    long = {"max_tokens": 10**6, "logit_bias": never_end}

    def waiting() -> httpx.Response:
        return httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "a long answer"}], **long})

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(waiting)
        raw = b""
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "a long story"}], "stream": True,
            "stream_options": {"include_usage": True}, **long,
        }) as r:
            assert r.status_code == 200
            for chunk in r.iter_bytes():  # raises if the body ends uncleanly (curl's exit 18)
                if not raw:
                    deadline = time.monotonic() + 30
                    while httpx.get(f"{base}/health", timeout=5).json()["active_sequences"] < 2:
                        assert time.monotonic() < deadline
                        time.sleep(0.05)
                    signal_to.send_signal(signal.SIGTERM)
                raw += chunk
        answer = pending.result(timeout=60)
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n")
    frames = [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: {")]
    final, usage, error = frames[-3:]
    assert final["choices"][0]["finish_reason"] == "abort", text[-1500:]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 1
    assert error["error"]["type"] == "service_unavailable"
    assert "shutting down" in error["error"]["message"]
    assert answer.status_code == 503
    assert answer.headers["Retry-After"] == "5"
    assert "shutting down" in answer.json()["error"]["message"]
    assert proc.wait(timeout=30) == 0


def test_sigterm_ends_open_requests_properly_mlx_trio_server(long_window_model, never_end):
    proc, base = spawn_server(lambda port: [
        "-m", "api.cli", "--model", long_window_model, "--port", str(port),
        "--shutdown-grace", "1"])
    try:
        started = time.monotonic()
        _sigterm_during_a_stream(proc, base, never_end)
        assert time.monotonic() - started < 20
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_ends_open_requests_properly_under_hypercorn(long_window_model, never_end):
    # Hypercorn's own graceful timeout (3 s): the app sees it as the requests' deadline.
    proc, base = spawn_server(
        lambda port: [*hypercorn_args(port), "--graceful-timeout", "3"],
        {"MLX_TRIO_MODEL": long_window_model},
    )
    try:
        _sigterm_during_a_stream(proc, base, never_end)
    finally:
        if proc.poll() is None:
            proc.kill()


def _run_to_exit(args: list[str], env: dict[str, str], seconds: float = 90) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, *args], env={**os.environ, **env}, capture_output=True, text=True,
        timeout=seconds,
    )
    return proc.returncode, proc.stdout + proc.stderr


OFFLINE_MODEL = "mlx-community/Qwen3-0.6B-4bit"


@pytest.mark.parametrize("how", ["mlx-trio-server", "hypercorn -w 0"])
def test_a_missing_model_says_where_it_looked_and_exits_1(tmp_path, how):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    if how == "mlx-trio-server":
        args = ["-m", "api.cli", "--model", OFFLINE_MODEL, "--port", str(free_port())]
    else:
        # Hypercorn's default multi-process runner reports 0 for a worker that could
        # not start (0.18: its run() loses the worker's status); -w 0 runs it here.
        env["MLX_TRIO_MODEL"] = OFFLINE_MODEL
        args = [*hypercorn_args(free_port()), "-w", "0"]
    started = time.monotonic()
    status, output = _run_to_exit(args, env)
    assert status == 1, output
    assert time.monotonic() - started < 60
    assert f"the model {OFFLINE_MODEL!r} was not found" in output
    assert str(tmp_path / "hf" / "hub") in output  # where it looked
    assert f"hf download {OFFLINE_MODEL}" in output  # how to fetch it
    assert "HF_HUB_OFFLINE is set" in output  # why it could not download it


def test_a_model_directory_without_a_config_is_refused(tmp_path):
    status, output = _run_to_exit(
        ["-m", "api.cli", "--model", str(tmp_path), "--port", str(free_port())], {})
    assert status == 1
    assert "has no config.json" in output


def test_a_model_that_fails_to_load_at_start_exits_1(tiny_model_path, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(tiny_model_path).iterdir():
        (broken / f.name).symlink_to(f)
    config = json.loads((Path(tiny_model_path) / "config.json").read_text())
    (broken / "config.json").unlink()
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    status, output = _run_to_exit(
        ["-m", "api.cli", "--model", str(broken), "--port", str(free_port())], {})
    assert status == 1, output
    assert "the model could not be loaded" in output
    assert "no_such_arch" in output
