"""Registers the agent APIs (OpenAI Responses, Anthropic Messages) on the app.

``register_agent_apis`` is the one hook ``create_app`` calls: it receives the
chat route's ``generate`` (enter a Session, answer with a renderer's JSON body
or SSE stream) and ``read_json``, so every endpoint shares one generation
path, and adds the two blueprints. The Anthropic blueprint answers its
errors in Anthropic's shape; the Responses one keeps the app's OpenAI shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from quart import Response
from quart_trio import QuartTrio

from api.anthropic_messages import messages_blueprint
from api.openai_responses import ResponseStore, responses_blueprint
from runtime.config import ServerConfig


def register_agent_apis(
    app: QuartTrio,
    rt,
    config: ServerConfig,
    *,
    generate: Callable[..., Awaitable[Response]],
    read_json: Callable[[], Awaitable[Any]],
) -> None:
    store = ResponseStore()
    app.extensions["response_store"] = store
    app.register_blueprint(
        responses_blueprint(rt, config, generate=generate, read_json=read_json, store=store)
    )
    app.register_blueprint(messages_blueprint(rt, config, generate=generate, read_json=read_json))
