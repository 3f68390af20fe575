"""Stored responses outlive their process: a restarted server, and a writer killed with SIGKILL.

A real ``hypercorn api:app`` on the tiny model with
``MLX_TRIO_RESPONSES_STORE_PATH`` under ``tmp_path``: a response made before
a restart is returned by ``GET`` after it, and ``previous_response_id``
continues it. A child process writing responses in a loop through
``ResponseDatabase`` is killed with SIGKILL mid-write: the file passes
SQLite's integrity check and holds every response the child had reported
committed.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import httpx
import pytest

from api.agents.responses_db import ResponseDatabase
from tests.test_server_process import hypercorn_args, spawn_server, stop_server

pytestmark = pytest.mark.server  # starts hypercorn and a writer subprocess


def test_a_restarted_server_continues_a_stored_response(tiny_model_path, tmp_path):
    path = tmp_path / "responses.sqlite3"
    env = {"MLX_TRIO_MODEL": tiny_model_path, "MLX_TRIO_MAX_TOKENS": "4",
           "MLX_TRIO_RESPONSES_STORE_PATH": str(path)}
    proc, base = spawn_server(hypercorn_args, env)
    try:
        r = httpx.post(f"{base}/v1/responses", json={"input": "hello"}, timeout=60)
        assert r.status_code == 200, r.text
        first = r.json()
    finally:
        stop_server(proc)  # SIGTERM: the store writes what waits and closes the file

    proc, base = spawn_server(hypercorn_args, env)
    try:
        r = httpx.get(f"{base}/v1/responses/{first['id']}", timeout=30)
        assert r.status_code == 200, r.text
        assert r.json() == first
        r = httpx.post(f"{base}/v1/responses", timeout=60,
                       json={"input": "and then?", "previous_response_id": first["id"]})
        assert r.status_code == 200, r.text
        follow = r.json()
        assert follow["previous_response_id"] == first["id"]
        # The conversation came back: the prompt holds the first turn and its answer.
        assert follow["usage"]["input_tokens"] > first["usage"]["input_tokens"]
        assert httpx.get(f"{base}/v1/responses/{follow['id']}", timeout=30).status_code == 200
    finally:
        stop_server(proc)


WRITER = textwrap.dedent(
    """
    import random
    import sys
    from api.agents.responses_db import Entry, ResponseDatabase, StoredResponse

    db = ResponseDatabase(sys.argv[1])
    i = 0
    while True:
        conversation = tuple(
            {"role": "user",
             "content": f"turn {i}.{k} " + random.Random(i * 8 + k).randbytes(10000).hex()}
            for k in range(8)
        )
        response = StoredResponse(body={"id": f"resp_{i}", "n": i}, conversation=conversation)
        db.put(Entry(response_id=f"resp_{i}", owner="owner", created_at=i, response=response))
        print(f"resp_{i}", flush=True)  # committed: put_many returned
        i += 1
    """
)


def test_a_writer_killed_mid_write_leaves_a_sound_file_with_every_commit(tmp_path):
    path = tmp_path / "responses.sqlite3"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], cwd=root, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": root},
    )
    committed = []
    try:
        while len(committed) < 60:  # several WAL checkpoints' worth (~80 KB compressed a put)
            line = child.stdout.readline()
            assert line, "the writer ended early"
            committed.append(line.strip())
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
        committed += [line.strip() for line in child.stdout]  # reported before it died
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()

    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    db = ResponseDatabase(path)
    for rid in committed:
        stored = db.get(rid, "owner")
        assert stored is not None, rid
        i = int(rid.removeprefix("resp_"))
        assert stored.body == {"id": rid, "n": i}
        assert stored.conversation[7]["content"].startswith(f"turn {i}.7 ")
    count, _ = db.usage()
    assert count in (len(committed), len(committed) + 1)  # perhaps one committed, not yet reported
    db.close()
