"""The prompt cache's disk tier: KV cache entries kept in a folder, across restarts.

Owns one folder (``--prompt-cache-dir``): the index of the entries in it
(rebuilt from the folder when an engine starts), a writer thread and a reader
thread. Receives, on the engine thread, entries to keep (``keep``; ``write_now``
as the engine stops) and lookups (``longest``, over entries indexed by their
first ``HEAD_TOKENS``); the reader reads a chosen entry's file into host arrays
(``load`` returns a ``Future``), and ``as_cache`` makes those a KV cache again,
on the engine thread. What goes to disk, and when an entry is worth loading,
is the engine's decision (``runtime.engine.disk_tier``).

Files: ``<name>.kv`` (the arrays, raw, one after another) and ``<name>.json``
(the format, the key digest, the tokens, each array's dtype, shape and size).
Both are written under a temporary name and renamed into place, the json
last, so a name with a json is a whole entry; leftovers are removed at start.
Files are readable by their owner only: they hold prompts.
The key digest hashes the model's fingerprint (``model_fingerprint``: its
files' names, sizes and modification times) with the request's prompt-cache
scope, so an entry made by other weights or in another scope is never served.
The json's modification time is the entry's last use; past ``max_bytes`` the
least recently used entries go.

Threads: MLX is called on the engine thread only. ``keep`` takes each array's
buffer there (a ``memoryview`` keeps the array alive); the writer thread only
writes those bytes, and the reader only reads bytes into numpy arrays. The
writer's queue is bounded (``WRITE_QUEUE``): an entry that finds it full is not
written (``write_skips``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

log = logging.getLogger(__name__)

FORMAT = 1
WRITE_QUEUE = 4  # entries waiting for the writer; more are not written
# Entries are indexed by their first this many tokens: a lookup compares only those
# that share them with the prompt (and the shorter ones), not the whole folder.
HEAD_TOKENS = 32
CLOSE_WAIT_SECONDS = 4.0  # how long closing waits for the entries queued to be written
# Files whose names say they are a model's weights, configuration or tokenizer.
MODEL_FILE_SUFFIXES = (".safetensors", ".json", ".gguf", ".model", ".bin", ".tiktoken")


def model_fingerprint(model_path: str, adapter_path: str | None = None) -> str | None:
    """A digest of the model's local files (names, sizes, modification times) and its
    path; None where the files cannot be found (the disk tier is then off)."""
    parts = [f"model:{model_path}"]
    for label, path in (("model", model_path), ("adapter", adapter_path)):
        if path is None:
            continue
        folder = _local_folder(path)
        if folder is None:
            return None
        for file in sorted(folder.iterdir()):
            if file.suffix in MODEL_FILE_SUFFIXES and file.is_file():
                stat = file.stat()
                parts.append(f"{label}:{file.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _local_folder(path: str) -> Path | None:
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    try:  # a Hugging Face repository id: its snapshot, as loading found it
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, local_files_only=True))
    except Exception:
        return None


@attrs.define(eq=False)
class DiskEntry:
    """One entry in the folder."""

    name: str
    digest: str  # the model's fingerprint with the prompt-cache scope
    tokens: np.ndarray  # int32
    layers: int
    cache_type: str  # its segment type in the prompt cache: "system", "user", "assistant"
    arrays: list[tuple[str, tuple[int, ...], int]]  # (dtype, shape, bytes), in file order
    nbytes: int
    last_used: float

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class DiskPromptCache:
    """The folder, its index, and the threads that write and read its entries.

    ``fingerprint``: ``model_fingerprint`` of the engine's model; ``max_bytes``:
    the most the folder's entries may take."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int, fingerprint: str):
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self._lock = threading.Lock()
        self._entries: dict[str, DiskEntry] = {}
        self._by_head: dict[tuple, set[str]] = {}  # (digest, first HEAD_TOKENS) -> names
        self._bytes = 0  # of the entries indexed
        self._writing: set[str] = set()
        self.writes = 0  # entries written
        self.write_skips = 0  # entries not written: the writer's queue was full
        self.write_failures = 0
        self.removed = 0  # entries removed to stay within max_bytes
        self._scan()
        self._trim()
        self._jobs: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE)
        self._writer = threading.Thread(
            target=self._write_loop, name="prompt-cache-writer", daemon=True
        )
        self._writer.start()
        self._reader = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="prompt-cache-reader"
        )

    # ----------------------------------------------------------- the index

    def digest(self, scope: str) -> str:
        return hashlib.sha256(f"{self.fingerprint}\0{scope}".encode()).hexdigest()[:32]

    def _name(self, digest: str, tokens: np.ndarray) -> str:
        return hashlib.sha256(digest.encode() + tokens.tobytes()).hexdigest()[:32]

    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def longest(self, scope: str, tokens: Sequence[int]) -> tuple[DiskEntry, int] | None:
        """The entry of this model and scope that shares the most leading tokens with
        ``tokens`` (of those, the shortest: the least to read), and how many it shares;
        None if none shares any. Only entries that share their first ``HEAD_TOKENS``
        with ``tokens`` (or are shorter) are compared."""
        digest = self.digest(scope)
        prompt = np.asarray(tokens, dtype=np.int32)
        with self._lock:
            names = self._by_head.get(_head(digest, prompt), set()) | self._by_head.get(
                (digest, None), set())
            candidates = [self._entries[name] for name in names]
        best: tuple[DiskEntry, int] | None = None
        for entry in candidates:
            m = min(entry.n_tokens, len(prompt))
            differ = np.flatnonzero(entry.tokens[:m] != prompt[:m])
            shared = int(differ[0]) if differ.size else m
            if shared and (best is None or (shared, -entry.n_tokens)
                           > (best[1], -best[0].n_tokens)):
                best = (entry, shared)
        return best

    def holds(self, scope: str, tokens: Sequence[int]) -> bool:
        """Whether an entry of exactly these tokens is kept or being written."""
        name = self._name(self.digest(scope), np.asarray(tokens, dtype=np.int32))
        with self._lock:
            return name in self._entries or name in self._writing

    # ------------------------------------------------------------ writing

    def keep(self, scope: str, tokens: Sequence[int], spans: list[list[tuple[Any, Any]]], *,
             cache_type: str = "system") -> bool:
        """Queue an entry for writing (engine thread): ``spans``, each a list of every
        layer's (keys, values) MLX arrays (batch 1, contiguous) for a run of the tokens,
        in order; ``cache_type``: its segment type in the prompt cache. Returns whether
        it was queued (not when it is kept already or the queue is full)."""
        job = self._job(scope, tokens, spans, cache_type)
        if job is None:
            return False
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            with self._lock:
                self._writing.discard(job[0])
            self.write_skips += 1
            return False
        return True

    def write_now(self, scope: str, tokens: Sequence[int], spans: list[list[tuple[Any, Any]]],
                  *, cache_type: str) -> bool:
        """Write an entry on the calling thread (the engine's, as it stops); as ``keep``,
        whether it was written."""
        job = self._job(scope, tokens, spans, cache_type)
        if job is None:
            return False
        try:
            self._write(*job)
        except OSError as exc:
            self.write_failures += 1
            log.warning("could not write a prompt-cache entry to %s: %s", self.folder, exc)
            return False
        finally:
            with self._lock:
                self._writing.discard(job[0])
        return True

    def _job(self, scope: str, tokens: Sequence[int], spans: list[list[tuple[Any, Any]]],
             cache_type: str) -> tuple[str, dict, list[memoryview]] | None:
        """(name, index, buffers) of an entry to write, marked as being written; None when
        it is kept already (its last use is now) or being written."""
        digest = self.digest(scope)
        token_array = np.asarray(tokens, dtype=np.int32)
        name = self._name(digest, token_array)
        with self._lock:
            kept = self._entries.get(name)
            if kept is not None or name in self._writing:
                if kept is not None:
                    kept.last_used = time.time()
                return None
        arrays = [a for span in spans for pair in span for a in pair]
        views = [memoryview(a) for a in arrays]  # evaluates them; each view keeps its array
        if not all(v.c_contiguous for v in views):
            return None
        meta = {
            "format": FORMAT,
            "digest": digest,
            "tokens": token_array.tolist(),
            "layers": len(spans[0]),
            "cache_type": cache_type,
            "arrays": [[str(a.dtype).rsplit(".", 1)[-1], list(a.shape), v.nbytes]
                       for a, v in zip(arrays, views, strict=True)],
        }
        with self._lock:
            self._writing.add(name)
        return name, meta, views

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            name = job[0]
            try:
                self._write(*job)
            except OSError as exc:
                self.write_failures += 1
                log.warning("could not write a prompt-cache entry to %s: %s", self.folder, exc)
            finally:
                with self._lock:
                    self._writing.discard(name)

    def _write(self, name: str, meta: dict, views: list[memoryview]) -> None:
        kv, tmp = self.folder / f"{name}.kv", self.folder / f".{name}.{os.getpid()}.kv.tmp"
        try:
            with _private(tmp) as out:
                for view in views:
                    out.write(view)
            os.replace(tmp, kv)
            nbytes = sum(v.nbytes for v in views)
            meta["nbytes"] = nbytes
            _write_json(self.folder / f"{name}.json", meta)
        finally:
            tmp.unlink(missing_ok=True)
        views.clear()  # the arrays may go
        entry = _entry(name, meta, time.time())
        with self._lock:
            self._add(entry)
        self.writes += 1
        self._trim()

    def _trim(self) -> None:
        """Remove the least recently used entries until the folder is within max_bytes."""
        with self._lock:
            victims = []
            if self._bytes > self.max_bytes:
                for entry in sorted(self._entries.values(), key=lambda e: e.last_used):
                    if self._bytes <= self.max_bytes:
                        break
                    victims.append(entry)
                    self._drop(entry)
        for entry in victims:
            self._remove_files(entry.name)
            self.removed += 1

    # ------------------------------------------------------------ reading

    def load(self, entry: DiskEntry) -> concurrent.futures.Future:
        """Read ``entry``'s arrays on the reader thread: a Future of numpy byte arrays."""
        return self._reader.submit(self._read, entry)

    def _read(self, entry: DiskEntry) -> list[np.ndarray]:
        arrays = []
        with open(self.folder / f"{entry.name}.kv", "rb") as source:
            for _, _, nbytes in entry.arrays:  # one after another, in file order
                data = np.fromfile(source, dtype=np.uint8, count=nbytes)
                if data.size != nbytes:
                    raise OSError(f"{entry.name}.kv is shorter than its index says")
                arrays.append(data)
        entry.last_used = time.time()
        try:
            os.utime(self.folder / f"{entry.name}.json")
        except OSError:
            pass
        return arrays

    @staticmethod
    def as_cache(entry: DiskEntry, arrays: list[np.ndarray]) -> list:
        """``entry``'s KV cache from its ``load``ed bytes: one ``KVCache`` a layer (engine
        thread). Each host array is let go once copied, so ``arrays`` is emptied."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        if len(arrays) != len(entry.arrays):
            raise ValueError(f"{entry.name}: {len(arrays)} arrays read, {len(entry.arrays)} indexed")
        made = []
        for i, (dtype, shape, _) in enumerate(entry.arrays):
            made.append(mx.array(arrays[i]).view(getattr(mx, dtype)).reshape(shape))
            arrays[i] = None  # the copy is MLX's now: at most one array held twice
        arrays.clear()
        per_span = 2 * entry.layers
        spans = [made[i : i + per_span] for i in range(0, len(made), per_span)]
        cache = []
        for layer in range(entry.layers):
            keys = [span[2 * layer] for span in spans]
            values = [span[2 * layer + 1] for span in spans]
            kv = KVCache()
            kv.keys = keys[0] if len(keys) == 1 else mx.concatenate(keys, axis=2)
            kv.values = values[0] if len(values) == 1 else mx.concatenate(values, axis=2)
            kv.offset = entry.n_tokens
            cache.append(kv)
        return cache

    def forget(self, entry: DiskEntry) -> None:
        """Remove an entry that could not be read."""
        with self._lock:
            if entry.name in self._entries:
                self._drop(entry)
        self._remove_files(entry.name)

    def _add(self, entry: DiskEntry) -> None:
        """Index ``entry`` (the lock held)."""
        self._entries[entry.name] = entry
        self._by_head.setdefault(_head(entry.digest, entry.tokens), set()).add(entry.name)
        self._bytes += entry.nbytes

    def _drop(self, entry: DiskEntry) -> None:
        """Forget ``entry`` (the lock held)."""
        del self._entries[entry.name]
        head = _head(entry.digest, entry.tokens)
        names = self._by_head[head]
        names.discard(entry.name)
        if not names:
            del self._by_head[head]
        self._bytes -= entry.nbytes

    # ------------------------------------------------------------ the rest

    def _scan(self) -> None:
        """Index the whole entries in the folder; remove partial ones."""
        indexed = set()
        for path in self.folder.glob("*.json"):
            name = path.stem
            try:
                meta = json.loads(path.read_text())
                kv_size = (self.folder / f"{name}.kv").stat().st_size
                if meta.get("format") != FORMAT or kv_size != meta["nbytes"]:
                    raise ValueError("another format, or an incomplete file")
                self._add(_entry(name, meta, path.stat().st_mtime))
                indexed.add(name)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.info("removing prompt-cache entry %s from %s: %s", name, self.folder, exc)
                self._remove_files(name)
        for path in self.folder.iterdir():
            if path.name.endswith(".tmp") or (path.suffix == ".kv" and path.stem not in indexed):
                path.unlink(missing_ok=True)
        if self._entries:
            log.info("prompt cache on disk: %d entries, %.1f MB in %s", len(self._entries),
                     self._bytes / 1e6, self.folder)

    def _remove_files(self, name: str) -> None:
        for suffix in (".json", ".kv"):  # the json first: without it the entry is not whole
            try:
                (self.folder / f"{name}{suffix}").unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not remove %s%s from %s: %s", name, suffix, self.folder, exc)

    def close(self) -> None:
        """Stop the threads once the entries queued are written, waiting at most
        ``CLOSE_WAIT_SECONDS`` (a file left half-written is removed at the next start)."""
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        try:
            self._jobs.put(None, timeout=CLOSE_WAIT_SECONDS)
            self._writer.join(max(0.0, deadline - time.monotonic()))
        except queue.Full:
            log.warning("the prompt cache's disk writer did not finish in %.0f s",
                        CLOSE_WAIT_SECONDS)
        self._reader.shutdown(wait=False, cancel_futures=True)


def _head(digest: str, tokens: np.ndarray) -> tuple:
    """The index key of tokens: their first ``HEAD_TOKENS`` (None for fewer)."""
    if len(tokens) < HEAD_TOKENS:
        return digest, None
    return digest, tokens[:HEAD_TOKENS].tobytes()


def _entry(name: str, meta: dict, last_used: float) -> DiskEntry:
    return DiskEntry(
        name=name,
        digest=str(meta["digest"]),
        tokens=np.asarray(meta["tokens"], dtype=np.int32),
        layers=int(meta["layers"]),
        cache_type=str(meta["cache_type"]),
        arrays=[(str(d), tuple(int(x) for x in s), int(n)) for d, s, n in meta["arrays"]],
        nbytes=int(meta["nbytes"]),
        last_used=last_used,
    )


def _write_json(path: Path, meta: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with _private(tmp) as out:
            out.write(json.dumps(meta, separators=(",", ":")).encode())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _private(path: Path):
    """``path`` opened for writing, readable by its owner only: it holds prompts."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
