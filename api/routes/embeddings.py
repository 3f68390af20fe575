"""``POST /v1/embeddings`` (and ``/embeddings``): OpenAI's embeddings endpoint.

Receives an ``EmbeddingRequest`` (``api.schemas``: ``input`` as a string, an
array of strings, an array of token ids or an array of them; every bad field a
400 naming it), checks what depends on the server (``model`` must name the
embedding model: 404 for an unknown name, 400 for the chat model's;
``--embedding-max-inputs``; ``dimensions`` only where the model allows it),
and asks the Embeddings actor (``actors.embeddings``) for the vectors: it
batches them with other requests' on the model's own thread, and answers 429
or 503 with ``Retry-After`` when it cannot take them. Emits OpenAI's list
(``api.bodies.EmbeddingList``): floats, or base64 of little-endian float32
bytes, and ``usage``; a large body is encoded in a worker thread.
"""

from __future__ import annotations

import base64
import functools

import numpy as np
import trio
from quart import Blueprint, Response

from actors.embeddings import Embeddings
from actors.system import Runtime
from api.convert import structure_or_400
from api.http import read_json
from api.schemas import EmbeddingRequest, embedding_inputs
from api.sse import dumps
from runtime.config import ServerConfig, flag
from runtime.embeddings import EmbeddingInfo
from runtime.errors import ClientError, NotFound, shutting_down
from runtime.models import names_served

INLINE_BODY_FLOATS = 16384  # a larger answer is encoded off the event loop


def embeddings_blueprint(rt: Runtime, config: ServerConfig) -> Blueprint:
    routes = Blueprint("embeddings", __name__)

    @routes.post("/v1/embeddings")
    @routes.post("/embeddings")
    async def create_embeddings():
        req = structure_or_400(await read_json(), EmbeddingRequest)
        actor = _embedding_model(rt, config, req.model)
        if not rt.accepting:
            raise shutting_down()
        inputs, single = embedding_inputs(req.input)
        if len(inputs) > config.embedding_max_inputs:
            raise ClientError(
                f"input has {len(inputs)} items; at most {config.embedding_max_inputs} are "
                "allowed in one request",
                param="input",
            )
        info = await actor.wait_ready()
        dimensions = _dimensions(req.dimensions, info, config)
        result = await actor.embed(inputs, single=single)
        encode = functools.partial(
            _body, result.vectors, dimensions, req.encoding_format, actor.model_id,
            result.prompt_tokens,
        )
        if result.vectors.shape[0] * dimensions <= INLINE_BODY_FLOATS:
            body = encode()
        else:
            body = await trio.to_thread.run_sync(encode, limiter=rt.tokenize_limiter)
        return Response(body, content_type="application/json")

    return routes


def _embedding_model(rt: Runtime, config: ServerConfig, model: str) -> Embeddings:
    """The Embeddings actor, if ``model`` names it (404 or 400 otherwise)."""
    actor = rt.embeddings
    if actor is not None and model == actor.model_id:
        return actor
    if names_served(config, rt.model_id, rt.model_path, model):
        served = f"; it serves {actor.model_id!r}" if actor is not None else ""
        raise ClientError(
            f"model {model!r} is a chat model, not an embedding model{served}",
            param="model",
        )
    if actor is None:
        raise NotFound(
            f"model {model!r} not found: this server serves no embedding model (start it with "
            f"{flag('embedding_model')})",
            param="model",
        )
    raise NotFound(
        f"model {model!r} not found: the embedding model served here is {actor.model_id!r}",
        param="model",
    )


def _dimensions(asked: int | None, info: EmbeddingInfo, config: ServerConfig) -> int:
    """How many components each vector keeps (400 where the model does not allow it)."""
    if asked is None or asked == info.dimensions:
        return info.dimensions
    if not config.embedding_matryoshka:
        raise ClientError(
            f"dimensions must be {info.dimensions} (the model's size): this model is not "
            f"served as one trained for shortened vectors ({flag('embedding_matryoshka')})",
            param="dimensions",
        )
    if asked > info.dimensions:
        raise ClientError(
            f"dimensions must be at most {info.dimensions}, got {asked}", param="dimensions"
        )
    return asked


def _body(
    vectors: np.ndarray, dimensions: int, encoding: str, model: str, prompt_tokens: int
) -> str:
    """The JSON answer: each vector cut to ``dimensions`` and normalised again if cut."""
    if dimensions < vectors.shape[1]:
        vectors = vectors[:, :dimensions]
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.maximum(norms, 1e-12)
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    if encoding == "base64":
        encoded = [base64.b64encode(row.tobytes()).decode("ascii") for row in vectors]
    else:
        encoded = vectors.tolist()
    return dumps({
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": item}
            for i, item in enumerate(encoded)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })
