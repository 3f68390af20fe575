"""The OpenAPI document, and schemathesis fuzzing a real Hypercorn server with it.

``api.openapi.openapi_document()`` must be valid OpenAPI 3.1, and the bounds
it states must be what validation does (each bound accepted, just past it
rejected, through ``structure_or_400``). Then schemathesis generates
valid and invalid requests from the document (its fuzzing and coverage
phases, positive and negative) against ``hypercorn api:app`` on the tiny
model, and every answer must be: no 5xx; a 2xx JSON body that conforms to the
document, or a 200 SSE stream that ends as its API ends one (``data: [DONE]``;
a Responses stream's terminal event; Anthropic's ``message_stop`` or
``error``); any other status an ``{"error": {message, type, param, code}}``
JSON body (Anthropic's ``{"type": "error", "error": {type, message}}`` under
``/v1/messages``). ``/health`` is 200 afterwards, with nothing left running.
The agent APIs (Responses, Anthropic Messages) are fuzzed and bound-checked
like the completion endpoints.

Bounded for CI: ``MLX_TRIO_MAX_TOKENS=4``, generated ``max_tokens`` /
``max_completion_tokens`` / ``max_output_tokens`` above 8 lowered to 8 (invalid values are sent as
generated), ``max_examples=30`` per operation in the fuzzing phase, a fixed
seed (``FUZZ_SEED=<n>`` explores others). The server bugs the fuzzer found
are regression tests at the end.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import attrs
import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import api.bodies as bodies
import api.schemas as schemas
from api.agents import messages_schema, responses_schema
from api.agents.messages_schema import CountTokensRequest, MessagesRequest
from api.agents.responses_schema import ResponsesRequest
from api.constraints import constraint_of
from api.convert import structure_or_400
from api.openapi import openapi_document
from api.schemas import ChatCompletionRequest, CompletionRequest
from runtime.errors import ClientError
from tests.conftest import wait_healthy
from tests.test_server_process import free_port

pytestmark = pytest.mark.server  # starts a hypercorn subprocess

MAX_EXAMPLES = 30
SEED = int(os.environ.get("FUZZ_SEED", "20240611"))  # another seed explores other inputs
TOKEN_CAP = 8
FUZZED = [
    "createChatCompletion", "createCompletion", "listModels", "health",
    "createResponse", "getResponse", "deleteResponse", "createMessage", "countMessageTokens",
    "createEmbedding",  # no embedding model served here: its refusals
]
AGENT_OPERATIONS = {
    "POST /v1/responses", "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
    "POST /v1/messages", "POST /v1/messages/count_tokens",
}
# the request types with bounds, and the smallest valid body of each
BOUNDED_REQUESTS = {
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]},
    CompletionRequest: {"prompt": "hi"},
    ResponsesRequest: {"input": "hi"},
    MessagesRequest: {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    schemas.EmbeddingRequest: {"model": "m", "input": "hi"},
}
JSON_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

# --------------------------------------------------------------- the document


def test_document_is_valid_openapi_31():
    doc = openapi_document()
    assert doc["openapi"].startswith("3.1")
    schema = schemathesis.openapi.from_dict(json.loads(json.dumps(doc)))
    schema.validate()  # the OpenAPI 3.1 meta-schema
    operations = {op.ok().label for op in schema.get_all_operations()}
    assert {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
        "GET /health",
        "GET /openapi.json",
        "POST /v1/embeddings",
        *AGENT_OPERATIONS,
    } <= operations
    components = doc["components"]["schemas"]
    error = components["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    assert error["properties"]["param"]["type"] == ["string", "null"]
    chat = components["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    assert chat["properties"]["top_p"] == {
        "type": ["number", "null"], "minimum": 0, "maximum": 1, "default": None
    }
    assert components["CompletionRequest"]["required"] == ["prompt"]
    for status in ("400", "413", "429", "503"):
        response = doc["paths"]["/v1/completions"]["post"]["responses"][status]
        assert response["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "404" in doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    assert "text/event-stream" in (
        doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    )


def test_document_describes_the_agent_apis():
    doc = openapi_document()
    components = doc["components"]["schemas"]
    for path, request, answer, error in [
        ("/v1/responses", "ResponsesRequest", "Response", "ErrorResponse"),
        ("/v1/messages", "MessagesRequest", "Message", "AnthropicError"),
        ("/v1/messages/count_tokens", "CountTokensRequest", "MessageTokensCount", "AnthropicError"),
    ]:
        post = doc["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/" + request
        )
        content = post["responses"]["200"]["content"]
        assert content["application/json"]["schema"]["$ref"].endswith("/" + answer)
        assert "text/event-stream" in content or path.endswith("count_tokens")
        for status in ("400", "404", "429", "503"):
            schema = post["responses"][status]["content"]["application/json"]["schema"]
            assert schema["$ref"].endswith("/" + error), (path, status)
    assert components["MessagesRequest"]["required"] == ["model", "messages", "max_tokens"]
    assert components["ResponsesRequest"]["properties"]["background"]["anyOf"][0] == {
        "type": "boolean", "const": False
    }
    assert components["MessageIn"]["properties"]["role"]["enum"] == ["user", "assistant", "system"]
    stored = doc["paths"]["/v1/responses/{response_id}"]
    assert set(stored) == {"get", "delete"} and "404" in stored["delete"]["responses"]


@pytest.mark.parametrize(
    "cls",
    [
        ChatCompletionRequest,
        CompletionRequest,
        schemas.ChatMessage,
        schemas.ContentPart,
        schemas.ToolCallIn,
        schemas.FunctionCallIn,
        schemas.StreamOptions,
        bodies.ChatCompletion,
        bodies.ChatCompletionChunk,
        bodies.TextCompletion,
        bodies.ModelList,
        bodies.ModelCard,
        bodies.UsageOut,
        schemas.EmbeddingRequest,
        bodies.EmbeddingList,
        bodies.EmbeddingOut,
        bodies.EmbeddingUsage,
        ResponsesRequest,
        responses_schema.TextConfigIn,
        responses_schema.TextFormatIn,
        responses_schema.ReasoningIn,
        MessagesRequest,
        CountTokensRequest,
        messages_schema.MessageIn,
        messages_schema.ContentBlockIn,
        messages_schema.TextBlockIn,
        messages_schema.SystemBlockIn,
        messages_schema.ToolIn,
        messages_schema.ToolChoiceIn,
        messages_schema.ThinkingIn,
    ],
    ids=lambda cls: cls.__name__,
)
def test_components_follow_the_attrs_types(cls):
    component = openapi_document()["components"]["schemas"][cls.__name__]
    fields = attrs.fields(cls)
    assert list(component["properties"]) == [f.name for f in fields]
    without_default = {f.name for f in fields if f.default is attrs.NOTHING}
    assert without_default <= set(component.get("required", []))


def _stated_bounds(prop: dict) -> tuple | None:
    """(minimum, maximum) the document states for a property: on the number, or on
    an object's values (``logit_bias``, maybe inside an ``anyOf`` member)."""
    places = [prop, prop.get("additionalProperties") or {}]
    for member in prop.get("anyOf", []):
        places.append(member.get("additionalProperties") or {})
    for place in places:
        if "minimum" in place or "maximum" in place:
            return place.get("minimum"), place.get("maximum")
    return None


