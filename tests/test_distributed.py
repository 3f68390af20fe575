"""Two ranks on loopback (mx.distributed ring backend, CPU): tensor and pipeline parallel.

Each group is two real ``mlx-trio-server`` processes started the way
``mlx.launch --backend ring -n 2`` starts them (``MLX_RANK`` and a ring
hostfile in ``MLX_HOSTFILE``), so a test can stop, kill or freeze one rank.
The model is a tiny Llama (mlx-lm 0.32's qwen3 cannot be sharded). Every
output is compared with one process serving the same model alone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests import conftest
from tests.conftest import raw_chat_request, read_sse_chunks

pytestmark = [pytest.mark.server, pytest.mark.distributed]  # starts mlx.launch ranks

PROMPTS = ["hello there", "what is the weather in Paris", "tell me about cats", "the time in Rome"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int, avoid: int) -> int:
    """A first port of ``count`` consecutive free ports, none of them ``avoid``: mlx.launch's
    ring gives rank i ``--starting-port + i`` (a free first port alone once ran into the
    server's own HTTP port, chosen just before)."""
    while True:
        first = free_port()
        ports = range(first, first + count)
        if avoid in ports:
            continue
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first


def server_command(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "api.cli", "--model", model, "--port", str(port),
            "--max-tokens", "24", *extra]


def wait_healthy(base: str, procs: list[subprocess.Popen], seconds: float = 90) -> None:
    if not conftest.wait_healthy(base, procs, seconds):
        for p in procs:
            p.kill()
        pytest.fail("the server did not become healthy")


class Group:
    """Two ranks started by hand, as mlx.launch would (ring backend, loopback)."""

    def __init__(self, model: str, tmp: Path, *extra: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        hostfile = tmp / f"hosts-{self.port}.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
        self.logs = [tmp / f"rank{r}-{self.port}.log" for r in range(2)]
        self.procs = []
        for rank in range(2):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            with open(self.logs[rank], "wb") as log:
                self.procs.append(subprocess.Popen(
                    server_command(model, self.port, "--distributed-backend", "ring", *extra),
                    env=env, stdout=log, stderr=subprocess.STDOUT,
                ))
        wait_healthy(self.base, self.procs)

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def health(base: str) -> tuple[int, dict]:
    r = httpx.get(f"{base}/health", timeout=5)
    return r.status_code, r.json()


def chat(base: str, prompt: str, **fields) -> dict:
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": prompt}], **fields},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def complete(base: str, prompt: str, **fields) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, **fields}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def answers(base: str) -> list:
    """Greedy chat and text outputs, a seeded sampled one, and logprobs."""
    out = [chat(base, p)["choices"][0]["message"]["content"] for p in PROMPTS]
    out += [complete(base, p, max_tokens=16)["choices"][0]["text"] for p in PROMPTS[:2]]
    out.append(chat(base, PROMPTS[0], temperature=0.9, seed=7)["choices"][0]["message"]["content"])
    lp = chat(base, PROMPTS[1], logprobs=True, top_logprobs=3, max_tokens=6)
    out.append([t["token"] for t in lp["choices"][0]["logprobs"]["content"]])
    return out


def _build(tmp_path_factory, arch: str) -> str:
    from runtime.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch))


@pytest.fixture(scope="module")
def llama_model_path(tmp_path_factory) -> str:
    return _build(tmp_path_factory, "llama")


# mlx-lm 0.32's llama can be sharded by tensor but not pipelined; qwen2 does both.
MODE_ARCH = {"tensor": "llama", "pipeline": "qwen2"}


@pytest.fixture(scope="module", params=["tensor", "pipeline"])
def mode_model(request, tmp_path_factory, llama_model_path) -> tuple[str, str]:
    arch = MODE_ARCH[request.param]
    path = llama_model_path if arch == "llama" else _build(tmp_path_factory, arch)
    return request.param, path


