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
generated), ``max_examples=30`` per operation, a fixed seed.
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

from api.convert import structure_or_400
from api.openapi import RANGES, openapi_document
from api.schemas import ChatCompletionRequest, CompletionRequest
from runtime.errors import ClientError
from tests.test_server_process import free_port

MAX_EXAMPLES = 30
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
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"server did not start:\n{self.log_tail()}")
            time.sleep(0.1)

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
            "seed": 20240611,
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


def shorten(body, vocab_size: int) -> None:
    """Make a generated body cheap to serve, and keep it off the known crash.

    Token limits above TOKEN_CAP become TOKEN_CAP (anything else, invalid
    values included, is sent as generated). Token ids in a ``prompt`` list are
    folded into the vocabulary: an id outside it can crash the server
    (``test_out_of_vocabulary_prompt_token_is_a_400``); drop the folding when
    that passes.
    """
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if _integral(body.get(key)) and body[key] > TOKEN_CAP:
            body[key] = TOKEN_CAP
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        body["prompt"] = [
            type(t)(int(t) % vocab_size) if _integral(t) and not 0 <= t < vocab_size else t
            for t in prompt
        ]


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
def test_fuzz_server(case, fuzz_server, vocab_size):
    shorten(case.body, vocab_size)
    import collections; STATS.setdefault(case.operation.label, collections.Counter())
    try:
        response = case.call(base_url=fuzz_server.base)
    except requests.ConnectionError as exc:
        exc.add_note(f"server alive: {fuzz_server.alive()}; its log:\n{fuzz_server.log_tail()}")
        raise
    STATS[case.operation.label][str((response.status_code, (case.body or {}).get("stream") if isinstance(case.body, dict) else None, case.meta.phase.name.value if case.meta else None, case.meta.generation.mode.value if case.meta else None))] += 1
    if response.status_code == 400 and case.meta and case.meta.generation.mode.value == "positive": print("POS400", json.dumps(case.body)[:300], response.text[:200])
    if content_type(response).startswith("text/event-stream"):
        # Not JSON: an SSE stream is only ever a 200, and it must end.
        case.validate_response(response, checks=[not_a_server_error])
        assert response.status_code == 200, response.text
        assert response.text.endswith("data: [DONE]\n\n"), response.text[-500:]
        return
    case.validate_response(response, checks=JSON_CHECKS)
    if not 200 <= response.status_code < 300:
        assert_error_shape(response)


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
STATS = {}
def test_zz_print():
    for k, v in STATS.items():
        print(k, sum(v.values()))
        for kk, n in sorted(v.items(), key=str): print("   ", kk, n)
