"""The Responses API's stored responses on disk: one SQLite file, bounded by bytes and by age.

Receives finished responses (``Entry``: the id, the owner that made it, when,
and the ``StoredResponse``: the body and the conversation that led to it) and
gives each back by id to its owner only: another owner's id reads as
unknown. The owner is an opaque string (``api.auth.owner_of``: a hash of the
API key, never the key).

Owns the file: its schema (a ``schema_version`` table and ``responses``,
created on first open; a file of another version is refused, not altered),
its durability and its bounds.

* Durability: WAL journal with ``synchronous=NORMAL``. A commit is in the
  WAL (the operating system's copy of it) before ``put_many`` returns, so a
  process killed at any point (``kill -9``) loses no committed entry and
  leaves no corruption: the next open replays or ignores the WAL's
  uncommitted tail. Only a crash of the machine itself may lose the last
  commits (never the file's consistency); FULL would fsync every commit, a
  disk flush per response, for data a client can always send again.
* Bounds: an entry older than ``max_age`` seconds (since it was made) is
  never returned, and is deleted at every write, get and delete; when the
  stored bytes (the compressed body and conversation: what the file holds)
  pass ``max_bytes``, the least recently used (made or read) are deleted
  until they fit. Freed pages go back to the file system
  (``auto_vacuum=INCREMENTAL``), and the WAL is truncated after checkpoints
  (``journal_size_limit``).

Synchronous, one connection (``check_same_thread=False``): not thread-safe,
a caller uses it from one thread at a time (``api.agents.responses_store``
runs each call on a worker thread behind a ``CapacityLimiter(1)``). Several
processes may share a file (SQLite's locks; a busy file is waited for up to
``BUSY_SECONDS``). Every failure is a ``StoreError`` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sqlite3
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MEMORY = ":memory:"  # the path of a store kept in memory only (SQLite's name for it)
FILE_NAME = "responses.sqlite3"
BUSY_SECONDS = 10.0  # how long a call waits for another process's write to end
WAL_SIZE_LIMIT = 64 * 2**20  # the WAL is truncated back to this after a checkpoint

SCHEMA = (
    """CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        created_at REAL NOT NULL,
        used_at REAL NOT NULL,
        size INTEGER NOT NULL,
        body BLOB NOT NULL,
        conversation BLOB NOT NULL
    )""",
    "CREATE INDEX responses_by_use ON responses (used_at)",
    "CREATE INDEX responses_by_age ON responses (created_at)",
)


def default_path(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_DATA_HOME/mlx-trio-server/responses.sqlite3`` (``~/.local/share/...`` by default)."""
    base = environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "mlx-trio-server" / FILE_NAME


class StoreError(Exception):
    """The file cannot be opened, or used, as a store of responses."""


