"""The Quart-Trio application: OpenAI endpoints over the actor runtime.

``create_app(config)`` builds the app; its serving lifecycle starts the
``Runtime`` (all actors, the engine thread) in the app's nursery and cancels
it on shutdown. Routes parse and validate at the edge (cattrs), open a
``Session``, and render its events as one JSON body or an SSE stream. Every
error is an OpenAI-style JSON body (``{"error": {message, type, param,
code}}``); 429 and 503 carry ``Retry-After``.

A streaming response's body is a ``SessionStream``: the Session is entered in
the route (so a refusal is a proper status code before any byte is sent) and
left by the stream's ``aclose()``, which Quart calls when the body ends or the
client disconnects, or, if the response is dropped before its body starts,
by a ``weakref.finalize`` safety net. Leaving is synchronous and withdraws
the sequence from the engine.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import platform
import time
import weakref
from pathlib import Path
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from actors.session import Session
from actors.system import Runtime
from api.agent_routes import register_agent_apis
from api.chat_page import register_chat_page
from api.convert import structure_or_400, unstructure
from api.errors import error_answer
from api.responses import ChatRenderer, ModelCard, ModelList, TextRenderer, dumps
from api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationFields
from runtime.config import ServerConfig
from runtime.distributed import is_follower
from runtime.errors import ClientError, PayloadTooLarge, ServerError
from runtime.messages import Failed, Finished, SamplingParams
from runtime.prompts import prepare_chat, prepare_text

log = logging.getLogger(__name__)

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def _fingerprint() -> str:
    try:
        import mlx.core as mx
        import mlx_lm

        return f"mlx-trio-server-{mlx_lm.__version__}-{mx.__version__}-{platform.machine()}"
    except Exception:  # pragma: no cover - mlx missing is caught at load
        return "mlx-trio-server"


def json_response(payload: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(payload), status=status, headers=headers, content_type="application/json")


def error_response(error: ServerError | Failed | HTTPException) -> Response:
    answer = error_answer(error)
    return json_response(answer.body, status=answer.status, headers=answer.headers)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json() -> Any:
    raw = await request.get_data(cache=False, as_text=False)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ClientError("the request body is not valid UTF-8") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as exc:
        raise ClientError(f"the request body is not valid JSON: {exc}") from None


def sampling_params(req: GenerationFields, config: ServerConfig) -> SamplingParams:
    def pick(value, default):
        return default if value is None else value

    return SamplingParams(
        temperature=float(pick(req.temperature, config.temp)),
        top_p=float(pick(req.top_p, config.top_p)),
        top_k=int(pick(req.top_k, config.top_k)),
        min_p=float(pick(req.min_p, config.min_p)),
        xtc_probability=req.xtc_probability,
        xtc_threshold=req.xtc_threshold,
        repetition_penalty=req.repetition_penalty,
        repetition_context_size=req.repetition_context_size,
        presence_penalty=req.presence_penalty,
        presence_context_size=req.presence_context_size,
        frequency_penalty=req.frequency_penalty,
        frequency_context_size=req.frequency_context_size,
        logit_bias=req.logit_bias_pairs,
        seed=req.seed,
    )


def plain_message(message: ChatMessage) -> dict[str, Any]:
    """A validated message as the chat template expects it."""
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text or "" for part in content)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            arguments = call.function.arguments
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError:
                    raise ClientError(
                        "tool call arguments must be a JSON object",
                        param="messages.tool_calls.function.arguments",
                    ) from None
            calls.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments},
                }
            )
        out["tool_calls"] = calls
    return out


class SessionStream:
    """The body of a streaming response: frames from an entered Session.

    ``interval`` (seconds, ``--stream-interval-ms``; 0: every engine step):
    after a chunk is sent, the next is sent no sooner than this. Text that
    arrives meanwhile merges in the Session's outbox, so each chunk carries
    several tokens: fewer HTTP chunks, less CPU per token, coarser streaming.
    The first chunk is never held back.
    """

    def __init__(self, session: Session, renderer, interval: float = 0.0):
        self._session = session
        self._renderer = renderer
        self._interval = interval
        self._next_send = -math.inf
        self._done = False
        self._close = weakref.finalize(self, _leave_session, session)

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        while not self._done:
            if self._interval and trio.current_time() < self._next_send:
                await trio.sleep_until(self._next_send)  # the outbox merges meanwhile
            try:
                items = await self._session.receive()
            except trio.EndOfChannel:
                self._finish()
                break
            if any(isinstance(i, Finished | Failed) for i in items):
                self._finish()
            frames = self._renderer.stream_frames(items)
            if frames:  # an empty body chunk would read as the end of the stream
                self._next_send = trio.current_time() + self._interval
                return frames
        raise StopAsyncIteration

    def _finish(self) -> None:
        self._done = True
        self._close()

    async def aclose(self) -> None:
        self._close()


def _leave_session(session: Session) -> None:
    session.leave()


def create_app(config: ServerConfig, *, runtime: Runtime | None = None) -> QuartTrio:
    problems = config.unsupported()
    if is_follower():
        problems.append(
            "this process is a distributed rank other than 0, which serves no HTTP: "
            "launch the `mlx-trio-server` command with mlx.launch (see docs/distributed.md)"
        )
    if problems:
        raise SystemExit("mlx-trio-server: " + "; ".join(problems))

    app = QuartTrio("mlx_trio_server", static_folder=None)  # no ./static from the cwd
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = 5
    rt = runtime or Runtime(config)
    app.extensions["runtime"] = rt
    fingerprint = _fingerprint()
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

    # ------------------------------------------------------------ errors

    @app.errorhandler(ServerError)
    async def on_server_error(error: ServerError):
        return error_response(error)

    @app.errorhandler(RequestEntityTooLarge)
    async def on_too_large(error):
        return error_response(
            PayloadTooLarge(f"the request body is larger than {config.max_request_bytes} bytes")
        )

    @app.errorhandler(HTTPException)
    async def on_http_error(error: HTTPException):
        return error_response(error)

    @app.errorhandler(Exception)
    async def on_unexpected(error: Exception):
        log.exception("unexpected error while serving %s %s", request.method, request.path)
        return error_response(ServerError(f"internal error: {type(error).__name__}"))

    # -------------------------------------------------------------- CORS

    @app.after_request
    async def add_cors(response: Response):
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        rt.count_response(rule, response.status_code)
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

    # ------------------------------------------------------------ routes

    @app.get("/health")
    async def health():
        status, body = rt.health()
        return json_response(body, status=status)

    @app.get("/metrics")
    async def metrics():
        return Response(
            rt.metrics_text(), content_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/openapi.json")
    async def openapi():
        from api.openapi import openapi_document

        return json_response(openapi_document())

    model_listing = CachedListing(_cached_mlx_models)

    @app.get("/v1/models")
    async def models():
        return json_response(unstructure(_model_list(rt, await model_listing.get())))

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str):
        for card in _model_list(rt, await model_listing.get()).data:
            if card.id == model_id:
                return json_response(unstructure(card))
        raise _not_found(model_id)

    async def generate(session: Session, renderer, stream: bool):
        """The one generation path of every endpoint; ``renderer`` sets the wire format."""
        await session.__aenter__()
        if stream:
            try:
                body = SessionStream(session, renderer, config.stream_interval_ms / 1000)
            except BaseException:
                await session.__aexit__(None, None, None)
                raise
            response = Response(body, status=200, headers=SSE_HEADERS)
            response.timeout = None
            return response
        try:
            while renderer.terminal is None:
                try:
                    items = await session.receive()
                except trio.EndOfChannel:
                    break
                for item in items:
                    renderer.add(item)
        finally:
            await session.__aexit__(None, None, None)
        terminal = renderer.terminal
        if isinstance(terminal, Failed):
            answer = error_answer(terminal)  # status and Retry-After; the body in the API's shape
            return json_response(
                renderer.failure_body(terminal), status=answer.status, headers=answer.headers
            )
        return json_response(renderer.body())

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions():
        req = structure_or_400(await read_json(), ChatCompletionRequest)
        messages = [plain_message(m) for m in req.messages]
        template_args = {**config.chat_template_args, **(req.chat_template_kwargs or {})}
        prepare = functools.partial(
            _prepare_chat,
            messages=messages,
            tools=req.tools,
            template_args=template_args,
            role_mapping=req.role_mapping,
        )
        want_logprobs = req.logprobs or bool(req.top_logprobs)
        return await serve(
            req, ChatRenderer, prepare, markup=True, tools=req.tools,
            logprobs=want_logprobs, top_logprobs=req.top_logprobs or 0,
        )

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions():
        req = structure_or_400(await read_json(), CompletionRequest)
        return await serve(
            req, TextRenderer, functools.partial(_prepare_text, prompt=req.prompt), markup=False,
            logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
        )

    async def serve(req: GenerationFields, renderer_class, prepare, *, markup, logprobs,
                    top_logprobs, tools=None):
        """The part of a chat or text completion that does not depend on which."""
        key = await rt.resolve(req.model, req.adapters, req.draft_model)
        session = rt.session(
            prepare=prepare,
            sampling=sampling_params(req, config),
            max_tokens=req.token_limit or config.max_tokens,
            stop=req.stop_strings,
            tools=tools,
            markup=markup,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            timeout=_timeout(req, config),
            model=key,
            num_draft_tokens=req.num_draft_tokens,
        )
        renderer = renderer_class(
            # The id /v1/models lists for the served model, whatever alias named it.
            model=rt.model_id if key == rt.default_model else req.model,
            fingerprint=fingerprint,
            logprobs=logprobs,
            include_usage=req.include_usage,
        )
        return await generate(session, renderer, req.stream)

    register_chat_page(app)
    # The agent APIs (OpenAI Responses, Anthropic Messages) share ``generate``.
    register_agent_apis(app, rt, config, generate=generate, read_json=read_json)
    return app


def _timeout(req: GenerationFields, config: ServerConfig) -> float | None:
    limits = [t for t in (req.timeout, config.request_timeout) if t is not None]
    return min(limits) if limits else None


def _prepare_chat(tokenizer, *, messages, tools, template_args, role_mapping):
    return prepare_chat(
        tokenizer, messages, tools=tools, template_args=template_args, role_mapping=role_mapping
    )


def _prepare_text(tokenizer, *, prompt):
    return prepare_text(tokenizer, prompt)


def _not_found(model_id: str) -> ServerError:
    from runtime.errors import NotFound

    return NotFound(f"model {model_id!r} not found", param="model")


class CachedListing:
    """A listing that is slow to make (it walks the disk): made in a worker thread,
    at most every ``ttl`` seconds, one at a time."""

    def __init__(self, make, ttl: float = 10.0):
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


def _model_list(rt: Runtime, cached_models: list[str]) -> ModelList:
    created = int(time.time())
    cards = [ModelCard(id=rt.model_id, object="model", created=created, owned_by="mlx-trio-server")]
    seen = {rt.model_id}
    for repo_id in cached_models:
        if repo_id not in seen:
            seen.add(repo_id)
            cards.append(ModelCard(id=repo_id, object="model", created=created, owned_by="huggingface"))
    return ModelList(object="list", data=cards)


def _cached_mlx_models() -> list[str]:
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
