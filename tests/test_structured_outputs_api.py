"""Structured outputs and enforced tool choice through the app (Quart's test client).

The trained demo model (it calls get_weather / get_time and thinks on
arithmetic: docs/demo-model.md) on the engine thread, and the tiny random
model in an engine process (the constraint crosses the process boundary):
``response_format`` on chat completions, ``text.format`` and ``tool_choice``
on the Responses API, ``tool_choice`` and ``disable_parallel_tool_use`` on
Anthropic Messages; ``enable_thinking: false``; the 400s that name what
cannot be enforced; a budget too small for the document.
"""

from __future__ import annotations

import json
import pathlib

import jsonschema
import pytest

from api.server import create_app
from runtime.config import ServerConfig
from tests.conftest import TIME, WEATHER, wait_ready
from tests.test_api import parse_sse, stream_post

DEMO_DIR = pathlib.Path(__file__).resolve().parents[1] / "demo_model" / "mlx-trio-demo"
CHAT = "/v1/chat/completions"

TOOLS = [WEATHER, TIME]
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # Responses
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]

REPORT = {"type": "object", "additionalProperties": False, "required": ["city", "temp", "sky"],
          "properties": {"city": {"type": "string", "maxLength": 16},
                         "temp": {"type": "integer", "minimum": -40, "maximum": 45},
                         "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}}}
# Bounded: unbounded, a model not trained on JSON writes an integer's 19 digits.
SUM = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0,
                                                   "maximum": 999}},
       "required": ["answer"], "additionalProperties": False}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


async def _client(config: ServerConfig):
    app = create_app(config)
    async with app.test_app() as test_app:
        c = test_app.test_client()
        await wait_ready(c)
        yield c


@pytest.fixture
async def demo():
    # any local model: a request may name the demo model as its own draft model
    async for c in _client(ServerConfig(model=str(DEMO_DIR), max_tokens=64,
                                        engine_mode="thread", allowed_models=("*",))):
        yield c


@pytest.fixture
async def tiny(tiny_model_path):  # the engine in its own process (the default)
    async for c in _client(ServerConfig(model=tiny_model_path, max_tokens=64)):
        yield c


async def post(client, path, body):
    response = await client.post(path, json=body)
    return response.status_code, await response.get_json()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def json_schema(schema, name="report") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# ------------------------------------------------------------ chat completions


async def test_chat_response_format_json_schema_and_json_object(demo):
    body = {"messages": user("The weather in Oslo, as JSON."),
            "response_format": json_schema(REPORT)}
    status, data = await post(demo, CHAT, body)
    assert status == 200, data
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), REPORT)

    status, _, raw = await stream_post(demo, CHAT, {**body, "stream": True})
    payloads, _, done = parse_sse(raw)
    assert status == 200 and done
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p["choices"])
    jsonschema.validate(json.loads(text), REPORT)

    # json_object: an object. The demo model was never taught JSON: with free
    # strings it may ramble inside one until max_tokens; then the text so far is
    # an object's beginning (unconstrained, it answers in words).
    status, data = await post(demo, CHAT, {"messages": user("The weather in Oslo, as JSON."),
                                           **NO_THINKING, "max_tokens": 48,
                                           "response_format": {"type": "json_object"}})
    assert status == 200
    choice = data["choices"][0]
    content = choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert choice["finish_reason"] == "length" and content.lstrip().startswith("{"), content


async def test_chat_tool_choice_required_named_and_none(demo):
    time_question = user("What time is it in Tokyo?")
    # required: a call even where the model would only chat
    status, data = await post(demo, CHAT, {"messages": user("Hello"), "tools": TOOLS,
                                           "tool_choice": "required"})
    assert status == 200
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]
    # named: that function, although the model would call get_time
    status, data = await post(demo, CHAT, {"messages": time_question, "tools": TOOLS})
    assert data["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    status, data = await post(demo, CHAT, {"messages": time_question, "tools": TOOLS,
                                           "tool_choice": {"type": "function",
                                                           "function": {"name": "get_weather"}}})
    [call] = data["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    # none: no call, although the model would make one (it writes something else)
    status, data = await post(demo, CHAT, {"messages": time_question, "tools": TOOLS,
                                           "tool_choice": "none"})
    choice = data["choices"][0]
    assert status == 200 and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "stop"
    text = (choice["message"]["content"] or "") + (choice["message"].get("reasoning") or "")
    assert text and "<tool_call>" not in text


async def test_thinking_first_unless_the_client_turns_it_off(demo):
    question = user("What is 47 + 85?")
    status, data = await post(demo, CHAT, {"messages": question, "max_tokens": 128,
                                           "response_format": json_schema(SUM, "sum")})
    message = data["choices"][0]["message"]
    assert status == 200 and "132" in message["reasoning"]  # thought freely first
    jsonschema.validate(json.loads(message["content"]), SUM)
    status, data = await post(demo, CHAT, {
        "messages": question, "response_format": json_schema(SUM, "sum"), **NO_THINKING})
    message = data["choices"][0]["message"]
    assert status == 200 and not message.get("reasoning")
    jsonschema.validate(json.loads(message["content"]), SUM)


async def test_a_budget_too_small_ends_with_length_and_the_partial_document(demo):
    # 8 tokens: at most 4 of leading whitespace (the grammar's cap), then the document's
    # start; the shortest REPORT document is far longer.
    status, data = await post(demo, CHAT, {"messages": user("Weather as JSON"), "max_tokens": 8,
                                           "response_format": json_schema(REPORT)})
    choice = data["choices"][0]
    assert status == 200 and choice["finish_reason"] == "length"
    assert choice["message"]["content"].lstrip().startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])
    assert data["usage"]["completion_tokens"] == 8


