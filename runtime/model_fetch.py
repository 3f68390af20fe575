"""Getting the served model onto this machine before the server starts.

``fetch_served_model(config)`` runs once at start-up (``mlx-trio-server``
and ``hypercorn api:app`` alike, before the engine starts): a local
directory must hold a ``config.json``; a Hugging Face repository id is
taken from the local cache when it is complete there, and otherwise
downloaded, with a log line saying what is downloaded, how big it is and
where it goes (a progress bar only when stderr is a terminal). When the
model can be had neither way, it raises ``ModelUnavailable`` with a message
saying what was looked for, where, and how to fetch it, and the server exits
non-zero instead of answering 503 for ever.

Only the served model is fetched: a request naming another model never
starts a download (``runtime.models.locate``). The files are the ones
mlx-lm's own loader downloads (``mlx_lm.utils.DEFAULT_ALLOW_PATTERNS``), so
its ``load`` later finds them all in the cache.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from runtime.config import ServerConfig, flag

log = logging.getLogger(__name__)


class ModelUnavailable(RuntimeError):
    """The served model is neither on this machine nor downloadable; the message says why."""


def fetch_served_model(config: ServerConfig) -> None:
    """Make sure ``--model`` can be loaded from this machine (download it if need be)."""
    if not config.model:
        return  # the embedded demo model (or the tiny one, built on first use)
    name = config.model
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelUnavailable(
                f"{flag('model')} {name!r}: the directory {path.resolve()} has no config.json, "
                "so it is not a model directory"
            )
        return
    if not _looks_like_repo_id(name):
        raise ModelUnavailable(
            f"{flag('model')} {name!r}: there is no such directory ({path.resolve()}), and it is "
            "not a Hugging Face repository id (owner/name)"
        )
    if _cached(name):
        return
    _download(name)


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~", "/"))


def _patterns() -> list[str]:
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return list(DEFAULT_ALLOW_PATTERNS)


def _cached(repo: str) -> bool:
    return cached_snapshot(repo) is not None


def cached_snapshot(name: str) -> str | None:
    """The local cache's complete snapshot directory of repository ``name``, or None.

    The server loads a fetched model from there: no Hub request (nor progress
    bar) at each start, and a cached model loads offline."""
    if Path(name).expanduser().exists() or not _looks_like_repo_id(name):
        return None
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, local_files_only=True, allow_patterns=_patterns())
    except Exception:  # not there, or incomplete
        return None


def _download(repo: str) -> None:
    from huggingface_hub import constants
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    quiet = not sys.stderr.isatty()  # a progress bar only on a terminal
    was_disabled = are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    try:
        _download_files(repo, constants.HF_HUB_CACHE)
    finally:
        if quiet and not was_disabled:
            enable_progress_bars()


def _download_files(repo: str, cache: str) -> None:
    from huggingface_hub import snapshot_download

    try:
        plan = snapshot_download(repo, allow_patterns=_patterns(), dry_run=True)
    except Exception as exc:
        raise ModelUnavailable(_not_found(repo, cache, exc)) from None
    missing = [f for f in plan if f.will_download]
    if not missing:
        return
    size = sum(f.file_size or 0 for f in missing)
    log.info(
        "downloading %s from the Hugging Face Hub: %d files, %s, into %s (first use; "
        "later starts take it from there)",
        repo,
        len(missing),
        _human(size),
        cache,
    )
    try:
        snapshot_download(repo, allow_patterns=_patterns())
    except Exception as exc:
        raise ModelUnavailable(_not_found(repo, cache, exc, started=True)) from None
    log.info("downloaded %s (%s)", repo, _human(size))


def _not_found(repo: str, cache: str, exc: BaseException, *, started: bool = False) -> str:
    cause = exc.__cause__ or exc  # a dry run's error wraps the Hub's
    text = str(cause).strip().splitlines()
    why = f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        why = "HF_HUB_OFFLINE is set"
    where = (
        f"the download from the Hugging Face Hub failed ({why})"
        if started
        else f"it could not be downloaded from the Hugging Face Hub ({why})"
    )
    return (
        f"the model {repo!r} was not found: there is no directory {repo!r} here "
        f"({Path(repo).resolve()}), it is not (completely) in the Hugging Face cache ({cache}), "
        f"and {where}. To fetch it, run `hf download {repo}` (older huggingface_hub: "
        f"`huggingface-cli download {repo}`) on a machine with network access and copy its "
        "cache directory here (or point HF_HOME at it), or pass "
        f"{flag('model')} /path/to/a/local/model/directory"
    )


def _human(size: int) -> str:
    for unit in ("bytes", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.1f} {unit}" if unit != "bytes" else f"{size} bytes"
        size /= 1000
    return f"{size:.1f} GB"
