"""Three replicas behind Debian's nginx with session affinity (docs/scaling.md).

The replicas are ``python -m api.cli`` on loopback ports serving the embedded
demo model, one process each (``--engine-mode thread``); nginx runs in the
foreground (``daemon off``) on the configuration ``bench/affinity.py``'s
``nginx_config`` writes, the one docs/scaling.md shows (the first test checks
that the two agree), with its pid file, logs and temporary folders under
``tmp_path``. nginx adds ``X-Upstream: $upstream_addr`` to every answer: that
header says which replica answered. The ``nginx`` fixture installs nginx with
apt-get when it is missing and this process is root, and skips, saying why,
where it cannot be installed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import wait_healthy
from tests.test_server_process import free_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import affinity  # noqa: E402

pytestmark = pytest.mark.server  # starts nginx and three server subprocesses

CLAUDE, CODEX, OURS = affinity.SESSION_HEADERS
REPLICA_FLAGS = [
    "--engine-mode", "thread", "--decode-concurrency", "4", "--prompt-concurrency", "2",
    "--max-tokens", "4",
]
# The documented configuration's parameters (docs/scaling.md).
DOC_LISTEN = "8080"
DOC_REPLICAS = ["127.0.0.1:8081", "127.0.0.1:8082", "127.0.0.1:8083"]
DOC_PREFIX = "/srv/mlx-trio"
# A system prompt long enough for the prompt cache (past --prompt-cache-min-reuse, 64
# tokens), different per session (its id first), so that only the replica that
# served a session's first turn can serve its second from the cache.
FILLER = " ".join(["The agent reads files, runs commands and edits code."] * 12)


def install_nginx() -> str | None:
    """Install Debian's nginx if missing and possible; None when it is there, else why not."""
    if affinity.find_nginx() is not None:
        return None
    if not shutil.which("apt-get"):
        return "nginx is missing and there is no apt-get to install it"
    if os.geteuid() != 0:
        return "nginx is missing; install it as root: apt-get install -y nginx"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command, seconds in (
        (["apt-get", "update"], 300),
        (["apt-get", "install", "-y", "--no-install-recommends", "nginx"], 600),
    ):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=seconds)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(command)}` took more than {seconds} s"
        if done.returncode != 0:
            return f"`{' '.join(command)}` failed: {(done.stderr or done.stdout)[-500:]}"
    return None if affinity.find_nginx() is not None else "apt-get installed nginx but no nginx binary"


@pytest.fixture(scope="module")
def nginx():
    reason = install_nginx()
    if reason is not None:
        pytest.skip(f"no nginx for the scaling tests: {reason}")
    return affinity.find_nginx()


class Cluster:
    """Three replicas and nginx in front of them."""

    def __init__(self, nginx: str, prefix: Path) -> None:
        self.procs: dict[str, subprocess.Popen] = {}  # replica address -> its process
        for _ in range(3):
            port = free_port()
            self.procs[f"127.0.0.1:{port}"] = subprocess.Popen(
                [sys.executable, "-m", "api.cli", "--port", str(port), *REPLICA_FLAGS],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=ROOT,
            )
        self.proxy: affinity.Nginx | None = None
        for address in self.procs:  # started together, each waited for
            if not wait_healthy(f"http://{address}", list(self.procs.values())):
                self.stop()
                pytest.fail(f"replica {address} did not start")
        port = free_port()
        config = affinity.nginx_config(
            listen=f"127.0.0.1:{port}", replicas=list(self.procs), prefix=str(prefix),
            user=affinity.worker_user(),
        )
        self.proxy = affinity.Nginx(nginx, prefix, config, port)
        try:
            self.proxy.start()
        except RuntimeError as exc:
            self.stop()
            pytest.fail(str(exc))
        self.url = self.proxy.url

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def cluster_in(nginx: str, prefix: Path):
    c = Cluster(nginx, prefix)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster(nginx, tmp_path_factory):
    with cluster_in(nginx, tmp_path_factory.mktemp("nginx")) as c:
        yield c


def chat(client: httpx.Client, url: str, headers: dict, messages: list[dict]) -> httpx.Response:
    return client.post(
        f"{url}/v1/chat/completions", headers=headers,
        json={"messages": messages, "max_tokens": 2}, timeout=30,
    )


def ask(url: str, headers: dict, text: str = "hi") -> str:
    """One request; the replica that answered it."""
    with httpx.Client() as client:
        r = chat(client, url, headers, [{"role": "user", "content": text}])
    assert r.status_code == 200, r.text
    return affinity.answered_by(r.headers.get("x-upstream"))


def test_the_documented_config_is_the_one_tested():
    text = (ROOT / "docs" / "scaling.md").read_text()
    blocks = re.findall(r"^```nginx\n(.*?)^```", text, re.M | re.S)
    expected = affinity.nginx_config(listen=DOC_LISTEN, replicas=DOC_REPLICAS, prefix=DOC_PREFIX)
    assert expected in blocks, "docs/scaling.md's nginx.conf is not nginx_config()'s output"


def test_one_session_one_replica_and_its_prompt_cache(cluster):
    # Each kind of session header, and a client that sends none (keyed on its address).
    kinds = [{CLAUDE: "claude-7f1c"}, {CODEX: "codex-0b9e"}, {OURS: "alice"}, {}]
    for headers in kinds:
        answered = {ask(cluster.url, headers, f"turn {i}") for i in range(4)}
        assert len(answered) == 1 and answered <= set(cluster.procs), (headers, answered)
    # The first header present decides: Claude Code's over Codex's over ours. (Ids of
    # sessions on three different replicas, so that the checks can tell.)
    claude = ask(cluster.url, {CLAUDE: "claude-7f1c"})
    codex = next(f"codex-{i}" for i in range(100) if ask(cluster.url, {CODEX: f"codex-{i}"}) != claude)
    codex_home = ask(cluster.url, {CODEX: codex})
    other = next(f"other-{i}" for i in range(100)
                 if ask(cluster.url, {OURS: f"other-{i}"}) not in (claude, codex_home))
    assert ask(cluster.url, {CLAUDE: "claude-7f1c", CODEX: codex, OURS: other}) == claude
    assert ask(cluster.url, {CODEX: codex, OURS: other}) == codex_home

    # A session's second turn starts from the prompt cache its first turn left.
    with httpx.Client() as client:
        for i in range(3):
            headers = {CLAUDE: f"cache-{i}"}
            first = [{"role": "system", "content": f"Session cache-{i}. {FILLER}"},
                     {"role": "user", "content": "What is 2 + 3?"}]
            r1 = chat(client, cluster.url, headers, first)
            assert r1.status_code == 200, r1.text
            second = [*first, {"role": "assistant", "content": "5"},
                      {"role": "user", "content": "And 4 + 4?"}]
            r2 = chat(client, cluster.url, headers, second)
            assert r2.status_code == 200, r2.text
            assert r2.headers["x-upstream"] == r1.headers["x-upstream"]
            assert r2.headers["x-prompt-cache"].startswith("hit"), r2.headers["x-prompt-cache"]
            assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


def test_sessions_spread_over_the_replicas(cluster):
    placed = {}
    for i in range(16):
        headers = [{CLAUDE: f"spread-{i}"}, {CODEX: f"spread-{i}"}, {OURS: f"spread-{i}"}][i % 3]
        placed[i] = ask(cluster.url, headers)
        assert ask(cluster.url, headers) == placed[i]  # and it stays there
    assert len(set(placed.values())) >= 2, placed


def test_killed_replica_sessions_move_with_no_failed_request(nginx, tmp_path):
    """SIGKILL the replica of session 0 while six sessions send requests in a loop:
    only a request in flight at the kill may fail; every later one is a 200, the
    dead replica's sessions each land on one live replica, the others stay put."""
    with cluster_in(nginx, tmp_path / "nginx") as c:
        sessions = [{[CLAUDE, CODEX, OURS][i % 3]: f"loop-{i}"} for i in range(6)]
        done: list[list[tuple[float, float, int, str | None]]] = [[] for _ in sessions]
        stop = threading.Event()

        def loop(i: int) -> None:
            with httpx.Client() as client:
                n = 0
                while not stop.is_set():
                    n += 1
                    start = time.monotonic()
                    try:
                        r = chat(client, c.url, sessions[i], [
                            {"role": "user", "content": f"loop {i} request {n}"}])
                        status, replica = r.status_code, affinity.answered_by(
                            r.headers.get("x-upstream"))
                    except httpx.HTTPError:
                        status, replica = 0, None
                    done[i].append((start, time.monotonic(), status, replica))

        def wait_for(n: int, since: float = 0.0) -> None:
            deadline = time.monotonic() + 30
            while min(sum(start > since for start, *_ in d) for d in done) < n:
                assert time.monotonic() < deadline, [len(d) for d in done]
                time.sleep(0.02)

        with ThreadPoolExecutor(len(sessions)) as pool:
            loops = [pool.submit(loop, i) for i in range(len(sessions))]
            try:
                wait_for(3)
                before = {i: {r for *_, r in d} for i, d in enumerate(done)}
                assert all(len(b) == 1 for b in before.values()), before
                home = {i: next(iter(b)) for i, b in before.items()}
                dead = home[0]
                killed = time.monotonic()  # a request started from here on must be a 200
                c.procs[dead].send_signal(signal.SIGKILL)
                c.procs[dead].wait()
                wait_for(5, since=killed)
            finally:
                stop.set()
            for f in loops:
                f.result()

        live = set(c.procs) - {dead}
        for i, d in enumerate(done):
            after = [(status, replica) for start, _, status, replica in d if start > killed]
            assert all(status == 200 for status, _ in after), (i, after)
            moved = {replica for _, replica in after}
            assert len(moved) == 1 and moved <= live, (i, dead, moved)
            if home[i] != dead:
                assert moved == {home[i]}, (i, home[i], moved)  # only the dead one's sessions move
            # A request started before the kill may fail only if it was in flight at it.
            failed = [(s, e) for s, e, status, _ in d if s <= killed and status != 200]
            assert all(e >= killed for _, e in failed) and len(failed) <= 1, (i, failed)
