"""The agent APIs against a real server, driven by the official ``openai`` and ``anthropic`` SDKs.

One ``hypercorn api:app`` subprocess on loopback serves the trained demo model
(it calls get_weather, answers from tool results and thinks on arithmetic;
docs/demo-model.md) for the whole module, greedy, with prompts processed 32
tokens a step so prompt processing takes several steps (``ping`` events).
"""

from __future__ import annotations

import json
import pathlib

import httpx
import pytest

from tests.test_server_process import hypercorn_args, spawn_server, stop_server

pytestmark = pytest.mark.server  # starts a hypercorn subprocess

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

DEMO_DIR = pathlib.Path(__file__).resolve().parents[1] / "demo_model" / "mlx-trio-demo"

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS,
                    "description": "Get the current weather in a city."}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": WEATHER_PARAMETERS,
                    "description": "Get the current weather in a city."}]


@pytest.fixture(scope="module")
def server():
    env = {"MLX_TRIO_MODEL": str(DEMO_DIR), "MLX_TRIO_MAX_TOKENS": "80",
           "MLX_TRIO_PREFILL_STEP_SIZE": "32"}
    proc, base = spawn_server(hypercorn_args, env)
    yield base
    stop_server(proc)


# ------------------------------------------------------------------ Responses


def test_responses_basic_with_reasoning(oai):
    response = oai.responses.create(model="default_model", input="What is 47 + 85?")
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == (
        "47 + 85: units 7 + 5 = 12, tens 4 + 8 + 1 = 13, so 132"
    )
    assert response.output_text == "132"
    assert response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    # stored: GET returns the same response, DELETE removes it
    again = oai.responses.retrieve(response.id)
    assert again.output_text == "132" and again.id == response.id
    oai.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response.id)


def test_responses_streaming_events(oai):
    stream = oai.responses.create(
        model="default_model", instructions="Answer briefly.", input="What is 23 - 58?", stream=True
    )
    events = list(stream)
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    expected_order = [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
    ]
    deduped = [t for i, t in enumerate(types[2:-1]) if i == 0 or t != types[2:-1][i - 1]]
    assert deduped == expected_order
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert text == final.output_text == "-35"
    assert reasoning == final.output[0].content[0].text
    assert final.usage.output_tokens > 0
    # the SDK's own accumulator agrees
    with oai.responses.stream(model="default_model", input="What is 23 - 58?") as s:
        assert s.get_final_response().output_text == "-35"


def test_responses_tool_round_trip_and_previous_response_cache(oai):
    first = oai.responses.create(
        model="default_model", input="What's the weather in Stockholm?", tools=RESPONSES_TOOLS
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Stockholm"}
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"temperature": 12, "condition": "rainy"})}
    follow = oai.responses.create(
        model="default_model", previous_response_id=first.id, input=[result], tools=RESPONSES_TOOLS
    )
    assert follow.output_text == "It is 12 degrees and rainy in Stockholm."
    assert follow.previous_response_id == first.id
    # The earlier turn is rebuilt exactly: its whole prompt comes from the prompt cache.
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # Resending the history by hand gives the same prompt.
    by_hand = oai.responses.create(
        model="default_model", tools=RESPONSES_TOOLS,
        input=[{"role": "user", "content": "What's the weather in Stockholm?"},
               *[item.model_dump(exclude_none=True) for item in first.output], result],
    )
    assert by_hand.usage.input_tokens == follow.usage.input_tokens
    assert by_hand.output_text == follow.output_text


def test_responses_streamed_tool_call(oai):
    with oai.responses.stream(model="default_model", input="What's the weather in Lima?",
                              tools=RESPONSES_TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args) == json.loads(done.arguments) == {"city": "Lima"}
    assert final.output[0].type == "function_call" and final.output[0].name == "get_weather"


def test_responses_max_output_tokens_is_incomplete(oai):
    response = oai.responses.create(model="default_model", input="What is 47 + 85?", max_output_tokens=5)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5
    events = list(oai.responses.create(model="default_model", input="What is 47 + 85?",
                                       max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.type == "reasoning" and done.item.status == "incomplete"  # cut mid-thought
    assert events[-1].response.output[0].status == "incomplete"


def test_responses_errors(oai, server):
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="default_model", input="x", tools=[{"type": "file_search"}])
    assert info.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="default_model", input="x", background=True)
    assert info.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="default_model", input="x", previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="gpt-unknown", input="x")
    r = httpx.post(f"{server}/v1/responses", json={"input": 5}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


# ------------------------------------------------------------------ Anthropic


def test_messages_basic(ant):
    message = ant.messages.create(
        model="claude-opus-4-8", max_tokens=100, messages=[{"role": "user", "content": "Hello"}]
    )
    assert message.model == "claude-opus-4-8"  # an unknown Claude name is served by the default model
    assert message.content[0].type == "text"
    assert message.content[0].text == "Hello! How can I help you today?"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens > 0


def test_messages_thinking_on_and_off(ant):
    thinking = ant.messages.create(
        model="claude-sonnet-4-5", max_tokens=100, thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "What is 23 - 58?"}],
    )
    assert [b.type for b in thinking.content] == ["thinking", "text"]
    assert thinking.content[1].text == "-35"
    plain = ant.messages.create(
        model="claude-sonnet-4-5", max_tokens=100, thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "What is 23 - 58?"}],
    )
    # Without thinking, the demo model answers with its working, ending in the result.
    assert [b.type for b in plain.content] == ["text"]
    assert plain.content[0].text.endswith("so -35")