async def test_documents_are_written_one_way_unless_the_schema_asks_and_strict_closes(demo):
    # no additionalProperties: strict closes the object; the text is json.dumps's own
    open_report = {k: v for k, v in REPORT.items() if k != "additionalProperties"}
    body = {"messages": user("The weather in Oslo, as JSON."), **NO_THINKING,
            "response_format": json_schema(open_report)}
    status, data = await post(demo, CHAT, body)
    assert status == 200, data
    content = data["choices"][0]["message"]["content"].lstrip()
    document = json.loads(content)
    jsonschema.validate(document, REPORT)
    assert content == json.dumps(document)
    # llguidance's whitespace options, from the schema's own top-level x-guidance: the
    # demo model pads every gap it may (its reply runs to max_tokens in whitespace)
    flexible = {**open_report, "x-guidance": {"whitespace_flexible": True}}
    status, data = await post(demo, CHAT, {**body, "response_format": json_schema(flexible)})
    assert status == 200, data
    assert data["choices"][0]["message"]["content"].lstrip().startswith("{  ")
    lenient = {**open_report, "x-guidance": {"lenient": True}}
    status, data = await post(demo, CHAT, {**body, "response_format": json_schema(lenient)})
    assert status == 400
    assert data["error"]["param"] == "response_format.json_schema.schema.x-guidance.lenient"


# ---------------------------------------------------------------- Responses


async def test_responses_text_format_and_tool_choice(demo):
    fmt = {"type": "json_schema", "name": "report", "schema": REPORT, "strict": True}
    status, data = await post(demo, "/v1/responses", {"input": "The weather in Oslo, as JSON.",
                                                      "text": {"format": fmt}})
    assert status == 200 and data["status"] == "completed", data
    [message] = [item for item in data["output"] if item["type"] == "message"]
    jsonschema.validate(json.loads(message["content"][0]["text"]), REPORT)
    assert data["text"]["format"]["type"] == "json_schema"

    async def calls(tool_choice, text="What time is it in Tokyo?", **extra):
        status, data = await post(demo, "/v1/responses", {
            "input": text, "tools": FLAT_TOOLS, "tool_choice": tool_choice, **extra})
        assert status == 200, data
        return [item for item in data["output"] if item["type"] == "function_call"], data

    found, _ = await calls("required", "Hello")
    assert found
    found, _ = await calls({"type": "function", "name": "get_weather"})
    assert [c["name"] for c in found] == ["get_weather"]
    found, data = await calls("none")
    texts = [part["text"] for item in data["output"] if item["type"] != "function_call"
             for part in item["content"]]
    assert not found and texts and not any("<tool_call>" in t for t in texts)


# ---------------------------------------------------------------- Anthropic


async def test_anthropic_tool_choice_any_tool_none_and_one_call_only(demo):
    async def blocks(tool_choice, text="What time is it in Tokyo?"):
        status, data = await post(demo, "/v1/messages", {
            "model": "claude-x", "max_tokens": 64, "messages": user(text),
            "tools": ANTHROPIC_TOOLS, "tool_choice": tool_choice})
        assert status == 200, data
        return data

    data = await blocks({"type": "any"}, "Hello")
    assert data["stop_reason"] == "tool_use"
    assert any(b["type"] == "tool_use" for b in data["content"])
    data = await blocks({"type": "tool", "name": "get_weather"})
    uses = [b for b in data["content"] if b["type"] == "tool_use"]
    assert [u["name"] for u in uses] == ["get_weather"] and "city" in uses[0]["input"]
    data = await blocks({"type": "none"})
    assert data["stop_reason"] == "end_turn"
    assert not [b for b in data["content"] if b["type"] == "tool_use"]
    data = await blocks({"type": "any", "disable_parallel_tool_use": True},
                        "What is the weather in Oslo and in Rome?")
    assert len([b for b in data["content"] if b["type"] == "tool_use"]) == 1


