"""Registers the agent APIs (OpenAI Responses, Anthropic Messages) on the app.

``register_agent_apis`` is the one hook ``api.server.create_app`` calls: it
adds the two blueprints (both generate through ``api.generation.generate``,
the path every endpoint takes) and the ``ResponseStore`` the Responses routes
keep finished responses in (``app.extensions["response_store"]``). Errors
are answered by the app's handlers, in Anthropic's shape under
``/v1/messages`` (``api.agents.messages_errors``).
"""

from __future__ import annotations

from quart_trio import QuartTrio

from actors.system import Runtime
from api.agents.messages_routes import messages_blueprint
from api.agents.responses_routes import responses_blueprint
from api.agents.responses_store import ResponseStore
from runtime.config import ServerConfig


def register_agent_apis(app: QuartTrio, rt: Runtime, config: ServerConfig) -> None:
    store = ResponseStore()
    app.extensions["response_store"] = store
    app.register_blueprint(responses_blueprint(rt, config, store))
    app.register_blueprint(messages_blueprint(rt, config))