def test_messages_stop_sequences_and_max_tokens(ant):
    stopped = ant.messages.create(
        model="claude-opus-4-8", max_tokens=100, stop_sequences=["help", "zzz"],
        messages=[{"role": "user", "content": "Hello"}],
    )
    assert stopped.content[0].text == "Hello! How can I"
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "help"
    cut = ant.messages.create(model="claude-opus-4-8", max_tokens=3,
                              messages=[{"role": "user", "content": "Hello"}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_messages_tool_use_round_trip(ant):
    question = {"role": "user", "content": "What's the weather in Athens?"}
    first = ant.messages.create(model="claude-opus-4-8", max_tokens=100, tools=ANTHROPIC_TOOLS,
                                messages=[question])
    assert first.stop_reason == "tool_use"
    (tool_use,) = first.content
    assert tool_use.type == "tool_use" and tool_use.name == "get_weather"
    assert tool_use.input == {"city": "Athens"}
    result = {"type": "tool_result", "tool_use_id": tool_use.id,
              "content": json.dumps({"temperature": 25, "condition": "sunny"})}
    second = ant.messages.create(
        model="claude-opus-4-8", max_tokens=100, tools=ANTHROPIC_TOOLS,
        messages=[question, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [result]}],
    )
    assert second.content[0].text == "It is 25 degrees and sunny in Athens."
    assert second.stop_reason == "end_turn"
    assert second.usage.cache_read_input_tokens > 0  # the first turn's prompt, from the cache


def test_messages_stream_text_and_tool_use(ant):
    with ant.messages.stream(model="claude-opus-4-8", max_tokens=100,
                             messages=[{"role": "user", "content": "Hello"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == "Hello! How can I help you today?"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    with ant.messages.stream(model="claude-opus-4-8", max_tokens=100, tools=ANTHROPIC_TOOLS,
                             messages=[{"role": "user", "content": "What's the weather in Seoul?"}]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Seoul"}
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "input_json" in events and "message_delta" in events


def test_messages_stream_pings_while_the_prompt_is_processed(server):
    long_prompt = "Hello. " + " ".join(f"word{i}" for i in range(300))
    body = {"model": "claude-opus-4-8", "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": long_prompt}]}
    with httpx.stream("POST", f"{server}/v1/messages?beta=true", json=body, timeout=120,
                      headers={"x-api-key": "k", "anthropic-version": "2023-06-01",
                               "anthropic-beta": "interleaved-thinking-2025-05-14"}) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    names = [line.removeprefix("event: ") for line in raw.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start"
    # The reply may be whitespace only (no text block is opened for it): count the
    # pings before whatever follows them.
    first_other = next(i for i, name in enumerate(names) if i > 0 and name != "ping")
    assert names[1:first_other].count("ping") >= 3  # 300+ tokens, 32 a step
    assert names[-2:] == ["message_delta", "message_stop"]


def test_count_tokens_matches_the_prompt(ant):
    messages = [{"role": "user", "content": "What's the weather in Oslo?"}]
    counted = ant.messages.count_tokens(model="claude-opus-4-8", messages=messages, tools=ANTHROPIC_TOOLS)
    served = ant.messages.create(model="claude-opus-4-8", max_tokens=100, messages=messages,
                                 tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == served.usage.input_tokens + served.usage.cache_read_input_tokens
    assert counted.input_tokens > ant.messages.count_tokens(model="claude-x", messages=messages).input_tokens


def test_messages_errors_in_anthropic_shape(ant, server):
    with pytest.raises(anthropic.BadRequestError) as info:
        ant.messages.create(model="claude-opus-4-8", max_tokens=0,
                            messages=[{"role": "user", "content": "x"}])
    assert info.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens must be at least 1, got 0"}}
    with pytest.raises(anthropic.BadRequestError) as info:
        ant.messages.create(model="claude-opus-4-8", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}])
    assert info.value.body["error"]["message"].startswith("messages[0].content[0]: images are")
    with pytest.raises(anthropic.NotFoundError) as info:
        ant.messages.create(model="gpt-unknown", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server}/v1/messages", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(f"{server}/v1/messages", json={"model": "claude-x", "messages": []}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens: is required"
    huge = b'{"model": "claude-x", "max_tokens": 1, "messages": [{"role": "user", "content": "' + (
        b"x" * (9 * 2**20)) + b'"}]}'
    r = httpx.post(f"{server}/v1/messages", content=huge, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/messages", 405), ("DELETE", "/v1/messages/count_tokens", 405),
     ("POST", "/v1/messages/batches", 404), ("GET", "/v1/messages/x/y", 404)],
)
def test_routing_errors_under_messages_in_anthropic_shape(server, method, path, status):
    r = httpx.request(method, f"{server}{path}", timeout=10)
    assert r.status_code == status
    kind = {404: "not_found_error", 405: "invalid_request_error"}[status]
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
    assert set(r.json()["error"]) == {"type", "message"}


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/responses", 405), ("GET", "/v1/messagesx", 404), ("POST", "/v1/nothing", 404)],
)
def test_routing_errors_elsewhere_in_openai_shape(server, method, path, status):
    r = httpx.request(method, f"{server}{path}", timeout=10)
    assert r.status_code == status
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}
