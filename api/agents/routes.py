"""Registers the agent APIs (OpenAI Responses, Anthropic Messages) on the app.

``register_agent_apis`` is the one hook ``api.server.create_app`` calls: it
adds the two blueprints (both generate through ``api.generation.generate``,
the path every endpoint takes) and the ``ResponseStore`` the Responses routes
keep finished responses in (``app.extensions["response_store"]``; a path
given that cannot be opened stops ``create_app``): it opens its file when
the app starts serving (its writer runs in the app's nursery) and closes it
when the app stops. Errors
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
    store = ResponseStore.from_config(config)
    app.extensions["response_store"] = store

    @app.before_serving
    async def open_response_store():
        await app.nursery.start(store.run)

    @app.after_serving
    async def close_response_store():
        await store.aclose()

    app.register_blueprint(responses_blueprint(rt, config, store))
    app.register_blueprint(messages_blueprint(rt, config))