def _document_bounds() -> dict[tuple[type, str], tuple]:
    """Every request field's bounds as /openapi.json states them."""
    components = openapi_document()["components"]["schemas"]
    out: dict[tuple[type, str], tuple] = {}
    for cls in BOUNDED_REQUESTS:
        for name, prop in components[cls.__name__]["properties"].items():
            bounds = _stated_bounds(prop)
            if bounds is not None:
                out[cls, name] = bounds
    return out


def _range_cases():
    for (cls, name), (low, high) in _document_bounds().items():
        for bound, outside in ((low, -1), (high, +1)):
            if bound is not None:
                yield pytest.param(cls, name, bound, outside, id=f"{cls.__name__}.{name}={bound}")


def _body(cls, name, value):
    if name == "logit_bias":
        value = {"7": value}
    return {**BOUNDED_REQUESTS[cls], name: value}


def _is_integer(cls, name) -> bool:
    prop = openapi_document()["components"]["schemas"][cls.__name__]["properties"][name]
    kinds = prop.get("type")
    return "integer" in (kinds if isinstance(kinds, list) else [kinds])


@pytest.mark.parametrize(("cls", "name", "bound", "direction"), list(_range_cases()))
def test_document_bounds_match_validation(cls, name, bound, direction):
    """Each bound the document states is accepted, and a value just past it is rejected."""
    structure_or_400(_body(cls, name, bound), cls)
    outside = bound + direction if _is_integer(cls, name) else bound + direction * 1e-6
    with pytest.raises(ClientError) as caught:
        structure_or_400(_body(cls, name, outside), cls)
    assert caught.value.param == name, caught.value.message


