"""Shared fixtures: a tiny random Qwen3 model built offline, and a running app."""

from __future__ import annotations

import contextlib
import sys

from runtime.cpu_blas import load_into_this_process

# Before anything here loads MLX: the tests' own MLX multiplies on the OpenBLAS the
# server's engine processes use (--cpu-blas openblas), so that answers computed here
# and answers served by an engine process come from the same arithmetic.
load_into_this_process("openblas")

import pytest  # noqa: E402
import trio  # noqa: E402

from runtime.tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def data_home(tmp_path_factory):
    """The server's data directory (stored responses) in a temporary folder: no test
    writes to the user's own; servers the tests start inherit it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("data-home")))
        yield


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
#   (no marker)  unit and property tests: fakes, or a model served in-process
#                (its engine may run in the child process the app starts);
#   server       starts real servers or processes of its own (subprocesses,
#                listening sockets, a browser), or serves the trained demo model;
#   distributed  launches several ranks with mlx.launch.
# A module of the last two kinds says so itself (``pytestmark = pytest.mark.server``;
# test_distributed carries both marks).
# The quick subset: python -m pytest -m "not server and not distributed"
#
# The marks cannot fall behind the tests: a test without them that starts a
# process or listens on a socket fails (``refusing_servers``), naming the mark.
SERVER_MARKS = ("server", "distributed")
# The one process an unmarked test may start: the engine process of an app it
# serves in-process (the default ``--engine-mode process``).
ENGINE_PROCESS_MODULE = "runtime.engine.process"


@contextlib.contextmanager
def refusing_servers(test: str = "this test"):
    """Within: starting a process (other than an app's engine process) or
    listening on a socket fails ``test``; yields the list of what was tried."""
    import multiprocessing.process
    import socket
    import subprocess

    tried: list[str] = []

    def refuse(what: str) -> None:
        tried.append(what)
        pytest.fail(
            f"{test} {what}: mark its module as one that does "
            "(pytestmark = pytest.mark.server), or serve in-process",
            pytrace=False,
        )

    popen_init = subprocess.Popen.__init__

    def guarded_popen_init(self, args, *more, **options):
        if sys._getframe(1).f_globals.get("__name__") != ENGINE_PROCESS_MODULE:
            refuse(f"starts a process ({args!r})")
        popen_init(self, args, *more, **options)

    def guarded_start(self):
        refuse(f"starts a process ({self!r})")

    def guarded_listen(self, *backlog):
        refuse(f"listens on {self.getsockname()!r}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", guarded_popen_init)
        patch.setattr(multiprocessing.process.BaseProcess, "start", guarded_start)
        patch.setattr(socket.socket, "listen", guarded_listen)
        yield tried


GUARD = pytest.StashKey[contextlib.ExitStack]()
TRIED = pytest.StashKey[list]()
FAILED = pytest.StashKey[bool]()


# The guard spans a test's whole run, the fixtures of any scope it sets up and
# tears down included.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if not any(item.get_closest_marker(mark) for mark in SERVER_MARKS):
        guard = contextlib.ExitStack()
        item.stash[TRIED] = guard.enter_context(refusing_servers(item.nodeid))
        item.stash[GUARD] = guard
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        result = yield
    finally:
        if GUARD in item.stash:
            item.stash[GUARD].close()
    tried = item.stash.get(TRIED, [])
    if tried and not item.stash.get(FAILED, False):
        # Refused, but the failure was caught on its way up (or raised on another thread).
        pytest.fail(f"{item.nodeid}: {'; '.join(tried)}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        item.stash[FAILED] = True
    return report


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


# SDK clients of a module's ``server`` fixture (its base URL), for the modules that have one.


@pytest.fixture(scope="module")
def oai(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ant(server):
    import anthropic

    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
