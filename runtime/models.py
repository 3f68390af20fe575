"""Which model a request asks for, and whether it can be had without a download.

Also which model the server serves by default (``resolve_model``: the
configured one, else the embedded demo model), and ``RealEngineCore``, the
picklable recipe that builds mlx-lm's engine for a ``ModelKey`` on the
thread (or in the process) that will step it.

A ``ModelKey`` names a loadable combination: model path, LoRA adapter path,
draft model path. ``resolve_key`` maps a request's ``model`` / ``adapters`` /
``draft_model`` fields to one, the way mlx_lm.server does (``default_model``
and the served id or path mean the configured model), except that a request
can only name models that are already on this machine: a local directory, or
a repository in the local Hugging Face cache. A request never starts a
download; anything else is a 404 that names the model.
"""

from __future__ import annotations

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


def resolve_key(
    config: ServerConfig,
    served_id: str,
    served_path: str,
    *,
    model: str | None,
    adapters: str | None = None,
    draft_model: str | None = None,
) -> ModelKey:
    default = default_key(config, served_path)
    aliases = {*DEFAULT_ALIASES, served_id, served_path}
    if config.model:
        aliases.add(config.model)
    if model is None or model in aliases or _same_path(model, served_path):
        path = served_path
        adapter = adapters if adapters is not None else default.adapter
    else:
        path = locate(model, param="model")
        adapter = adapters
    if adapter is not None and adapter != default.adapter:
        adapter = str(locate(adapter, param="adapters", want="adapter_config.json"))
    draft = default.draft
    if draft_model is not None and draft_model not in DEFAULT_ALIASES:
        draft = locate(draft_model, param="draft_model")
    return ModelKey(path, adapter, draft)


def _same_path(a: str, b: str) -> bool:
    try:
        return os.path.exists(a) and Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def locate(name: str, *, param: str, want: str = "config.json") -> str:
    """A local directory holding ``want``, or the local HF cache's snapshot of repo ``name``."""
    path = Path(name).expanduser()
    if path.is_dir():
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


@attrs.frozen
class RealEngineCore:
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