def test_every_bounded_field_is_in_the_document():
    """A field declared with bounds (api.constraints) shows them in /openapi.json."""
    declared = {
        (cls, field.name)
        for cls in BOUNDED_REQUESTS
        for field in attrs.fields(cls)
        if (c := constraint_of(field)) is not None and (c.minimum, c.maximum) != (None, None)
    }
    assert {"top_p", "logit_bias", "logprobs", "n", "max_output_tokens", "top_k"} <= {
        name for _, name in declared
    }
    assert declared == set(_document_bounds())


# -------------------------------------------------------------- the server


class Server:
    """``hypercorn api:app`` on a loopback port, its output in a log file."""

    def __init__(self, model_path: str, log_path: Path):
        self.log_path = log_path
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "MLX_TRIO_MODEL": model_path,
            "MLX_TRIO_MAX_TOKENS": "4",
            "PYTHONFAULTHANDLER": "1",  # a crash leaves its stack in the log
        }
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hypercorn", "api:app", "--worker-class", "trio",
                 "--bind", f"127.0.0.1:{port}"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if not wait_healthy(self.base, [self.proc]):
            self.proc.kill()
            pytest.fail(f"server did not start:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if not self.alive():
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail("server did not stop on SIGTERM")


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path, tmp_path_factory):
    server = Server(tiny_model_path, tmp_path_factory.mktemp("fuzz") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vocab_size(tiny_model_path) -> int:
    return json.loads((Path(tiny_model_path) / "config.json").read_text())["vocab_size"]


# The server's address is only known once the fixture runs: the schema has
# none, and each call names it. (schemathesis.pytest.from_fixture would load
# the schema lazily, but it sets Function._nodeid, which pytest 9.2 renamed.)
schema = schemathesis.openapi.from_dict(
    # A copy: schemathesis writes into the document it is given.
    json.loads(json.dumps(openapi_document())),
    config=schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "request-timeout": 30,
            "max-stream-events": 1000,
            "generation": {"database": "none"},
            "phases": {"stateful": {"enabled": False}},
            "output": {"sanitization": {"enabled": False}},  # "max_tokens" is not a secret
        }
    ),
).include(operation_id=FUZZED)


def _integral(value) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and float(value).is_integer()
    )


def shorten(body) -> None:
    """Make a generated body cheap to serve, and keep it off a known bug.

    Token limits above TOKEN_CAP become TOKEN_CAP (anything else, invalid
    values included, is sent as generated).
    """
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if _integral(body.get(key)) and body[key] > TOKEN_CAP:
            body[key] = TOKEN_CAP


def content_type(response) -> str:
    return (response.headers.get("content-type") or [""])[0]


def assert_error_shape(response, path: str = "") -> None:
    assert content_type(response).startswith("application/json"), response.text
    assert_error_body(json.loads(response.text), path)


def assert_error_body(body, path: str = "") -> None:
    """OpenAI's error body; Anthropic's under /v1/messages."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        assert isinstance(body, dict) and set(body) == {"type", "error"}, body
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert all(isinstance(v, str) for v in body["error"].values()), body
        return
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and isinstance(error["type"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


def sse_events(text: str) -> list[str]:
    """The names of a stream's events (``event:`` lines), in order."""
    return [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]


def assert_stream_ends(path: str, text: str) -> None:
    """A finished stream ends as its API ends one."""
    if path == "/v1/responses":
        assert sse_events(text)[-1] in (
            "response.completed", "response.incomplete", "response.failed"
        ), text[-500:]
    elif path == "/v1/messages":
        assert sse_events(text)[-1] in ("message_stop", "error"), text[-500:]
    else:
        assert text.endswith("data: [DONE]\n\n"), text[-500:]


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_fuzz_server(case, fuzz_server):
    shorten(case.body)
    try:
        response = case.call(base_url=fuzz_server.base)
    except requests.ConnectionError as exc:
        exc.add_note(f"server alive: {fuzz_server.alive()}; its log:\n{fuzz_server.log_tail()}")
        raise
    try:
        if content_type(response).startswith("text/event-stream"):
            # Not JSON: an SSE stream is only ever a 200, and it must end.
            case.validate_response(response, checks=[not_a_server_error])
            assert response.status_code == 200, response.text
            assert_stream_ends(case.operation.path, response.text)
            return
        case.validate_response(response, checks=JSON_CHECKS)
        if not 200 <= response.status_code < 300:
            assert_error_shape(response, case.operation.path)
    except Exception as exc:
        exc.add_note(f"server log:\n{fuzz_server.log_tail()}")
        raise


