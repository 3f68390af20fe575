"""The Responses API's stored responses (``store: true``, the default), off the event loop.

Receives each finished response from ``ResponsesRenderer`` (``put``: its id,
its owner, ``api.auth.request_owner``, and the ``StoredResponse``: the body
and the conversation that led to it, without the instructions); gives it
back by id to the same owner for ``previous_response_id`` and for ``GET`` /
``DELETE /v1/responses/{id}`` (``api.agents.responses_routes``). Another
owner's id reads as unknown (``None`` / ``False``).

Keeps the responses in a ``ResponseDatabase`` (``api.agents.responses_db``:
SQLite at ``--responses-store-path``, bounded by ``--responses-store-bytes``
and ``--responses-store-max-age``). Every database call runs on a worker
thread, one at a time (``trio.to_thread.run_sync`` with a
``CapacityLimiter(1)``: the one connection is used by one thread at a time),
never on the event loop.

``put`` is synchronous (the renderer's last frame calls it) and writes
behind: the entry waits in memory, where ``get`` finds it at once, until the
writer (``run``, a task in the app's nursery) has committed it; a write and a
delete never interleave (a ``trio.Lock``), so a deleted response does not
come back. A file given by path that cannot be opened stops the start
(``from_config``: ``SystemExit``); at the default path the store warns and
keeps the responses in memory (``run`` opens the file). ``aclose`` (at
shutdown) stops the writer, then writes what still waits and closes the
file, synchronously.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import trio

from api.agents.responses_db import Entry, ResponseDatabase, StoreError, default_path
from api.agents.responses_db import StoredResponse as StoredResponse  # what callers store
from runtime.config import ServerConfig, flag
from runtime.errors import ServerError

log = logging.getLogger(__name__)


class ResponseStore:
    """Finished responses by id and owner: a SQLite file behind a write-behind buffer."""

    def __init__(self, db: ResponseDatabase, *, fall_back_to_memory: bool = False):
        self.db = db
        self._fall_back_to_memory = fall_back_to_memory
        self._limiter = trio.CapacityLimiter(1)
        self._lock = trio.Lock()  # held by a write of the waiting entries and by a delete
        self._waiting: dict[str, Entry] = {}  # put, not yet committed
        self._wake = trio.Event()
        self._writer: trio.CancelScope | None = None
        self._writer_done = trio.Event()

    @classmethod
    def from_config(
        cls, config: ServerConfig, *, clock: Callable[[], float] = time.time
    ) -> ResponseStore:
        """The store the settings describe; ``SystemExit`` naming the file when a path
        given cannot be opened (tried now, so that the start stops before anything loads)."""
        path = config.responses_store_path
        db = ResponseDatabase(
            path or default_path(),
            max_bytes=config.responses_store_bytes,
            max_age=config.responses_store_max_age,
            clock=clock,
        )
        if path is not None:
            try:
                db.open()
            except StoreError as exc:
                raise SystemExit(f"mlx-trio-server: {flag('responses_store_path')} {exc}") from None
            db.close()  # opened again by ``run``, when the app serves
        return cls(db, fall_back_to_memory=path is None)

    # ------------------------------------------------------------ the calls

    def put(self, response_id: str, owner: str, response: StoredResponse) -> None:
        """Keep a finished response (written behind; readable at once)."""
        self._waiting[response_id] = Entry(
            response_id=response_id, owner=owner, created_at=self.db.clock(), response=response
        )
        self._wake.set()

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        entry = self._waiting.get(response_id)
        if entry is not None:
            if entry.owner != owner or self.db.expired(entry.created_at):
                return None
            return entry.response
        return await self._call(self.db.get, response_id, owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        async with self._lock:
            entry = self._waiting.get(response_id)
            waiting = entry is not None and entry.owner == owner
            if waiting:
                del self._waiting[response_id]
            stored = await self._call(self.db.delete, response_id, owner)
            return waiting or stored

    async def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return await trio.to_thread.run_sync(method, *args, limiter=self._limiter)
        except StoreError as exc:
            log.error("the response store failed: %s", exc)
            raise ServerError("the response store failed; see the server's log") from exc

    # --------------------------------------------------------- the writer

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Open the file, then commit what ``put`` leaves, until ``aclose``."""
        try:
            with trio.CancelScope() as self._writer:
                await self._open()
                task_status.started()
                while True:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    await self._write_waiting()
        finally:
            self._writer_done.set()

    async def _open(self) -> None:
        try:
            await trio.to_thread.run_sync(self.db.open, limiter=self._limiter)
        except StoreError as exc:
            if not self._fall_back_to_memory:
                raise StoreError(f"{flag('responses_store_path')} {exc}") from None
            log.warning(
                "stored responses are kept in memory only, lost on restart (set %s): %s",
                flag("responses_store_path"), exc,
            )
            self.db = self.db.in_memory()
            await trio.to_thread.run_sync(self.db.open, limiter=self._limiter)
        count, size = await trio.to_thread.run_sync(self.db.usage, limiter=self._limiter)
        log.info("stored responses: %s (%d, %d bytes)", self.db.path, count, size)

    async def _write_waiting(self) -> None:
        async with self._lock:
            batch = list(self._waiting.values())
            if not batch:
                return
            try:
                await trio.to_thread.run_sync(self.db.put_many, batch, limiter=self._limiter)
            except StoreError as exc:
                # The responses were answered; only their later use is lost.
                log.error("%d response(s) not stored: %s", len(batch), exc)
            for entry in batch:  # committed (or lost): readable from the file from now on
                if self._waiting.get(entry.response_id) is entry:
                    del self._waiting[entry.response_id]

    async def aclose(self) -> None:
        """Stop the writer (its write in progress ends first), then ``close``."""
        if self._writer is not None:
            self._writer.cancel()
            await self._writer_done.wait()
        self.close()

    def close(self) -> None:
        """Write what still waits and close the file; synchronous (at shutdown, nothing
        else uses the database)."""
        if self._waiting and self.db.is_open:
            try:
                self.db.put_many(list(self._waiting.values()))
            except StoreError as exc:
                log.error("%d response(s) not stored at shutdown: %s", len(self._waiting), exc)
        self._waiting.clear()
        self.db.close()
