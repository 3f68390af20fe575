"""The OpenAPI document, and schemathesis fuzzing a real Hypercorn server with it.

``api.openapi.openapi_document()`` must be valid OpenAPI 3.1, and its
``RANGES`` table must say what ``validate()`` does (each bound accepted, just
past it rejected, through ``structure_or_400``). Then schemathesis generates
valid and invalid requests from the document (its fuzzing and coverage
phases, positive and negative) against ``hypercorn api:app`` on the tiny
model, and every answer must be: no 5xx; a 2xx JSON body that conforms to the
document, or a 200 SSE stream ending in ``data: [DONE]``; any other status an
``{"error": {message, type, param, code}}`` JSON body. ``/health`` is 200
afterwards, with nothing left running.

Bounded for CI: ``MLX_TRIO_MAX_TOKENS=4``, generated ``max_tokens`` /
``max_completion_tokens`` above 8 lowered to 8 (invalid values are sent as
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

from api import responses, schemas
from api.convert import structure_or_400
from api.openapi import RANGES, openapi_document
from api.schemas import ChatCompletionRequest, CompletionRequest
from runtime.errors import ClientError
from tests.conftest import wait_healthy
from tests.test_server_process import free_port

MAX_EXAMPLES = 30
SEED = int(os.environ.get("FUZZ_SEED", "20240611"))  # another seed explores other inputs
TOKEN_CAP = 8
FUZZED = ["createChatCompletion", "createCompletion", "listModels", "health"]
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
        responses.ChatCompletion,
        responses.ChatCompletionChunk,
        responses.TextCompletion,
        responses.ModelList,
        responses.ModelCard,
        responses.UsageOut,
    ],
    ids=lambda cls: cls.__name__,
)
def test_components_follow_the_attrs_types(cls):
    component = openapi_document()["components"]["schemas"][cls.__name__]
    fields = attrs.fields(cls)
    assert list(component["properties"]) == [f.name for f in fields]
    without_default = {f.name for f in fields if f.default is attrs.NOTHING}
    assert without_default <= set(component.get("required", []))


def _range_cases():
    for name, (low, high) in RANGES.items():
        cls = CompletionRequest if name == "logprobs" else ChatCompletionRequest
        for bound, outside in ((low, -1), (high, +1)):
            if bound is not None:
                yield pytest.param(cls, name, bound, outside, id=f"{name}={bound}")


def _body(cls, name, value):
    base = (
        {"prompt": "hi"} if cls is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    )
    if name == "logit_bias":
        value = {"7": value}
    return {**base, name: value}


def _is_integer(cls, name) -> bool:
    prop = openapi_document()["components"]["schemas"][cls.__name__]["properties"][name]
    kinds = prop.get("type")
    return "integer" in (kinds if isinstance(kinds, list) else [kinds])


@pytest.mark.parametrize(("cls", "name", "bound", "direction"), list(_range_cases()))
def test_ranges_table_matches_validate(cls, name, bound, direction):
    """Each bound in RANGES is accepted, and a value just past it is rejected."""
    structure_or_400(_body(cls, name, bound), cls)
    outside = bound + direction if _is_integer(cls, name) else bound + direction * 1e-6
    with pytest.raises(ClientError) as caught:
        structure_or_400(_body(cls, name, outside), cls)
    assert caught.value.param == name, caught.value.message


def test_every_validated_range_is_in_the_table():
    """A new ``_range("field", ...)`` in api/schemas.py needs a RANGES entry."""
    import api.schemas

    source = Path(api.schemas.__file__).read_text()
    validated = set(re.findall(r'_range\(\s*"(\w+)"', source))
    # logit_bias values go through _range(f"logit_bias.{key}"), n through "n != 1"
    assert validated | {"logit_bias", "n"} == set(RANGES)


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
    for key in ("max_tokens", "max_completion_tokens"):
        if _integral(body.get(key)) and body[key] > TOKEN_CAP:
            body[key] = TOKEN_CAP


def content_type(response) -> str:
    return (response.headers.get("content-type") or [""])[0]


def assert_error_shape(response) -> None:
    assert content_type(response).startswith("application/json"), response.text
    body = json.loads(response.text)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and isinstance(error["type"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


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
            assert response.text.endswith("data: [DONE]\n\n"), response.text[-500:]
            return
        case.validate_response(response, checks=JSON_CHECKS)
        if not 200 <= response.status_code < 300:
            assert_error_shape(response)
    except Exception as exc:
        exc.add_note(f"server log:\n{fuzz_server.log_tail()}")
        raise


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


# ------------------------------------------------------- known server bugs
#
# Found by fuzzing and by probing what the fuzzing hinted at; each asserts
# the right answer (they were 500s or a crash before the fix). They
# run after the fuzzing (a failed engine step fails every sequence in it).

CHAT_HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base}{path}", json=body, timeout=30)


def assert_400(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    assert_error_shape_httpx(response)
    assert response.json()["error"]["param"] == param, response.text


def assert_error_shape_httpx(response: httpx.Response) -> None:
    assert response.headers.get("Content-Type", "").startswith("application/json"), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error


def test_huge_prompt_token_id_does_not_kill_the_server(tiny_model_path, tmp_path):
    """Once a segmentation fault: an id >= 2**31 reached the model's embedding."""
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
    """Once served (200) from an out-of-bounds embedding read."""
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


def test_chat_template_kwargs_cannot_untokenize_the_prompt(fuzz_server):
    body = {**CHAT_HI, "chat_template_kwargs": {"tokenize": False}}
    response = post(fuzz_server, "/v1/chat/completions", body)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert_error_shape_httpx(response)
