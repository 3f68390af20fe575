"""gpt-oss end to end: a scripted gpt_oss model (tests/harmony_model.py) served by a real
server, driven by the official ``openai`` and ``anthropic`` SDKs.

The model's greedy reply is Harmony: an ``analysis`` message, then a
``commentary`` call to ``functions.get_weather`` (ended by ``<|call|>``), and
after the tool's result a ``final`` message. Every endpoint must turn these
into reasoning, a tool call and content, streamed and not, and carry the
reasoning effort into the prompt.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from tests.harmony_model import build_scripted_gpt_oss
from tests.test_server_process import hypercorn_args, spawn_server, stop_server

pytestmark = pytest.mark.server  # starts a hypercorn subprocess

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

THOUGHTS = "The user wants the weather in Oslo, so I call get_weather."
CALL = {"name": "get_weather", "arguments": {"city": "Oslo"}}
ANSWER = "It is 12 degrees and rainy in Oslo."
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS,
                                                "description": "Get the weather in a city."}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS,
                    "description": "Get the weather in a city."}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": PARAMETERS,
                    "description": "Get the weather in a city."}]
QUESTION = "What is the weather in Oslo?"
RESULT = json.dumps({"temperature": 12, "condition": "rainy"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_scripted_gpt_oss(tmp_path_factory.mktemp("scripted-gpt-oss") / "model",
                                  thoughts=THOUGHTS, call=CALL, answer=ANSWER)


@pytest.fixture(scope="module")
def server(model_dir):
    env = {"MLX_TRIO_MODEL": str(model_dir), "MLX_TRIO_MAX_TOKENS": "64"}
    proc, base = spawn_server(hypercorn_args, env)
    yield base
    stop_server(proc)


def effort_tokens(model_dir, level: str) -> int:
    """How many tokens the template's effort line takes at ``level``."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return len(tokenizer.encode(f"\nReasoning: {level}\n\n#").ids)


# ------------------------------------------------------------------ chat completions


def test_chat_tool_round_trip(oai):
    messages = [{"role": "user", "content": QUESTION}]
    first = oai.chat.completions.create(model="default_model", messages=messages,
                                        tools=CHAT_TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content is None
    assert message.model_extra["reasoning_content"] == THOUGHTS
    assert message.model_extra["reasoning"] == THOUGHTS
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL["arguments"]
    assert "<|" not in json.dumps(first.model_dump())  # no Harmony markup leaks

    messages += [
        {"role": "assistant", "content": None, "reasoning_content": THOUGHTS,
         "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    second = oai.chat.completions.create(model="default_model", messages=messages,
                                         tools=CHAT_TOOLS)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == ANSWER
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_chat_streaming_gives_reasoning_then_the_call(oai):
    stream = oai.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": QUESTION}],
        tools=CHAT_TOOLS, stream=True)
    reasoning, content, calls, finish, order, call_deltas = [], [], {}, None, [], []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.model_extra.get("reasoning_content"):
            reasoning.append(delta.model_extra["reasoning_content"])
            order.append("reasoning")
        if delta.content:
            content.append(delta.content)
        for tc in delta.tool_calls or ():
            call_deltas.append(tc)
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
            order.append("call")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(reasoning) == THOUGHTS
    assert "".join(content) == ""
    assert list(calls.values()) == [{"name": "get_weather",
                                     "arguments": json.dumps(CALL["arguments"])}]
    assert order.index("call") > order.index("reasoning")
    assert finish == "tool_calls"
    # the first delta of the call names it; any later one carries arguments alone
    assert call_deltas[0].id and call_deltas[0].function.name == "get_weather"
    assert all(tc.id is None and tc.function.name is None for tc in call_deltas[1:])


def test_chat_reasoning_effort_reaches_the_template(oai, model_dir):
    def prompt_tokens(**extra):
        return oai.chat.completions.create(
            model="default_model", messages=[{"role": "user", "content": QUESTION}],
            max_tokens=1, **extra).usage.prompt_tokens

    default = prompt_tokens()
    for level in ("low", "high"):
        expected = effort_tokens(model_dir, level) - effort_tokens(model_dir, "medium")
        assert prompt_tokens(reasoning_effort=level) - default == expected
    # "minimal" is gpt-oss's "low"; an unknown level is a 400 naming the field
    assert prompt_tokens(reasoning_effort="minimal") == prompt_tokens(reasoning_effort="low")
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        prompt_tokens(reasoning_effort="extreme")


# ------------------------------------------------------------------ Responses


def test_responses_tool_round_trip_streamed_and_not(oai, model_dir):
    first = oai.responses.create(model="default_model", input=QUESTION, tools=RESPONSES_TOOLS)
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == THOUGHTS
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == CALL["arguments"]

    result = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    follow = oai.responses.create(model="default_model", previous_response_id=first.id,
                                  input=[result], tools=RESPONSES_TOOLS)
    assert follow.output_text == ANSWER
    assert [item.type for item in follow.output] == ["message"]

    with oai.responses.stream(model="default_model", input=QUESTION,
                              tools=RESPONSES_TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert "response.reasoning_text.delta" in types
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == json.dumps(CALL["arguments"])
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.name == "get_weather" and done.arguments == "".join(pieces)
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[1].name == "get_weather"

    def input_tokens(effort):
        return oai.responses.create(model="default_model", input=QUESTION,
                                    reasoning={"effort": effort},
                                    max_output_tokens=16).usage.input_tokens

    expected = effort_tokens(model_dir, "high") - effort_tokens(model_dir, "low")
    assert input_tokens("high") - input_tokens("low") == expected


# ------------------------------------------------------------------ Messages


def test_messages_tool_round_trip_streamed_and_not(ant, model_dir):
    question = [{"role": "user", "content": QUESTION}]
    first = ant.messages.create(model="default_model", max_tokens=64, messages=question,
                                tools=ANTHROPIC_TOOLS)
    assert first.stop_reason == "tool_use"
    assert [block.type for block in first.content] == ["thinking", "tool_use"]
    assert first.content[0].thinking == THOUGHTS
    use = first.content[1]
    assert use.name == "get_weather" and use.input == CALL["arguments"]

    follow_up = question + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": RESULT}]},
    ]
    second = ant.messages.create(model="default_model", max_tokens=64, messages=follow_up,
                                 tools=ANTHROPIC_TOOLS)
    assert second.stop_reason == "end_turn"
    assert [block.type for block in second.content] == ["text"]
    assert second.content[0].text == ANSWER

    with ant.messages.stream(model="default_model", max_tokens=64, messages=question,
                             tools=ANTHROPIC_TOOLS) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    pieces = [e.delta.partial_json for e in events
              if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert json.loads("".join(pieces)) == CALL["arguments"]
    assert [block.type for block in streamed.content] == ["thinking", "tool_use"]
    assert streamed.content[0].thinking == THOUGHTS
    assert streamed.content[1].input == CALL["arguments"]

    def input_tokens(thinking):
        return ant.messages.count_tokens(model="default_model", messages=question,
                                         thinking=thinking).input_tokens

    low = input_tokens({"type": "disabled"})
    high = input_tokens({"type": "enabled", "budget_tokens": 32000})
    assert high - low == effort_tokens(model_dir, "high") - effort_tokens(model_dir, "low")
