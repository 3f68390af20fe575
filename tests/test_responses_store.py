"""Stored responses: the SQLite file, its bounds, the write-behind store, and the owner's scope.

No process of its own: ``ResponseDatabase`` on files under ``tmp_path`` with
an injected clock (the byte bound evicts the least recently used, the age
bound hides and deletes), the trio ``ResponseStore`` in front of it (readable
at once, written behind, off the event loop, flushed at close), and the app
with two API keys serving the tiny model in-process: a response is its key's,
another key gets the 404 / 400 of an unknown id. Across a restart and a
``kill -9``: ``tests/test_responses_store_server.py``.
"""

from __future__ import annotations

import random
import sqlite3
import stat
import threading

import pytest
import trio

from api.agents.responses_db import (
    MEMORY,
    SCHEMA_VERSION,
    Entry,
    ResponseDatabase,
    StoredResponse,
    StoreError,
    default_path,
)
from api.agents.responses_store import ResponseStore
from api.auth import ANONYMOUS, owner_of
from api.server import create_app
from runtime.config import ServerConfig
from runtime.errors import ServerError
from runtime.settings import parse_duration
from tests.conftest import poll_until, wait_ready


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def response(name: str, size: int = 0, *, seed: int = 0) -> StoredResponse:
    """A response whose conversation carries ``size`` characters that do not compress."""
    noise = random.Random(f"{name}/{seed}").randbytes(size // 2).hex()
    return StoredResponse(
        body={"id": name, "object": "response", "output": []},
        conversation=({"role": "user", "content": f"{name} {noise}"},),
    )


def entry(name: str, clock: Clock, size: int = 0, owner: str = "alice") -> Entry:
    return Entry(response_id=name, owner=owner, created_at=clock(), response=response(name, size))


# ------------------------------------------------------------ the database


def test_a_response_reads_back_to_its_owner_only(tmp_path):
    db = ResponseDatabase(tmp_path / "r.sqlite3")
    db.put(entry("resp_1", Clock(), 2000))
    assert db.get("resp_1", "alice") == response("resp_1", 2000)
    assert db.get("resp_1", "bob") is None and db.get("resp_2", "alice") is None
    assert not db.delete("resp_1", "bob")
    assert db.get("resp_1", "alice") is not None
    assert db.delete("resp_1", "alice") and not db.delete("resp_1", "alice")
    assert db.get("resp_1", "alice") is None
    db.close()


def test_over_the_byte_limit_the_least_recently_used_go_first(tmp_path):
    clock = Clock()
    scratch = ResponseDatabase(MEMORY)
    scratch.put(entry("size", clock, 4000))
    one = scratch.usage()[1]  # the stored (compressed) bytes of one such response
    db = ResponseDatabase(tmp_path / "r.sqlite3", max_bytes=int(3.5 * one), clock=clock)
    for name in ("a", "b", "c"):
        db.put(entry(name, clock, 4000))
        clock.now += 1
    assert db.usage()[0] == 3
    assert db.get("a", "alice") is not None  # used: now the most recent
    clock.now += 1
    db.put(entry("d", clock, 4000))  # over the limit: b, the least recently used, goes
    assert [n for n in "abcd" if db.get(n, "alice") is not None] == ["a", "c", "d"]
    count, size = db.usage()
    assert count == 3 and size <= db.max_bytes
    # A response larger than the whole limit is not kept, and pushes nothing else out.
    db.put(entry("huge", clock, 20000))
    assert db.get("huge", "alice") is None and db.usage()[0] == 3


def test_a_response_past_the_max_age_is_not_returned_and_is_deleted(tmp_path):
    clock = Clock()
    db = ResponseDatabase(tmp_path / "r.sqlite3", max_age=100.0, clock=clock)
    db.put(entry("old", clock))
    clock.now += 60
    db.put(entry("young", clock))
    clock.now += 39
    assert db.get("old", "alice") is not None  # 99 s old; reading it does not renew it
    clock.now += 2
    assert db.get("old", "alice") is None
    assert db.usage()[0] == 1  # deleted from the file, not only hidden
    assert db.get("young", "alice") is not None
    clock.now += 100
    db.put(entry("new", clock))  # a write drops what expired meanwhile
    assert db.usage()[0] == 1 and db.get("new", "alice") is not None


def test_the_file_is_wal_private_and_versioned(tmp_path):
    path = tmp_path / "data" / "mlx-trio-server" / "r.sqlite3"
    db = ResponseDatabase(path)
    db.open()  # the folders are made
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with sqlite3.connect(path) as other:
        assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert other.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        other.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    db.close()
    with pytest.raises(StoreError, match="schema version 2"):
        ResponseDatabase(path).open()
    garbage = tmp_path / "garbage.sqlite3"
    garbage.write_bytes(b"not a database, " * 100)
    with pytest.raises(StoreError, match="garbage.sqlite3"):
        ResponseDatabase(garbage).open()


def test_the_default_path_is_in_the_data_directory(monkeypatch):
    assert default_path({"XDG_DATA_HOME": "/data"}).as_posix() == (
        "/data/mlx-trio-server/responses.sqlite3"
    )
    monkeypatch.setenv("HOME", "/home/u")
    assert default_path({}).as_posix() == "/home/u/.local/share/mlx-trio-server/responses.sqlite3"


def test_durations_and_the_settings():
    assert [parse_duration(t) for t in ("30d", "12h", "90m", "45s", "3600", "1.5h")] == [
        2592000, 43200, 5400, 45, 3600, 5400
    ]
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("a week")
    config = ServerConfig()
    assert config.responses_store_path is None
    assert config.responses_store_bytes == 256 * 10**6
    assert config.responses_store_max_age == 30 * 86400


def test_the_owner_is_a_hash_of_the_key():
    assert owner_of(None) == ANONYMOUS
    assert owner_of("keyA").startswith("sha256:") and "keyA" not in owner_of("keyA")
    assert owner_of("keyA") != owner_of("keyB")


# ------------------------------------------------------------- the store


async def test_a_put_is_readable_at_once_then_written_behind(tmp_path):
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(ResponseDatabase(path))
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        store.put("resp_1", "alice", response("resp_1", 100))
        assert await store.get("resp_1", "alice") == response("resp_1", 100)  # not written yet
        assert await store.get("resp_1", "bob") is None
        await poll_until(lambda: not store._waiting)
        assert ResponseDatabase(path).get("resp_1", "alice") is not None  # in the file
        assert await store.get("resp_1", "alice") == response("resp_1", 100)
        store.put("resp_2", "alice", response("resp_2"))
        store.put("resp_3", "alice", response("resp_3"))
        assert await store.delete("resp_2", "alice")  # deleted while it waited
        assert not await store.delete("resp_3", "bob")
        await poll_until(lambda: not store._waiting)
        assert await store.get("resp_2", "alice") is None  # and it does not come back
        await store.aclose()
    reopened = ResponseDatabase(path)
    assert reopened.get("resp_2", "alice") is None and reopened.get("resp_3", "alice") is not None


async def test_closing_writes_what_still_waits(tmp_path):
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(ResponseDatabase(path))
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        for i in range(20):
            store.put(f"resp_{i}", "alice", response(f"resp_{i}", 1000))
        await store.aclose()  # at once: most of them still wait
    assert ResponseDatabase(path).usage()[0] == 20


async def test_the_database_is_used_off_the_event_loop_one_call_at_a_time(tmp_path):
    db = ResponseDatabase(tmp_path / "r.sqlite3")
    seen: list[tuple[str, int]] = []
    inside = 0
    get = db.get

    def watched_get(*args):
        nonlocal inside
        inside += 1
        seen.append((threading.current_thread().name, inside))
        try:
            return get(*args)
        finally:
            inside -= 1

    db.get = watched_get
    store = ResponseStore(db)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        async with trio.open_nursery() as readers:
            for i in range(8):
                readers.start_soon(store.get, f"resp_{i}", "alice")
        await store.aclose()
    assert len(seen) == 8
    assert all(name != threading.main_thread().name for name, _ in seen)
    assert max(depth for _, depth in seen) == 1


async def test_a_file_that_cannot_be_opened(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a path under a regular file cannot be made
    with pytest.raises(SystemExit, match="--responses-store-path .*a-file/r.sqlite3"):
        ResponseStore.from_config(ServerConfig(responses_store_path=str(blocker / "r.sqlite3")))
    # At the default path: a warning, and the responses are kept in memory.
    monkeypatch.setenv("XDG_DATA_HOME", str(blocker))
    default = ResponseStore.from_config(ServerConfig())
    async with trio.open_nursery() as nursery:
        await nursery.start(default.run)
        assert default.db.path == MEMORY
        default.put("resp_1", ANONYMOUS, response("resp_1"))
        await poll_until(lambda: not default._waiting)
        assert await default.get("resp_1", ANONYMOUS) is not None
        await default.aclose()
    assert "kept in memory only" in caplog.text


async def test_a_failing_file_is_a_500_for_the_request(tmp_path):
    db = ResponseDatabase(tmp_path / "r.sqlite3")
    store = ResponseStore(db)

    def broken(*args):
        raise StoreError("disk I/O error")

    db.get = broken
    with pytest.raises(ServerError) as info:
        await store.get("resp_1", "alice")
    assert info.value.status == 500


# -------------------------------------------------- through the app, two keys

KEY_A, KEY_B = {"Authorization": "Bearer keyA"}, {"x-api-key": "keyB"}


@pytest.fixture
async def two_keys(tiny_model_path, tmp_path):
    config = ServerConfig(model=tiny_model_path, max_tokens=4, api_key=("keyA", "keyB"),
                          responses_store_path=str(tmp_path / "r.sqlite3"))
    app = create_app(config)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        client.path = tmp_path / "r.sqlite3"
        yield client


async def _create(client, headers, **fields) -> dict:
    r = await client.post("/v1/responses", json={"input": "hello", **fields}, headers=headers)
    assert r.status_code == 200, await r.get_data(as_text=True)
    return await r.get_json()


async def test_another_key_gets_the_answers_of_an_unknown_id(two_keys):
    client = two_keys
    first = await _create(client, KEY_A)
    rid = first["id"]
    unknown = await client.post("/v1/responses", headers=KEY_B,
                                json={"input": "more", "previous_response_id": "resp_unknown"})
    for method in ("GET", "DELETE"):
        r = await client.open(f"/v1/responses/{rid}", method=method, headers=KEY_B)
        assert r.status_code == 404, method
        assert (await r.get_json())["error"]["message"] == f"response {rid!r} not found"
    r = await client.post("/v1/responses", headers=KEY_B,
                          json={"input": "more", "previous_response_id": rid})
    assert r.status_code == unknown.status_code == 400
    error, unknown_error = (await r.get_json())["error"], (await unknown.get_json())["error"]
    assert error["param"] == unknown_error["param"] == "previous_response_id"
    assert error["message"] == unknown_error["message"].replace("resp_unknown", rid)
    # Key A still has it, whole: B's DELETE removed nothing.
    r = await client.get(f"/v1/responses/{rid}", headers=KEY_A)
    assert r.status_code == 200 and await r.get_json() == first
    follow = await _create(client, KEY_A, previous_response_id=rid)
    assert follow["previous_response_id"] == rid
    r = await client.delete(f"/v1/responses/{rid}", headers=KEY_A)
    assert r.status_code == 200 and (await r.get_json())["deleted"] is True
    assert (await client.get(f"/v1/responses/{rid}", headers=KEY_A)).status_code == 404
    # Key B's own responses are B's.
    mine = await _create(client, KEY_B)
    assert (await client.get(f"/v1/responses/{mine['id']}", headers=KEY_B)).status_code == 200
    assert (await client.get(f"/v1/responses/{mine['id']}", headers=KEY_A)).status_code == 404


async def test_the_file_holds_a_hash_of_the_key_never_the_key(two_keys):
    client = two_keys
    created = await _create(client, KEY_A, store=True)
    not_stored = await _create(client, KEY_A, store=False)
    with trio.fail_after(10):  # written behind: wait for the commit
        while True:
            with sqlite3.connect(client.path) as conn:
                rows = conn.execute("SELECT id, owner FROM responses").fetchall()
            if rows:
                break
            await trio.sleep(0.02)
    assert rows == [(created["id"], owner_of("keyA"))]
    assert not_stored["id"] not in dict(rows)
    for name in ("r.sqlite3", "r.sqlite3-wal"):
        data = (client.path.parent / name).read_bytes()
        assert b"keyA" not in data and b"keyB" not in data