@pytest.fixture(scope="module")
def solo_answers(mode_model) -> list:
    port = free_port()
    proc = subprocess.Popen(server_command(mode_model[1], port),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, [proc])
        return answers(base)
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def group(mode_model, tmp_path_factory):
    mode, path = mode_model
    extra = ("--pipeline",) if mode == "pipeline" else ()
    g = Group(path, tmp_path_factory.mktemp(mode), *extra)
    g.mode = mode
    yield g
    g.kill()


def _raw_stream(base: str, prompt: str) -> None:
    """Open a streaming request, read three chunks, and drop the connection."""
    host, port = base.removeprefix("http://").split(":")
    request = raw_chat_request(host, {"messages": [{"role": "user", "content": prompt}],
                                      "max_tokens": 5000, "stream": True})
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request)
        read_sse_chunks(sock, 3)
        assert health(base)[1]["active_sequences"] >= 1


def _wait_idle(base: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        h = health(base)[1]
        if h["active_sequences"] == 0 and h["requests_in_flight"] == 0:
            return
        assert time.monotonic() < deadline, f"not idle: {h}"
        time.sleep(0.05)


def test_health_reports_the_group(group):
    status, body = health(group.base)
    assert status == 200
    assert body["distributed"] == {"ranks": 2, "parallel": group.mode}
    assert "rank 1 ready" in group.log(1)


def test_greedy_and_seeded_outputs_match_one_rank(group, solo_answers):
    assert answers(group.base) == solo_answers


def test_concurrent_requests_match_one_rank(group, solo_answers):
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: chat(group.base, p)["choices"][0]["message"]["content"],
                            PROMPTS * 2))
    assert got == solo_answers[: len(PROMPTS)] * 2


def test_disconnect_mid_stream_leaves_every_rank_in_step(group, solo_answers):
    with ThreadPoolExecutor(2) as pool:  # one request keeps decoding beside the aborted one
        busy = pool.submit(chat, group.base, PROMPTS[2])
        _raw_stream(group.base, "a long story please")
        _raw_stream(group.base, "another long story")
        assert busy.result()["choices"][0]["message"]["content"] == solo_answers[2]
    _wait_idle(group.base)
    # Had rank 1 kept an aborted sequence, the batches would differ and the
    # collectives (tensor) or the stages (pipeline) would fail or diverge.
    assert chat(group.base, PROMPTS[0])["choices"][0]["message"]["content"] == solo_answers[0]


