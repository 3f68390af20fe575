"""``GET /v1/models`` and ``GET /v1/models/<id>``: the models this server can serve.

Emits OpenAI's model list: exactly what a request may name
(``Runtime.model_policy``): the served model first (with its context window,
as ``context_length`` and vLLM's ``max_model_len``, once it has loaded), the
``--embedding-model`` if any (``context_length``: the most tokens of one
input), then the ``--allowed-models`` entries found on this machine and the model
directories in ``--models-dir``, and with ``--allowed-models '*'`` the MLX
models in the local Hugging Face cache (as mlx_lm.server lists them). Looking
at the disk is blocking work: it runs in a worker thread, at most every
``LISTING_TTL`` seconds (``CachedListing``), never on the event loop.
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path

import trio
from quart import Blueprint

from actors.system import Runtime
from api.bodies import ModelCard, ModelList
from api.convert import unstructure
from api.http import json_response
from runtime.errors import NotFound
from runtime.models import ModelPolicy, allowed_model_ids

LISTING_TTL = 10.0


class CachedListing:
    """A listing that is slow to make (it walks the disk): made in a worker thread,
    at most every ``ttl`` seconds, one at a time."""

    def __init__(self, make, ttl: float = LISTING_TTL):
        self._make = make
        self._ttl = ttl
        self._value = None
        self._made_at = -math.inf
        self._lock = trio.Lock()

    async def get(self):
        async with self._lock:
            if trio.current_time() - self._made_at > self._ttl:
                self._value = await trio.to_thread.run_sync(self._make)
                self._made_at = trio.current_time()
            return self._value


def models_blueprint(rt: Runtime) -> Blueprint:
    routes = Blueprint("models", __name__)
    listing = CachedListing(functools.partial(allowed_models, rt.model_policy))

    @routes.get("/v1/models")
    async def models():
        return json_response(unstructure(model_list(rt, await listing.get())))

    @routes.get("/v1/models/<path:model_id>")
    async def model(model_id: str):
        for card in model_list(rt, await listing.get()).data:
            if card.id == model_id:
                return json_response(unstructure(card))
        raise NotFound(f"model {model_id!r} not found", param="model")

    return routes


def model_list(rt: Runtime, cached_models: list[str]) -> ModelList:
    created = int(time.time())
    window = rt.context_window()  # known once the served model has loaded
    cards = [
        ModelCard(
            id=rt.model_id,
            object="model",
            created=created,
            owned_by="mlx-trio-server",
            context_length=window,
            max_model_len=window,
        )
    ]
    seen = {rt.model_id}
    if rt.embeddings is not None:
        info = rt.embeddings.info  # known once the embedding model has loaded
        cards.append(
            ModelCard(
                id=rt.embeddings.model_id,
                object="model",
                created=created,
                owned_by="mlx-trio-server",
                context_length=info.max_tokens if info is not None else None,
            )
        )
        seen.add(rt.embeddings.model_id)
    for model_id in cached_models:
        if model_id not in seen:
            seen.add(model_id)
            cards.append(
                ModelCard(id=model_id, object="model", created=created, owned_by="huggingface")
            )
    return ModelList(object="list", data=cards)


def allowed_models(policy: ModelPolicy) -> list[str]:
    """What ``policy`` lets a request name, besides the served model (blocking)."""
    found = allowed_model_ids(policy)
    if policy.anything:
        found += cached_mlx_models()
    return found


def cached_mlx_models() -> list[str]:
    """MLX models in the local Hugging Face cache, as mlx_lm.server lists them."""
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir()
    except Exception:  # no cache folder (or an unreadable one): nothing to list
        return []
    wanted = {"config.json", "model.safetensors.index.json", "tokenizer_config.json"}
    found = []
    for repo in info.repos:
        if repo.repo_type != "model" or "main" not in repo.refs:
            continue
        names = {Path(f.file_path).name for f in repo.refs["main"].files}
        if wanted <= names:
            found.append(repo.repo_id)
    return sorted(found)