GENERATING_ROUTES = (
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
    "/v1/messages/count_tokens",
)


def _answered(metrics: str, route: str, status: int) -> int:
    pattern = rf'mlx_trio_http_responses_total{{route="{re.escape(route)}",status="{status}"}} (\S+)'
    found = re.search(pattern, metrics)
    return int(float(found.group(1))) if found else 0


def test_fuzzing_reached_every_generating_route(fuzz_server):
    """Not only refusals: some generated requests of each endpoint were served (200)."""
    metrics = httpx.get(f"{fuzz_server.base}/metrics", timeout=10).text
    if not any(_answered(metrics, route, 400) for route in GENERATING_ROUTES):
        pytest.skip("counts what test_fuzz_server sent to the same server")
    served = {route: _answered(metrics, route, 200) for route in GENERATING_ROUTES}
    assert all(served.values()), served


def test_served_document_is_the_document(fuzz_server):
    response = httpx.get(f"{fuzz_server.base}/openapi.json", timeout=10)
    assert response.status_code == 200
    assert response.json() == json.loads(json.dumps(openapi_document()))


def test_health_after_fuzzing(fuzz_server):
    deadline = time.monotonic() + 10
    while True:
        response = httpx.get(f"{fuzz_server.base}/health", timeout=5)
        assert response.status_code == 200, response.text
        health = response.json()
        if health["active_sequences"] == 0 and health["requests_in_flight"] == 0:
            break
        assert time.monotonic() < deadline, f"requests still running after the fuzzing: {health}"
        time.sleep(0.05)
    assert health["status"] == "ok" and health["engine_restarts"] == 0, health


# ---------------------------------------------- requests found by fuzzing
#
# Found by fuzzing and by probing what the fuzzing hinted at; each asserts
# the right answer (never a 500 or a crash). They
# run after the fuzzing (a failed engine step fails every sequence in it).

CHAT_HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base}{path}", json=body, timeout=30)


def assert_400(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    assert_error_shape_httpx(response)
    assert response.json()["error"]["param"] == param, response.text


def assert_error_shape_httpx(response: httpx.Response, path: str = "") -> None:
    assert response.headers.get("Content-Type", "").startswith("application/json"), response.text
    assert_error_body(response.json(), path)


def test_huge_prompt_token_id_does_not_kill_the_server(tiny_model_path, tmp_path):
    """A token id beyond 32 bits is a 400 naming ``prompt``, and the server stays up."""
    server = Server(tiny_model_path, tmp_path / "server.log")
    try:
        for token in (2**31, -(2**31) - 1, 58397326194):
            response = post(server, "/v1/completions", {"prompt": [token], "max_tokens": 1})
            assert_400(response, "prompt")
    finally:
        time.sleep(0.2)
        alive = server.alive()
        server.stop()
    assert alive, server.log_tail()


@pytest.mark.parametrize("token", [-1, "vocab_size"])
def test_prompt_token_id_outside_the_vocabulary_is_a_400(fuzz_server, vocab_size, token):
    """An id outside the vocabulary is a 400, never an out-of-bounds embedding read."""
    token = vocab_size if token == "vocab_size" else token
    response = post(fuzz_server, "/v1/completions", {"prompt": [token], "max_tokens": 1})
    assert_400(response, "prompt")


@pytest.mark.parametrize("key", ["--1", "\u00b2"])
def test_logit_bias_key_that_is_no_integer_is_a_400(fuzz_server, key):
    response = post(fuzz_server, "/v1/chat/completions", {**CHAT_HI, "logit_bias": {key: 1}})
    assert_400(response, "logit_bias")


@pytest.mark.parametrize(
    ("penalty", "size"),
    [
        ("repetition_penalty", "repetition_context_size"),
        ("presence_penalty", "presence_context_size"),
        ("frequency_penalty", "frequency_context_size"),
    ],
)
def test_context_size_beyond_int32_is_a_400(fuzz_server, penalty, size):
    body = {**CHAT_HI, penalty: 1.5, size: 2**32}
    response = post(fuzz_server, "/v1/chat/completions", body)
    assert_400(response, size)


@pytest.mark.parametrize("model", ["x" * 300, "~no-such-user-here/model"])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT_HI),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
        ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_model_name_that_cannot_be_a_path_is_a_404(fuzz_server, path, body, model):
    """A name too long for a file name, or ~ of no such user, is a 404 on every endpoint."""
    response = post(fuzz_server, path, {**body, "model": model})
    assert response.status_code == 404, response.text
    assert_error_shape_httpx(response, path)