# ------------------------------------------------------------------- refusals


async def test_unsupported_schema_features_are_400s_naming_them_in_every_api(demo):
    bad = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    status, data = await post(demo, CHAT, {"messages": user("x"),
                                           "response_format": json_schema(bad)})
    assert status == 400
    assert data["error"]["param"] == "response_format.json_schema.schema"
    assert "uniqueItems" in data["error"]["message"]
    status, data = await post(demo, "/v1/responses", {"input": "x", "text": {"format": {
        "type": "json_schema", "name": "n", "schema": bad}}})
    assert status == 400 and data["error"]["param"] == "text.format.schema"
    assert "uniqueItems" in data["error"]["message"]
    status, data = await post(demo, "/v1/messages", {
        "model": "claude-x", "max_tokens": 8, "messages": user("x"), "tool_choice": {"type": "any"},
        "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"x": bad}}}]})
    assert status == 400 and data["type"] == "error"
    assert "uniqueItems" in data["error"]["message"]
    # malformed fields, at the edge
    for body, param in [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]:
        status, data = await post(demo, CHAT, {"messages": user("x"), **body})
        assert (status, data["error"]["param"]) == (400, param), data


async def test_constraints_cross_to_the_engine_process(tiny):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    for _ in range(2):
        status, data = await post(tiny, CHAT, {
            "messages": user("JSON please"), "max_tokens": 48, "temperature": 0.7,
            "top_p": 0.9, "response_format": json_schema(schema)})
        assert status == 200, data
        assert data["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(data["choices"][0]["message"]["content"]), schema)


async def test_tool_choice_on_a_model_without_a_constrainable_tool_format(tiny_model_path):
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    config = ServerConfig(model=tiny_model_path, chat_template=plain, engine_mode="thread")
    async for client in _client(config):
        status, data = await post(client, CHAT, {"messages": user("x"), "tools": TOOLS,
                                                 "tool_choice": "required"})
        assert status == 400 and data["error"]["param"] == "tool_choice"
        assert "tool-call format" in data["error"]["message"]
        # auto stays free, and a JSON reply can still be enforced
        status, _ = await post(client, CHAT, {"messages": user("x"), "tools": TOOLS,
                                              "max_tokens": 4})
        assert status == 200


async def test_speculative_decoding_refuses_constraints_by_name(demo):
    status, data = await post(demo, CHAT, {
        "messages": user("x"), "draft_model": str(DEMO_DIR), "max_tokens": 4,
        "response_format": {"type": "json_object"}})
    assert status == 400 and data["error"]["param"] == "response_format"
    assert "draft model" in data["error"]["message"]


def test_a_constraint_asked_again_is_not_compiled_again(tiny_tokenizer, monkeypatch):
    """The same fields (and prompt state) give the spec compiled before; other fields,
    another state or another tokenizer compile; refusals are not kept; bounded."""
    import api.structured as structured
    from runtime.errors import ClientError
    from runtime.messages import PreparedPrompt, SegmentPlan

    compiled = []
    real = structured.compile_constraint

    def counting(tokenizer, **fields):
        compiled.append(fields)
        return real(tokenizer, **fields)

    monkeypatch.setattr(structured, "compile_constraint", counting)
    prompt = PreparedPrompt(tokens=(1,), plan=SegmentPlan(segments=((1,),), segment_types=("user",)))
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    weather = {"type": "json_schema", "json_schema": {"name": "w", "schema": city}}
    step = structured.constrain_step(response_format=weather)
    assert step.recent(tiny_tokenizer, prompt) is None  # only looks: compiles nothing
    first = step(tiny_tokenizer, prompt)
    assert step.recent(tiny_tokenizer, prompt) is first
    assert step(tiny_tokenizer, prompt) is first
    assert structured.constrain_step(response_format=json.loads(json.dumps(weather)))(
        tiny_tokenizer, prompt) is first  # equal fields from another request
    assert len(compiled) == 1
    other = structured.constrain_step(response_format={"type": "json_object"})(tiny_tokenizer, prompt)
    assert other is not first and len(compiled) == 2
    bad = structured.constrain_step(response_format={
        "type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "nonsense"}}})
    for _ in range(2):
        with pytest.raises(ClientError):
            bad(tiny_tokenizer, prompt)
    assert len(compiled) == 4  # a refusal is compiled (and refused) each time
    monkeypatch.setattr(structured, "COMPILED_CONSTRAINTS", 1)
    names = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "array", "items": {"type": "string"}}}}
    structured.constrain_step(response_format=names)(tiny_tokenizer, prompt)
    assert len(compiled) == 5
    step(tiny_tokenizer, prompt)  # pushed out by the newest: compiled again
    assert len(compiled) == 6