@attrs.frozen(kw_only=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET returns it
    conversation: tuple[dict[str, Any], ...]  # chat messages through this response, no instructions


@attrs.frozen(kw_only=True)
class Entry:
    """A response to store: whose it is and when it was made."""

    response_id: str
    owner: str
    created_at: float  # seconds, the database's clock
    response: StoredResponse


def _pack(value: Any) -> bytes:
    # Compressed JSON: a coding agent's conversation runs to hundreds of KB and
    # every response of a session stores it whole, so it compresses well.
    return zlib.compress(json.dumps(value, separators=(",", ":")).encode(), 6)


def _unpack(blob: bytes) -> Any:
    return json.loads(zlib.decompress(blob))


class ResponseDatabase:
    """Stored responses in one SQLite file (or in memory: ``MEMORY``)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        max_bytes: int | None = None,
        max_age: float | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.path = str(path)
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.clock = clock
        self._conn: sqlite3.Connection | None = None

    def in_memory(self) -> ResponseDatabase:
        """The same bounds and clock, in memory (not opened)."""
        return ResponseDatabase(
            MEMORY, max_bytes=self.max_bytes, max_age=self.max_age, clock=self.clock
        )

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    # ------------------------------------------------------------ open, close

    def open(self) -> None:
        """Open the file (made with its folder when missing, readable by this user only)."""
        if self._conn is not None:
            return
        conn = None
        try:
            if self.path != MEMORY:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                # Created here, not by SQLite, for its mode: conversations are private.
                # SQLite gives its -wal and -shm files the database file's mode.
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            conn = sqlite3.connect(
                self.path, timeout=BUSY_SECONDS, isolation_level=None, check_same_thread=False
            )
            # auto_vacuum takes effect only in a file that has no table yet (a new one).
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
            conn.execute("PRAGMA journal_mode = WAL")  # "memory" for MEMORY: nothing to journal
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
            self._create_schema(conn)
        except (OSError, sqlite3.Error, StoreError) as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"{self.path}: {exc}") from exc
        self._conn = conn

    def _create_schema(self, conn: sqlite3.Connection) -> None:
        with self._transaction(conn):
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            (version,) = conn.execute("SELECT max(version) FROM schema_version").fetchone()
            if version is None:
                for statement in SCHEMA:
                    conn.execute(statement)
                conn.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
            elif version != SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: schema version {version}, but this server reads version "
                    f"{SCHEMA_VERSION}: move the file away (or use another path)"
                )

    def close(self) -> None:
        """Close the file (checkpointing the WAL into it). Idempotent."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    # ---------------------------------------------------------------- calls

    def put_many(self, entries: Iterable[Entry]) -> None:
        """Store the entries (an id already stored is replaced), then apply the bounds.

        An entry larger than the byte limit by itself is not stored (it would push
        every other out, then go itself)."""
        rows, too_large = [], []
        for e in entries:
            body, conversation = _pack(e.response.body), _pack(list(e.response.conversation))
            size = len(body) + len(conversation)
            if self.max_bytes is not None and size > self.max_bytes:
                too_large.append(f"{e.response_id} ({size} bytes)")
                continue
            used_at = e.created_at  # made is the first use
            rows.append((e.response_id, e.owner, e.created_at, used_at, size, body, conversation))
        if too_large:
            log.warning(
                "not stored, larger than the store's byte limit (%d): %s",
                self.max_bytes, ", ".join(too_large),
            )
        with self._transaction() as conn:
            conn.executemany(
                "INSERT OR REPLACE INTO responses "
                "(id, owner, created_at, used_at, size, body, conversation) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            self._expire(conn)
            evicted = self._evict(conn)
        if evicted:
            self._release_pages()

    def put(self, entry: Entry) -> None:
        self.put_many([entry])

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The owner's stored response (now the most recently used), or None."""
        with self._transaction() as conn:
            self._expire(conn)
            row = conn.execute(
                "SELECT body, conversation FROM responses WHERE id = ? AND owner = ?",
                (response_id, owner),
            ).fetchone()
            if row is None:
                return None
            conn.execute(
                "UPDATE responses SET used_at = ? WHERE id = ?", (self.clock(), response_id)
            )
        try:
            return StoredResponse(body=_unpack(row[0]), conversation=tuple(_unpack(row[1])))
        except (zlib.error, ValueError) as exc:
            raise StoreError(f"{self.path}: response {response_id!r} is unreadable: {exc}") from exc

    def delete(self, response_id: str, owner: str) -> bool:
        """Remove the owner's stored response; whether there was one."""
        with self._transaction() as conn:
            self._expire(conn)
            deleted = conn.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
            ).rowcount
        if deleted:
            self._release_pages()
        return deleted > 0

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) stored now."""
        with self._transaction() as conn:
            count, size = conn.execute("SELECT count(*), total(size) FROM responses").fetchone()
        return count, int(size)

    def expired(self, created_at: float) -> bool:
        return created_at < self._oldest()

    # ------------------------------------------------------------- inside

    def _oldest(self) -> float:
        """The creation time below which an entry has expired."""
        return -math.inf if self.max_age is None else self.clock() - self.max_age

    def _expire(self, conn: sqlite3.Connection) -> None:
        if self.max_age is not None:
            conn.execute("DELETE FROM responses WHERE created_at < ?", (self._oldest(),))

    def _evict(self, conn: sqlite3.Connection) -> int:
        """Delete the least recently used until the stored bytes fit; how many."""
        if self.max_bytes is None:
            return 0
        (total,) = conn.execute("SELECT total(size) FROM responses").fetchone()
        if total <= self.max_bytes:
            return 0
        # Newest use first, the bytes of each entry and all newer ones: an entry whose
        # running total passes the limit goes, and so does every older one.
        rows = conn.execute(
            "SELECT id FROM (SELECT id, sum(size) OVER (ORDER BY used_at DESC, rowid DESC) AS kept"
            " FROM responses) WHERE kept > ?",
            (self.max_bytes,),
        ).fetchall()
        conn.executemany("DELETE FROM responses WHERE id = ?", rows)
        return len(rows)

    def _release_pages(self) -> None:
        """Give freed pages back to the file system (fetched: each row frees a page)."""
        with contextlib.suppress(sqlite3.Error):
            self._connection().execute("PRAGMA incremental_vacuum").fetchall()

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self.open()
        assert self._conn is not None
        return self._conn

    @contextlib.contextmanager
    def _transaction(self, conn: sqlite3.Connection | None = None) -> Iterator[sqlite3.Connection]:
        """One write transaction (taken at once: no upgrade from a read lock to deadlock on)."""
        conn = conn or self._connection()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: {exc}") from exc