def test_chat_template_kwargs_cannot_untokenize_the_prompt(fuzz_server):
    """The arguments that shape the template call itself (``tokenize``, ``return_dict``,
    ...) are ignored: the prompt is still tokens, the same count as without them."""
    plain = post(fuzz_server, "/v1/chat/completions", CHAT_HI)
    body = {**CHAT_HI, "chat_template_kwargs": {"tokenize": False, "return_dict": True}}
    response = post(fuzz_server, "/v1/chat/completions", body)
    assert response.status_code == plain.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] > 0


# ------------------------------------------- JSON the server cannot use
#
# Refused at the edge (api.json_input, the request types): nesting past the
# limit (about a thousand levels exhausts the parser's stack), a lone UTF-16
# surrogate (a str the tokenizer cannot encode), and a tool or tool call
# without its name. Each family is sent to every endpoint that reads a JSON
# body, at several places; each answer is a 400 whose param (the message, in
# Anthropic's shape) names the field. "@V@" in a body marks the place: the
# JSON string "@V@" is replaced by the value's JSON text.

HOLE = "@V@"
MSG = [{"role": "user", "content": "hi"}]
ANTHROPIC = {"model": "claude-test", "max_tokens": 1, "messages": MSG}
SCHEMA_WITH_HOLE = {"type": "object", "properties": {"a": {"type": "string"}}, "x": HOLE}
JSON_BODY_ENDPOINTS = {
    "/v1/chat/completions": {"messages": MSG, "max_tokens": 1},
    "/chat/completions": {"messages": MSG, "max_tokens": 1},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
    "/v1/messages": ANTHROPIC,
    "/v1/messages/count_tokens": {"model": "claude-test", "messages": MSG},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
# (endpoint, body with the hole at a value, the path of that value)
VALUE_PLACES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HOLE}]}, "messages[0].content"),
    ("/v1/chat/completions",
     {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": HOLE}}]},
     "tools[0].function.parameters"),
    ("/v1/chat/completions",
     {"messages": MSG, "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "n", "schema": SCHEMA_WITH_HOLE}}},
     "response_format.json_schema.schema.x"),
    ("/chat/completions", {"messages": [{"role": "user", "content": HOLE}]}, "messages[0].content"),
    ("/chat/completions", {"messages": MSG, "metadata": {"k": HOLE}}, "metadata.k"),
    ("/v1/completions", {"prompt": HOLE}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": HOLE}, "stop"),
    ("/v1/responses", {"input": HOLE}, "input"),
    ("/v1/responses", {"input": [{"role": "user", "content": HOLE}]}, "input[0].content"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": HOLE}]},
     "tools[0].parameters"),
    ("/v1/responses", {"input": "hi", "metadata": {"k": HOLE}}, "metadata.k"),
    ("/v1/messages", {**ANTHROPIC, "messages": [{"role": "user", "content": HOLE}]},
     "messages[0].content"),
    ("/v1/messages", {**ANTHROPIC, "tools": [{"name": "f", "input_schema": SCHEMA_WITH_HOLE}]},
     "tools[0].input_schema.x"),
    ("/v1/messages", {**ANTHROPIC, "system": HOLE}, "system"),
    ("/v1/messages/count_tokens", {"model": "claude-test", "messages": [{"role": "user", "content": HOLE}]},
     "messages[0].content"),
    ("/v1/messages/count_tokens", {"model": "claude-test", "messages": MSG, "system": HOLE}, "system"),
    ("/tokenize", {"prompt": HOLE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": HOLE}]}, "messages[0].content"),
    ("/detokenize", {"tokens": HOLE}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": HOLE}, "model"),
]
# (endpoint, body with the hole as a key or a name, the path of the field it names)
NAME_PLACES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": HOLE}]},
     "messages[0].name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": HOLE}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {"name": HOLE}}]},
     "tools[0].function.name"),
    ("/chat/completions", {"messages": MSG, "model": HOLE}, "model"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", HOLE]}, "stop[1]"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": HOLE}]}, "tools[0].name"),
    ("/v1/responses", {"input": "hi", "instructions": HOLE}, "instructions"),
    ("/v1/messages", {**ANTHROPIC, "tools": [{"name": HOLE, "input_schema": {}}]}, "tools[0].name"),
    ("/v1/messages/count_tokens",
     {"model": "claude-test", "messages": [{"role": "user", "content": [{"type": "text", "text": HOLE}]}]},
     "messages[0].content[0].text"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi", "name": HOLE}]}, "messages[0].name"),
]
# (endpoint, body whose object holds the hole as a key, the path of that object)
KEY_PLACES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", HOLE: 1}]}, "messages[0]"),
    ("/v1/chat/completions",
     {"messages": MSG, "tools": [{"type": "function", "function": {
         "name": "f", "parameters": {"type": "object", "properties": {HOLE: {"type": "string"}}}}}]},
     "tools[0].function.parameters.properties"),
    ("/chat/completions", {"messages": MSG, HOLE: 1}, ""),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {HOLE: 1}}, "logit_bias"),
    ("/v1/responses", {"input": "hi", "metadata": {HOLE: "v"}}, "metadata"),
    ("/v1/messages", {**ANTHROPIC, "metadata": {HOLE: "v"}}, "metadata"),
    ("/v1/messages/count_tokens",
     {"model": "claude-test", "messages": MSG, "tools": [{"name": "f", "input_schema": {HOLE: 1}}]},
     "tools[0].input_schema"),
    ("/tokenize", {"prompt": "hi", HOLE: 1}, ""),
    ("/detokenize", {"tokens": [1], "extra": {"k": {HOLE: 1}}}, "extra.k"),
]
LONE_SURROGATES = ["\ud800", "\udfff", "a\udc00b", "\udc00\ud800", "\ud800x", "\udbff\u0041"]


