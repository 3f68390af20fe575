"""The served model on first use: downloaded from the Hub, with a log line saying
what and how big, a progress bar only on a terminal, and the cache used after.

The Hub is ``tests.fake_hub.FakeHub`` on loopback serving the tiny model as
``tiny-org/tiny-model``; each server gets a Hugging Face home of its own.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import httpx
import pytest

from tests.fake_hub import FakeHub
from tests.test_server_process import spawn_server, stop_server

pytestmark = pytest.mark.server  # starts a fake Hub on loopback and server subprocesses

REPO = "tiny-org/tiny-model"


def hub_env(hub: FakeHub | None, home) -> dict[str, str]:
    env = {"HF_HOME": str(home), "HF_HUB_DISABLE_XET": "1"}
    if hub is None:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = hub.endpoint
    return env


def test_first_use_downloads_and_says_how_big_then_the_cache_serves(tiny_model_path, tmp_path):
    home = tmp_path / "hf"
    log_path = tmp_path / "first.log"

    def args(port):
        return ["-m", "api.cli", "--model", REPO, "--port", str(port)]

    with FakeHub(REPO, tiny_model_path) as hub, open(log_path, "wb") as log:
        proc, base = spawn_server(args, hub_env(hub, home), log=log)
        try:
            r = httpx.post(f"{base}/v1/completions", timeout=60,
                           json={"prompt": "hello", "max_tokens": 3})
            assert r.status_code == 200
            assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"] == REPO
        finally:
            stop_server(proc)
        assert any(r.startswith("GET /" + REPO + "/resolve/") for r in hub.requests)
    text = log_path.read_text(errors="replace")
    line = re.search(r"downloading (\S+) from the Hugging Face Hub: (\d+) files, (.+?), into (\S+)",
                     text)
    assert line, text
    assert line.group(1) == REPO and int(line.group(2)) == len(hub.files)
    assert line.group(3) == f"{hub.size / 1000:.1f} kB"
    assert line.group(4) == str(home / "hub")
    assert "%|" not in text  # no progress bar: stderr is a file

    # Later starts take it from the cache: no Hub needed, no download.
    log_path = tmp_path / "second.log"
    with open(log_path, "wb") as log:
        proc, base = spawn_server(args, hub_env(None, home), log=log)
        stop_server(proc)
    assert "downloading" not in log_path.read_text(errors="replace")


def test_a_terminal_gets_a_progress_bar(tiny_model_path, tmp_path):
    code = ("from runtime.config import ServerConfig\n"
            "from runtime.model_fetch import fetch_served_model\n"
            f"fetch_served_model(ServerConfig(model={REPO!r}))\n")
    with FakeHub(REPO, tiny_model_path) as hub:
        leader, follower = pty.openpty()
        # A terminal of 24 x 100 (a pty starts at 0 x 0, where tqdm draws nothing).
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        try:
            proc = subprocess.Popen([sys.executable, "-c", code], stderr=follower,
                                    stdout=subprocess.DEVNULL,
                                    env={**os.environ, **hub_env(hub, tmp_path / "hf")})
            os.close(follower)
            output = b""
            while True:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the other end closed: the process is done
                    break
                if not chunk:
                    break
                output += chunk
            assert proc.wait(60) == 0
        finally:
            os.close(leader)
    assert b"%|" in output, output[-2000:]


@pytest.mark.parametrize("missing", ["not in the repository", "hub unreachable"])
def test_a_failed_download_stops_the_start(tiny_model_path, tmp_path, missing):
    env = hub_env(None, tmp_path / "hf")
    env.pop("HF_HUB_OFFLINE")
    if missing == "hub unreachable":
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # discard: nothing listens
        repo = REPO
        with_hub = None
    else:
        repo = "tiny-org/no-such-model"
        with_hub = FakeHub(REPO, tiny_model_path)
        with_hub.__enter__()
        env["HF_ENDPOINT"] = with_hub.endpoint
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "api.cli", "--model", repo, "--port", "1"],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=90)
    finally:
        if with_hub is not None:
            with_hub.__exit__(None, None, None)
    assert proc.returncode == 1
    assert f"the model {repo!r} was not found" in proc.stderr
    assert f"hf download {repo}" in proc.stderr
