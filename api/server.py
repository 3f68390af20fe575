"""The Quart-Trio application: ``create_app(config)`` assembles the HTTP edge.

Owns the app's lifecycle (its serving starts the ``Runtime``, every actor and
the engine, in the app's nursery, and cancels it on shutdown), the error
handlers (every error is an OpenAI-style JSON body, Anthropic's under
``/v1/messages``; 429 and 503 carry ``Retry-After``), CORS, and which routes
exist:

* ``api.routes.completions``: chat and text completions;
* ``api.routes.embeddings``: embeddings (with ``--embedding-model``);
* ``api.routes.models``: the model list;
* ``api.routes.operations``: ``/health``, ``/metrics``, ``/openapi.json``;
* ``api.routes.tokenizer``: ``/tokenize``, ``/detokenize``;
* ``api.agents``: OpenAI Responses and Anthropic Messages;
* ``api.chat_page``: the chat page at ``/``.

Every generating route goes through ``api.generation.generate``. Around them:
API keys (``api.auth``) and, wrapping the whole ASGI app, request ids, the
access log and the HTTP metrics (``api.observability``).
"""

from __future__ import annotations

import logging

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from actors.system import Runtime
from api.agents import messages_errors
from api.agents.routes import register_agent_apis
from api.auth import ApiKeys, register_auth
from api.chat_page import register_chat_page
from api.http import error_response
from api.observability import RequestObserver, note_route
from api.routes.completions import completions_blueprint
from api.routes.embeddings import embeddings_blueprint
from api.routes.models import models_blueprint
from api.routes.operations import operations_blueprint
from api.routes.tokenizer import tokenizer_blueprint
from runtime.config import ServerConfig
from runtime.config_checks import unsupported
from runtime.distributed import is_follower
from runtime.errors import PayloadTooLarge, ServerError

log = logging.getLogger(__name__)


def create_app(config: ServerConfig, *, runtime: Runtime | None = None) -> QuartTrio:
    problems = unsupported(config)
    if is_follower():
        problems.append(
            "this process is a distributed rank other than 0, which serves no HTTP: "
            "launch the `mlx-trio-server` command with mlx.launch (see docs/distributed.md)"
        )
    if problems:
        raise SystemExit("mlx-trio-server: " + "; ".join(problems))
    api_keys = ApiKeys.from_config(config)

    app = QuartTrio("mlx_trio_server", static_folder=None)  # no ./static from the cwd
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = 5
    rt = runtime or Runtime(config)
    app.extensions["runtime"] = rt
    _lifecycle(app, rt)
    _error_handlers(app, config)
    _cors(app, config)
    register_auth(app, api_keys, config)

    app.register_blueprint(completions_blueprint(rt, config))
    app.register_blueprint(embeddings_blueprint(rt, config))
    app.register_blueprint(models_blueprint(rt))
    app.register_blueprint(operations_blueprint(rt))
    app.register_blueprint(tokenizer_blueprint(rt, config))
    register_chat_page(app)
    register_agent_apis(app, rt, config)
    app.asgi_app = RequestObserver(app.asgi_app, rt.metrics, rt.arrivals)
    return app


def _lifecycle(app: QuartTrio, rt: Runtime) -> None:
    cancel_runtime: list[trio.CancelScope] = []

    async def run_runtime(*, task_status=trio.TASK_STATUS_IGNORED):
        with trio.CancelScope() as scope:
            cancel_runtime.append(scope)
            await rt.run(task_status=task_status)

    @app.before_serving
    async def start_runtime():
        await app.nursery.start(run_runtime)

    @app.after_serving
    async def stop_runtime():
        rt.accepting = False
        for scope in cancel_runtime:
            scope.cancel()


def _error_handlers(app: QuartTrio, config: ServerConfig) -> None:
    def respond(error: ServerError | HTTPException) -> Response:
        """The answer in the shape of the API the path belongs to (routing errors too)."""
        if messages_errors.is_messages_path(request.path):
            return messages_errors.error_response(error)
        return error_response(error)

    @app.errorhandler(ServerError)
    async def on_server_error(error: ServerError):
        return respond(error)

    @app.errorhandler(RequestEntityTooLarge)
    async def on_too_large(error):
        return respond(
            PayloadTooLarge(f"the request body is larger than {config.max_request_bytes} bytes")
        )

    @app.errorhandler(HTTPException)
    async def on_http_error(error: HTTPException):
        return respond(error)

    @app.errorhandler(Exception)
    async def on_unexpected(error: Exception):
        log.exception("unexpected error while serving %s %s", request.method, request.path)
        return respond(ServerError(f"internal error: {type(error).__name__}"))


def _cors(app: QuartTrio, config: ServerConfig) -> None:
    @app.after_request
    async def add_cors(response: Response):
        note_route()  # for the access log and the metrics, counted when the response ends
        origins = config.allowed_origins
        origin = request.headers.get("Origin")
        if "*" in origins:
            response.headers["Access-Control-Allow-Origin"] = "*"
        elif origin in origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
        response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
        response.headers["Access-Control-Allow-Headers"] = "*"
        return response

    @app.before_request
    async def preflight():
        # Any path answers a CORS preflight, as mlx_lm.server does.
        if request.method == "OPTIONS":
            return Response("", status=204)
        return None