_CLIENT = httpx.Client(timeout=30)  # one connection for the many small requests below


def post_text(server: Server, path: str, text: str) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    return _CLIENT.post(f"{server.base}{path}", content=text.encode(), headers=headers)


def filled(body: dict, value_text: str) -> str:
    """``body`` as JSON text, its hole replaced by ``value_text`` (JSON text)."""
    text = json.dumps(body)
    assert text.count(json.dumps(HOLE)) == 1, text
    return text.replace(json.dumps(HOLE), value_text)


def assert_400_naming(response: httpx.Response, path: str, param: str) -> None:
    """A 400 naming ``param``: its ``param`` (OpenAI), or its message's start (Anthropic)."""
    assert response.status_code == 400, response.text
    assert_error_shape_httpx(response, path)
    body = response.json()
    if path.startswith("/v1/messages"):
        assert re.match(re.escape(param) + "[: ]", body["error"]["message"]), (param, body)
    else:
        assert body["error"]["param"] == param, (param, body)


def place_id(value) -> str:
    return value if isinstance(value, str) and value != HOLE else ""


def nesting_past_the_limit(param: str):
    """(JSON text, expected param) pairs: arrays and objects at ``param`` that reach one
    level past MAX_DEPTH (the body is level 1), and far past it."""
    from api.json_input import MAX_DEPTH

    just = MAX_DEPTH + 1 - levels_of(param)  # containers from the value's level to MAX_DEPTH + 1
    for count in (just, 3000):
        yield "[" * count + "1" + "]" * count, param + "[0]" * (just - 1)
        yield '{"a":' * count + "1" + "}" * count, param + ".a" * (just - 1)


def levels_of(param: str) -> int:
    """How many keys and indexes lead from the body to ``param``'s value."""
    return len(re.findall(r"\[\d+\]|[^.\[\]]+", param))


@pytest.mark.parametrize(("path", "body", "param"), VALUE_PLACES, ids=place_id)
def test_json_nested_too_deep_is_a_400_naming_where(fuzz_server, path, body, param):
    for text, expected in nesting_past_the_limit(param):
        response = post_text(fuzz_server, path, filled(body, text))
        assert_400_naming(response, path, expected)


