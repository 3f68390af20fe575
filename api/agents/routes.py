"""Registers the agent APIs (OpenAI Responses, Anthropic Messages) on the app.

``register_agent_apis`` is the one hook ``api.server.create_app`` calls: it
adds the two blueprints (both generate through ``api.generation.generate``,
the path every endpoint takes), the ``ResponseStore`` they share with
nothing else (``app.extensions["response_store"]``), and app-level handlers
for the errors Quart's routing raises before any blueprint is chosen (404
unknown path, 405 wrong method): under ``/v1/messages`` they are answered in
Anthropic's shape, elsewhere as the app answers every ``HTTPException``.
"""

from __future__ import annotations

from quart import request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from actors.system import Runtime
from api.agents import messages_errors
from api.agents.messages_routes import messages_blueprint
from api.agents.responses_routes import responses_blueprint
from api.agents.responses_store import ResponseStore
from api.http import error_response
from runtime.config import ServerConfig


def register_agent_apis(app: QuartTrio, rt: Runtime, config: ServerConfig) -> None:
    store = ResponseStore()
    app.extensions["response_store"] = store
    app.register_blueprint(responses_blueprint(rt, config, store))
    app.register_blueprint(messages_blueprint(rt, config))

    async def on_routing_error(error: HTTPException):
        if messages_errors.is_messages_path(request.path):
            return messages_errors.error_response(error)
        return error_response(error)

    # By status: these take precedence over the app's handler for every HTTPException.
    app.register_error_handler(404, on_routing_error)
    app.register_error_handler(405, on_routing_error)