def test_unknown_model_is_a_404_not_a_swap(group):
    r = httpx.post(f"{group.base}/v1/chat/completions", timeout=30, json={
        "model": "/nonexistent/model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"


def test_sigterm_on_rank0_stops_every_rank_in_step(llama_model_path, tmp_path):
    g = Group(llama_model_path, tmp_path)
    try:
        chat(g.base, PROMPTS[0])
        g.procs[0].send_signal(signal.SIGTERM)
        assert g.procs[0].wait(30) == 0
        assert g.procs[1].wait(30) == 0
    finally:
        g.kill()
    assert "shutdown from rank 0" in g.log(1)
    steps = [re.findall(r"stopping after (\d+) engine steps", g.log(r)) for r in range(2)]
    assert steps[0] and steps[0] == steps[1], steps


def test_a_dead_rank_turns_health_503_and_requests_fail_fast(llama_model_path, tmp_path):
    g = Group(llama_model_path, tmp_path)
    try:
        g.procs[1].kill()
        deadline = time.monotonic() + 15
        while health(g.base)[0] != 503:
            assert time.monotonic() < deadline, "health still 200 with rank 1 dead"
            time.sleep(0.1)
        assert "distributed" in health(g.base)[1]["reason"]
        t0 = time.monotonic()
        r = httpx.post(f"{g.base}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503
        assert time.monotonic() - t0 < 5
        g.procs[0].send_signal(signal.SIGTERM)
        assert g.procs[0].wait(30) == 0
    finally:
        g.kill()


def test_a_hung_rank_fails_the_running_stream_and_health(llama_model_path, tmp_path):
    g = Group(llama_model_path, tmp_path, "--distributed-timeout", "3")
    try:
        with ThreadPoolExecutor(1) as pool:
            def stream() -> tuple[int, str]:
                with httpx.stream("POST", f"{g.base}/v1/chat/completions", timeout=60, json={
                    "messages": [{"role": "user", "content": "a long story"}],
                    "max_tokens": 100000, "stream": True,
                }) as r:
                    return r.status_code, "".join(r.iter_text())

            running = pool.submit(stream)
            deadline = time.monotonic() + 20
            while health(g.base)[1]["active_sequences"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            g.procs[1].send_signal(signal.SIGSTOP)  # rank 1 freezes mid-generation
            t0 = time.monotonic()
            status, text = running.result(timeout=30)
            assert time.monotonic() - t0 < 15
        assert status == 200  # the stream had started; its end carries the error
        assert "stopped responding" in text
        assert text.rstrip().endswith("data: [DONE]")
        code, body = health(g.base)
        assert code == 503 and "stopped responding" in body["reason"]
        r = httpx.post(f"{g.base}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503
        g.procs[0].send_signal(signal.SIGTERM)
        assert g.procs[0].wait(30) == 0  # does not wait for ever on the frozen rank
    finally:
        if g.procs[1].poll() is None:
            g.procs[1].send_signal(signal.SIGCONT)
        g.kill()


def test_mlx_launch_starts_a_serving_group(llama_model_path, tmp_path):
    """The documented launch: ``mlx.launch --backend ring -n 2 -- mlx-trio-server ...``."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    if not launcher.exists():
        pytest.skip("mlx.launch is not installed beside this interpreter")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "launch.log").open("wb")
    proc = subprocess.Popen(
        [str(launcher), "--backend", "ring", "-n", "2", "--starting-port", str(free_port_run(2, avoid=port)),
         "--", *server_command(llama_model_path, port, "--distributed-backend", "ring")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        wait_healthy(base, [proc])
        assert health(base)[1]["distributed"]["ranks"] == 2
        assert chat(base, PROMPTS[0])["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (its launcher, the parent, is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_killing_the_launcher_ends_both_ranks(llama_model_path, tmp_path):
    """mlx.launch killed outright (no chance to stop its ranks): both leave within seconds.

    (What they log then goes nowhere: the launcher held their output pipes.)"""
    launcher = Path(sys.executable).with_name("mlx.launch")
    if not launcher.exists():
        pytest.skip("mlx.launch is not installed beside this interpreter")
    port = free_port()
    log = (tmp_path / "launch.log").open("wb")
    proc = subprocess.Popen(
        [str(launcher), "--backend", "ring", "-n", "2", "--starting-port", str(free_port_run(2, avoid=port)),
         "--", *server_command(llama_model_path, port, "--distributed-backend", "ring")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    ranks: list[int] = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [proc])
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)],
                             capture_output=True, text=True).stdout
        ranks = [int(pid) for pid in out.split()]  # bash exec'd each rank: the launcher's children
        assert len(ranks) == 2
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while not all(_exited(pid) for pid in ranks):
            assert time.monotonic() < deadline, "a rank outlived its launcher"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in ranks:
            if not _exited(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_frozen_rank0_makes_the_follower_leave(llama_model_path, tmp_path):
    g = Group(llama_model_path, tmp_path, "--distributed-timeout", "3")
    try:
        g.procs[0].send_signal(signal.SIGSTOP)  # rank 0 stops sending heartbeats
        t0 = time.monotonic()
        assert g.procs[1].wait(20) == 1
        assert time.monotonic() - t0 < 10
        assert "rank 0 has sent no step or heartbeat" in g.log(1)
    finally:
        g.procs[0].send_signal(signal.SIGCONT)
        g.kill()
