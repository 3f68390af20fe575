"""The OpenAI Responses routes: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``.

Receives the request body, structured and validated at the edge
(``api.agents.responses_schema``, a 400 naming the field), turns it into a
``ChatTurn`` (``api.agents.responses_input``), resolves the model (404) and
hands the Session and a ``ResponsesRenderer`` to ``api.generation.generate``,
the path chat completions take. Emits the ``response`` object or its event
stream. Stored responses belong to the API key that made them
(``api.auth.request_owner``): ``GET`` and ``DELETE`` answer from the
``ResponseStore`` with a 404 when the response is not, or no longer, stored
or is another key's, and ``previous_response_id`` naming such a response is
the 400 of an unknown one. Errors are in the app's OpenAI shape.
"""

from __future__ import annotations

from quart import Blueprint

from actors.system import Runtime
from api.agents.blocks import open_session, prompt_length
from api.agents.responses_input import prepare_request
from api.agents.responses_render import ResponsesRenderer
from api.agents.responses_schema import ResponsesRequest
from api.agents.responses_store import ResponseStore
from api.auth import request_owner
from api.convert import structure_or_400
from api.generation import generate
from api.http import json_response, read_json
from runtime.config import ServerConfig
from runtime.errors import NotFound


def responses_blueprint(rt: Runtime, config: ServerConfig, store: ResponseStore) -> Blueprint:
    bp = Blueprint("openai_responses", __name__)

    @bp.post("/v1/responses")
    async def create_response():
        req = structure_or_400(await read_json(), ResponsesRequest)
        owner = request_owner()
        previous = None  # the response previous_response_id names, if this key stored it
        if req.previous_response_id is not None:
            previous = await store.get(req.previous_response_id, owner)
        prepared = prepare_request(req, config, previous)  # none found: the 400
        model = await rt.resolve(req.model)
        session = open_session(
            rt, config, prepared.turn, model=model, timeout=req.timeout, prompt_param="input",
            cache_salt=req.cache_salt,
        )
        renderer = ResponsesRenderer(
            req=req,
            prepared=prepared,
            store=store,
            owner=owner,
            prompt_tokens=lambda: prompt_length(session),
        )
        return await generate(
            session, renderer, req.stream, stream_interval=config.stream_interval_ms / 1000
        )

    @bp.get("/v1/responses/<response_id>")
    async def get_response(response_id: str):
        entry = await store.get(response_id, request_owner())
        if entry is None:
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        return json_response(entry.body)

    @bp.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str):
        if not await store.delete(response_id, request_owner()):
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        return json_response({"id": response_id, "object": "response", "deleted": True})

    return bp
