"""Which model a request asks for, and whether it can be had without a download.

Also which model the server serves by default (``resolve_model``: the
configured one, else the embedded demo model), and ``EngineCoreFactory``, the
picklable recipe that builds mlx-lm's engine for a ``ModelKey`` on the
thread (or in the process) that will step it.

A ``ModelKey`` names a loadable combination: model path, LoRA adapter path,
draft model path. ``resolve_key`` maps a request's ``model`` / ``adapters`` /
``draft_model`` fields to one, the way mlx_lm.server does (``default_model``
and the served id or path mean the configured model), except that a request
can only name models that are already on this machine: a local directory, or
a repository in the local Hugging Face cache. A request never starts a
download; anything else is a 404 that names the model.

``ModelPolicy`` says which models a request may name at all (mlx-lm #1892:
a server should not load whatever path a client sends): by default only the
served model with its configured adapters and draft model; more with
``--allowed-models`` (names, paths, repos; ``*`` for anything on this machine)
or ``--models-dir`` (any model directory inside it). A name it refuses is a
404 before any disk or cache lookup for it. ``allowed_model_ids`` lists what
it allows (for ``GET /v1/models``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path

import attrs

from runtime.config import ServerConfig
from runtime.errors import NotFound
from runtime.model_fetch import cached_snapshot

log = logging.getLogger(__name__)

DEFAULT_ALIASES = ("default_model", "")
TINY_MODEL_ID = "mlx-trio-tiny-random"
DEMO_MODEL_ID = "mlx-trio-demo"


def demo_model_dir() -> Path:
    """The embedded demo model (``demo_model/mlx-trio-demo``, installed with the package)."""
    return Path(__file__).resolve().parents[1] / "demo_model" / DEMO_MODEL_ID


def default_model_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx-trio-server" / TINY_MODEL_ID


def resolve_model(config: ServerConfig) -> tuple[str, str]:
    """(model id served, path or repo to load).

    With no model configured: the embedded demo model, or, if this install
    lacks its weights, a tiny random model built on first use.
    """
    if config.model:
        # A Hugging Face repository fetched at start (runtime.model_fetch) loads
        # from its snapshot in the local cache, under the id the user gave.
        return config.model, cached_snapshot(config.model) or config.model
    demo = demo_model_dir()
    if (demo / "model.safetensors").exists():
        return DEMO_MODEL_ID, str(demo)
    return TINY_MODEL_ID, str(default_model_dir())


@attrs.frozen
class ModelKey:
    model: str
    adapter: str | None = None
    draft: str | None = None


def default_key(config: ServerConfig, served_path: str) -> ModelKey:
    return ModelKey(served_path, config.adapter_path, config.draft_model)


ANY_MODEL = "*"
MODELS_DIR_DEPTH = 2  # listing a models folder: ``name`` or ``org/name``


@attrs.frozen
class ModelPolicy:
    """Which models, adapters and draft models a request may name besides the served ones."""

    anything: bool = False  # ``*``: whatever is on this machine
    names: frozenset[str] = frozenset()  # entries as written (names, repos, paths)
    models_dir: Path | None = None  # resolved

    @classmethod
    def from_config(cls, config: ServerConfig) -> ModelPolicy:
        entries = set(config.allowed_models)
        folder = Path(config.models_dir).expanduser().resolve() if config.models_dir else None
        return cls(ANY_MODEL in entries, frozenset(entries - {ANY_MODEL}), folder)

    def allowed(self, name: str, *, param: str) -> str:
        """What to look up for ``name`` (``name`` itself, or its path inside the models
        folder); a 404 if the policy does not allow it. Only stats the disk."""
        if self.anything or name in self.names:
            return name
        try:
            path = Path(name).expanduser()
        except RuntimeError:  # ~user of no such user: no path of ours
            path = None
        if path is not None and self.models_dir is not None:
            inside = path if path.is_absolute() else self.models_dir / path
            if _within(inside, self.models_dir):
                return str(inside)
        if any(_same_path(name, entry) for entry in self.names):
            return name
        raise NotFound(
            f"{param} {name!r} is not served here (this server serves its own model and those "
            "its --allowed-models and --models-dir allow; see GET /v1/models)",
            param=param,
        )


def _within(path: Path, folder: Path) -> bool:
    """Whether ``path``, symbolic links resolved, is strictly inside ``folder``."""
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):
        return False
    return resolved != folder and resolved.is_relative_to(folder)


def allowed_model_ids(policy: ModelPolicy) -> list[str]:
    """The models ``policy`` names that are on this machine (blocking disk work): its
    entries that can be found, then the model directories of its models folder."""
    found = []
    for name in sorted(policy.names):
        try:
            locate(name, param="model")
        except NotFound:
            continue
        found.append(name)
    folder = policy.models_dir
    if folder is not None and folder.is_dir():
        level = [folder]
        for _ in range(MODELS_DIR_DEPTH):
            below = []
            for parent in level:
                try:
                    children = sorted(p for p in parent.iterdir() if p.is_dir())
                except OSError:
                    continue
                for child in children:
                    if (child / "config.json").exists():
                        found.append(child.relative_to(folder).as_posix())
                    else:
                        below.append(child)
            level = below
    return found


def names_served(config: ServerConfig, served_id: str, served_path: str, model: str | None) -> bool:
    """Does ``model`` name the served model by one of its aliases (no look on disk)?"""
    return model is None or model in {*DEFAULT_ALIASES, served_id, served_path, config.model}


def resolve_key(
    config: ServerConfig,
    served_id: str,
    served_path: str,
    *,
    model: str | None,
    adapters: str | None = None,
    draft_model: str | None = None,
    policy: ModelPolicy,
) -> ModelKey:
    """The ``ModelKey`` a request names; 404 if ``policy`` refuses a part of it or it is
    not on this machine."""
    default = default_key(config, served_path)
    if names_served(config, served_id, served_path, model) or _same_path(model, served_path):
        path = served_path
        adapter = adapters if adapters is not None else default.adapter
    else:
        path = locate(policy.allowed(model, param="model"), param="model")
        adapter = adapters
    if adapter is not None and adapter != default.adapter:
        if default.adapter is None or not _same_path(adapter, default.adapter):
            adapter = policy.allowed(adapter, param="adapters")
        adapter = str(locate(adapter, param="adapters", want="adapter_config.json"))
    draft = default.draft
    if draft_model is not None and draft_model not in DEFAULT_ALIASES:
        if draft_model != default.draft and not (
            default.draft is not None and _same_path(draft_model, default.draft)
        ):
            draft_model = policy.allowed(draft_model, param="draft_model")
        draft = locate(draft_model, param="draft_model")
    return ModelKey(path, adapter, draft)


def _same_path(a: str, b: str) -> bool:
    try:
        return os.path.exists(a) and Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError):  # too long for a file name; ~user of no such user
        return False


def locate(name: str, *, param: str, want: str = "config.json") -> str:
    """A local directory holding ``want``, or the local HF cache's snapshot of repo ``name``."""
    path = Path(name)
    try:
        path = path.expanduser()
        is_dir = path.is_dir()
    except (OSError, RuntimeError):  # too long for a file name; ~user of no such user
        is_dir = False
    if is_dir:
        if (path / want).exists():
            return str(path)
        raise NotFound(f"{param} {name!r}: the directory has no {want}", param=param)
    if "/" in name and not name.startswith(("/", ".")):
        try:
            from huggingface_hub import snapshot_download

            snapshot = snapshot_download(name, local_files_only=True)
        except Exception:
            snapshot = None
        if snapshot and (Path(snapshot) / want).exists():
            return snapshot
    raise NotFound(
        f"{param} {name!r} is not available on this server (not a local model directory "
        "nor in the local Hugging Face cache; requests never download models)",
        param=param,
    )


CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_seq_len",
    "max_sequence_length",
    "seq_length",
    "n_positions",
    "n_ctx",
)


@functools.lru_cache(maxsize=32)
def context_length(model: str) -> int | None:
    """The context length ``model``'s ``config.json`` states, if any (blocking disk work)."""
    try:
        config = json.loads((Path(locate(model, param="model")) / "config.json").read_text())
    except (NotFound, OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text_config = config.get("text_config")
    for source in (config, text_config if isinstance(text_config, dict) else {}):
        for key in CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


@attrs.frozen
class EngineCoreFactory:
    """Builds the mlx-lm engine for a ``ModelKey``, on the thread that will step it.

    A plain object (not a closure) so that it can travel to an engine process.
    """

    config: ServerConfig

    def __call__(self, key: ModelKey):
        from runtime.engine.loading import make_engine_core

        config = self.config
        served_id, default_path = resolve_model(config)
        if not config.model and key.model == default_path and served_id == TINY_MODEL_ID:
            from runtime.tiny_model import build_tiny_model

            log.warning(
                "no --model given and the demo model's weights are missing: serving a tiny "
                "model with RANDOM weights (%s); its answers are noise. Pass --model PATH "
                "for a real model.",
                key.model,
            )
            if not (Path(key.model) / "model.safetensors").exists():
                build_tiny_model(key.model)
        return make_engine_core(
            attrs.evolve(config, adapter_path=key.adapter, draft_model=key.draft), key.model
        )