@pytest.mark.parametrize("path", list(JSON_BODY_ENDPOINTS))
def test_json_nested_to_the_limit_is_served(fuzz_server, path):
    """64 levels (the body is the first) are accepted wherever the request allows JSON."""
    from api.json_input import MAX_DEPTH

    deep = "[" * (MAX_DEPTH - 2) + "1" + "]" * (MAX_DEPTH - 2)  # in {"metadata": {"k": ...}}
    body = {**JSON_BODY_ENDPOINTS[path], "metadata": {"k": HOLE}}
    response = post_text(fuzz_server, path, filled(body, deep))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "body", "param"), VALUE_PLACES + NAME_PLACES, ids=place_id
)
def test_a_lone_surrogate_is_a_400_naming_its_field(fuzz_server, path, body, param):
    for surrogate in LONE_SURROGATES:
        response = post_text(fuzz_server, path, filled(body, json.dumps(surrogate)))
        assert_400_naming(response, path, param)


@pytest.mark.parametrize(("path", "body", "param"), KEY_PLACES, ids=place_id)
def test_a_lone_surrogate_in_a_key_is_a_400_naming_the_key(fuzz_server, path, body, param):
    for surrogate in LONE_SURROGATES:
        key = "[" + json.dumps(surrogate) + "]"  # as paths write keys that are not names
        response = post_text(fuzz_server, path, filled(body, json.dumps(surrogate)))
        assert_400_naming(response, path, param + key)


def test_lone_surrogates_inside_tool_call_arguments_are_400s(fuzz_server):
    """Arguments are JSON inside a JSON string: checked as they are parsed."""
    arguments = json.dumps({"city": "\ud800"})
    chat = {"messages": [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "user", "content": "hi"}], "max_tokens": 1}
    for path in ("/v1/chat/completions", "/tokenize"):
        response = post_text(fuzz_server, path, json.dumps(chat))
        assert_400_naming(response, path, "messages[0].tool_calls[0].function.arguments")
    responses = {"input": [{"type": "function_call", "call_id": "c", "name": "f",
                            "arguments": "[" * 3000 + "]" * 3000}]}
    response = post_text(fuzz_server, "/v1/responses", json.dumps(responses))
    assert_400_naming(response, "/v1/responses", "input[0].arguments")


TOOL_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}
TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "c", "input": {}}]}
NAMED_TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
MISSING_NAMES = [
    *[(path, {"messages": MSG, **fields}, param)
      for path in ("/v1/chat/completions", "/chat/completions")
      for fields, param in [
          ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
          ({"tools": [NAMED_TOOL, {"type": "function", "function": {"name": ""}}]},
           "tools[1].function.name"),
          ({"tools": [{"type": "function"}]}, "tools[0].function"),
          ({"tools": [NAMED_TOOL], "tool_choice": {"type": "function", "function": {}}},
           "tool_choice.function.name"),
          ({"tools": [NAMED_TOOL], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
          ({"messages": [TOOL_CALL, *MSG]}, "messages[0].tool_calls[0].function.name"),
      ]],
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "parameters": {}}]},
     "tools[0].name"),
    ("/v1/responses",
     {"input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]},
     "tools[0].tools[0].name"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ("/v1/responses",
     {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
    *[(path, {**body, **fields}, param)
      for path, body in [("/v1/messages", ANTHROPIC),
                         ("/v1/messages/count_tokens", {"model": "claude-test", "messages": MSG})]
      for fields, param in [
          ({"tools": [{"input_schema": {}}]}, "tools[0].name"),
          ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}},
           "tool_choice.name"),
          ({"messages": [*MSG, TOOL_USE]}, "messages[1].content[0].name"),
      ]],
    ("/tokenize", {"messages": MSG, "tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name"),
    ("/tokenize", {"messages": [TOOL_CALL, *MSG]}, "messages[0].tool_calls[0].function.name"),
]


@pytest.mark.parametrize(("path", "body", "param"), MISSING_NAMES, ids=place_id)
def test_a_missing_name_is_a_400_naming_it(fuzz_server, path, body, param):
    response = post_text(fuzz_server, path, json.dumps(body))
    assert_400_naming(response, path, param)
