"""The Anthropic Messages routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Receives the request body, structured and validated at the edge
(``api.agents.messages_schema``, a 400 naming the field), turns it into a
``ChatTurn`` (``api.agents.messages_input``), resolves the model (a name
starting with ``claude`` that names no local model is served by the default
model; any other unknown name is a 404) and hands the Session and a
``MessagesRenderer`` to ``api.generation.generate``, the path chat
completions take. ``count_tokens`` renders the prompt only and answers
``{"input_tokens"}``. The app's error handlers answer every error under
``/v1/messages`` in Anthropic's shape (``api.agents.messages_errors``).

Headers (``x-api-key``, ``anthropic-version``, ``anthropic-beta``) and the
``?beta=true`` query are accepted and ignored.
"""

from __future__ import annotations

import logging

import trio
from quart import Blueprint

from actors.system import Runtime
from api.agents.blocks import open_session, prepare_turn, prompt_length
from api.agents.messages_input import chat_turn, counted_turn
from api.agents.messages_render import MessagesRenderer
from api.agents.messages_schema import CountTokensRequest, MessagesRequest
from api.convert import structure_or_400
from api.generation import generate
from api.http import json_response, read_json
from runtime.config import ServerConfig
from runtime.errors import NotFound
from runtime.models import ModelKey

log = logging.getLogger(__name__)


async def resolve_model(rt: Runtime, name: str) -> ModelKey:
    """The model for ``name``: a local one if it names one, else (for Claude names) the default."""
    try:
        return await rt.resolve(name)
    except NotFound:
        if name.lower().startswith("claude"):
            log.debug("Anthropic model name %r served by the default model", name)
            return await rt.resolve(None)
        raise


def messages_blueprint(rt: Runtime, config: ServerConfig) -> Blueprint:
    bp = Blueprint("anthropic_messages", __name__)

    @bp.post("/v1/messages")
    async def messages():
        req = structure_or_400(await read_json(), MessagesRequest)
        turn = chat_turn(req, config)
        model = await resolve_model(rt, req.model)
        session = open_session(
            rt, config, turn, model=model, timeout=req.timeout, cache_salt=req.cache_salt
        )
        renderer = MessagesRenderer(model=req.model, prompt_tokens=lambda: prompt_length(session))
        return await generate(
            session, renderer, req.stream, stream_interval=config.stream_interval_ms / 1000
        )

    @bp.post("/v1/messages/count_tokens")
    async def count_tokens():
        req = structure_or_400(await read_json(), CountTokensRequest)
        turn = counted_turn(req, config)
        handle = await rt.acquire(await resolve_model(rt, req.model))
        try:
            prompt = await trio.to_thread.run_sync(
                lambda: prepare_turn(handle.tokenizer, turn=turn), limiter=rt.tokenize_limiter
            )
        finally:
            rt.release()
        return json_response({"input_tokens": len(prompt.tokens)})

    return bp
