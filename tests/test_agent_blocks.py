"""The agent APIs' sans-IO parts: blocks from deltas, request conversion.

No server: ``BlockAssembler`` on hand-made ``Delta``s (with a Hypothesis
property over how the text is chunked), and the conversion of Responses
items (a previous response's conversation first) and Anthropic messages into
chat-template messages. The response store: ``tests/test_responses_store.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.agents.blocks import Appended, BlockAssembler, Closed, Opened, merge_leading_system
from api.agents.messages_input import chat_messages, chat_tool_choice
from api.agents.messages_render import stop_reason
from api.agents.messages_schema import CountTokensRequest, MessagesRequest, ToolChoiceIn
from api.agents.responses_db import StoredResponse
from api.agents.responses_input import chat_tools, input_messages, prepare_request
from api.agents.responses_schema import ResponsesRequest
from api.convert import structure_or_400
from runtime.config import ServerConfig
from runtime.errors import ClientError
from runtime.messages import Delta, Finished, ToolCall, Usage


def _feed_all(deltas):
    assembler = BlockAssembler()
    events = []
    for delta in deltas:
        events += assembler.feed(delta)
    events += assembler.close()
    return assembler, events


def test_blocks_in_output_order_with_whitespace_trimmed():
    call = ToolCall(name="get_weather", arguments='{"city": "Oslo"}', id="call_1")
    assembler, events = _feed_all([
        Delta(reasoning="\n47 + 85"),
        Delta(reasoning=" = 132\n"),
        Delta(content="\n\n"),
        Delta(content="132", tool_calls=(call,)),
    ])
    kinds = [(type(e).__name__, e.block.index, e.block.kind) for e in events]
    assert kinds == [
        ("Opened", 0, "reasoning"), ("Appended", 0, "reasoning"), ("Appended", 0, "reasoning"),
        ("Closed", 0, "reasoning"), ("Opened", 1, "text"), ("Appended", 1, "text"),
        ("Closed", 1, "text"), ("Opened", 2, "tool"), ("Appended", 2, "tool"),
        ("Closed", 2, "tool"),
    ]
    assert [b.text for b in assembler.blocks[:2]] == ["47 + 85 = 132", "132"]
    assert assembler.blocks[2].call == call
    assert all(b.closed for b in assembler.blocks)


def test_a_call_streamed_in_parts_is_one_block_that_grows():
    parts = [ToolCall(name="get_weather", arguments="", id="call_1"),
             ToolCall(name="", arguments='{"city": ', id="call_1"),
             ToolCall(name="", arguments='"Oslo"}', id="call_1"),
             ToolCall(name="get_time", arguments="{}", id="call_2")]
    assembler, events = _feed_all([Delta(reasoning="think", tool_calls=tuple(parts[:2])),
                                   Delta(tool_calls=tuple(parts[2:]))])
    kinds = [(type(e).__name__, e.block.index) for e in events if e.block.kind == "tool"]
    assert kinds == [("Opened", 1), ("Appended", 1), ("Appended", 1), ("Closed", 1),
                     ("Opened", 2), ("Appended", 2), ("Closed", 2)]
    assert [e.text for e in events if isinstance(e, Appended) and e.block.index == 1] == [
        '{"city": ', '"Oslo"}']
    assert [b.call for b in assembler.blocks[1:]] == [
        ToolCall(name="get_weather", arguments='{"city": "Oslo"}', id="call_1"), parts[3]]


def test_whitespace_only_text_before_a_tool_call_makes_no_block():
    call = ToolCall(name="f", arguments="{}", id="call_1")
    assembler, _ = _feed_all([Delta(content="\n\n"), Delta(content=" ", tool_calls=(call,))])
    assert [b.kind for b in assembler.blocks] == ["tool"]


def test_inner_whitespace_is_sent_once_more_text_follows():
    assembler, events = _feed_all([Delta(content="Hello"), Delta(content=" "), Delta(content="\n"),
                                   Delta(content="world"), Delta(content="  ")])
    pieces = [e.text for e in events if isinstance(e, Appended)]
    assert pieces == ["Hello", " \nworld"]
    assert assembler.blocks[0].text == "Hello \nworld"


@given(
    reasoning=st.text(alphabet=" \nab+1", max_size=30),
    content=st.text(alphabet=" \ncd=2", max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=8),
)
def test_blocks_do_not_depend_on_how_the_text_was_chunked(reasoning, content, cuts):
    text = reasoning + content
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        r = text[a:b][: max(0, len(reasoning) - a)]
        c = text[max(a, len(reasoning)):b]
        deltas.append(Delta(reasoning=r, content=c))
    assembler, events = _feed_all(deltas)
    expected = [(k, t.strip()) for k, t in (("reasoning", reasoning), ("text", content)) if t.strip()]
    assert [(b.kind, b.text) for b in assembler.blocks] == expected
    for block in assembler.blocks:  # what was streamed is what the block holds
        streamed = "".join(e.text for e in events if isinstance(e, Appended) and e.block is block)
        assert streamed == block.text
        opened = [e for e in events if isinstance(e, Opened) and e.block is block]
        closed = [e for e in events if isinstance(e, Closed) and e.block is block]
        assert len(opened) == len(closed) == 1


def test_merge_leading_system_joins_only_the_leading_ones():
    messages = [{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                {"role": "user", "content": "u"}, {"role": "system", "content": "c"}]
    assert merge_leading_system(messages) == [
        {"role": "system", "content": "a\n\nb"}, {"role": "user", "content": "u"},
        {"role": "system", "content": "c"},
    ]


# ----------------------------------------------------------- Responses input


def test_responses_items_become_one_assistant_turn_then_tool_results():
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "call it"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "7 degrees"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "14:05"}]},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "call it", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "7 degrees", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "c2", "content": "14:05", "name": "get_time"},
    ]


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"type": "item_reference", "id": "x"}], "input[0].type"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "input[0].content[0].type"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}], "input[0].arguments"),
        ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
    ],
)
def test_responses_bad_items_name_the_field(items, param):
    with pytest.raises(ClientError) as info:
        input_messages(items)
    assert info.value.param == param


def test_responses_tools_namespaces_and_refusals():
    tools, namespaces = chat_tools([
        {"type": "function", "name": "shell", "parameters": {"type": "object"}},
        {"type": "namespace", "name": "mcp__files", "description": "files",
         "tools": [{"type": "function", "name": "read", "description": "read a file"}]},
        {"type": "web_search"},
    ])
    assert [t["function"]["name"] for t in tools] == ["shell", "read"]
    assert namespaces == {"read": "mcp__files"}
    with pytest.raises(ClientError) as info:
        chat_tools([{"type": "function", "name": "f"}, {"type": "file_search"}])
    assert info.value.param == "tools[1].type"


def test_previous_response_rebuilds_the_same_messages():
    config = ServerConfig()
    first = structure_or_400({"instructions": "sys", "input": "hi"}, ResponsesRequest)
    prepared = prepare_request(first, config)
    assert prepared.turn.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]}]
    stored = StoredResponse(body={}, conversation=(*prepared.history, *input_messages(output)))
    follow = structure_or_400(
        {"instructions": "sys", "previous_response_id": "resp_1", "input": "again"}, ResponsesRequest
    )
    by_hand = structure_or_400(
        {"instructions": "sys", "input": [{"role": "user", "content": "hi"}, *output,
                                          {"role": "user", "content": "again"}]},
        ResponsesRequest,
    )
    assert prepare_request(follow, config, stored).turn.messages == prepare_request(
        by_hand, config).turn.messages
    # No stored response for the id (never stored, or another API key's): a 400 naming it.
    with pytest.raises(ClientError) as info:
        prepare_request(structure_or_400({"previous_response_id": "nope", "input": "x"}, ResponsesRequest),
                        config, None)
    assert info.value.param == "previous_response_id"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"background": True}, "background", "background responses are not supported"),
        ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be auto, none or required"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be at least 1, got 0"),
        ({"temperature": -0.5}, "temperature", "temperature must be at least 0, got -0.5"),
        ({"top_p": 1.5}, "top_p", "top_p must be at most 1, got 1.5"),
        ({"timeout": 0}, "timeout", "timeout must be at least 0.001, got 0.0"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format",
         "text.format of type json_schema needs 'name' and 'schema'"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type",
         "text.format.type must be text, json_schema or json_object"),
        ({"conversation": "conv_1"}, "conversation",
         "conversations are not supported: use previous_response_id"),
        ({"prompt": {"id": "p"}}, "prompt", "prompt templates are not supported"),
    ],
)
def test_responses_refusals_name_the_field(body, param, message):
    with pytest.raises(ClientError) as info:
        structure_or_400({"input": "x", **body}, ResponsesRequest)
    assert (info.value.param, info.value.message) == (param, message)


@pytest.mark.parametrize(
    "body",
    [{"background": False}, {"tool_choice": {"type": "function", "name": "f"}},
     {"text": {"format": {"type": "json_schema", "name": "n", "schema": {}}}},
     {"conversation": None, "prompt": None}],
)
def test_responses_accepts_what_it_serves(body):
    structure_or_400({"input": "x", **body}, ResponsesRequest)


# ----------------------------------------------------------- Anthropic input


def test_anthropic_messages_become_chat_messages():
    req = structure_or_400({
        "model": "claude-x",
        "system": [{"type": "text", "text": "You are a CLI."}, {"type": "text", "text": "Be terse."}],
        "messages": [
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "7 degrees"}]},
                {"type": "text", "text": "and now?"},
            ]},
        ],
    }, CountTokensRequest)
    assert chat_messages(req) == [
        {"role": "system", "content": "You are a CLI.\n\nBe terse."},
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "use the tool", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "7 degrees", "name": "get_weather"},
        {"role": "user", "content": "and now?"},
    ]


def test_anthropic_tool_choice_and_stop_reasons():
    assert chat_tool_choice(ToolChoiceIn(type="any")) == "required"
    assert chat_tool_choice(ToolChoiceIn(type="tool", name="f")) == {"type": "function", "function": {"name": "f"}}
    usage = Usage(prompt_tokens=1, completion_tokens=1, cached_tokens=0)
    assert stop_reason(Finished(finish_reason="stop", usage=usage)) == "end_turn"
    assert stop_reason(Finished(finish_reason="stop", usage=usage, stop_sequence="X")) == "stop_sequence"
    assert stop_reason(Finished(finish_reason="tool_calls", usage=usage, stop_sequence="X")) == "tool_use"
    assert stop_reason(Finished(finish_reason="length", usage=usage)) == "max_tokens"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": [{"type": "image", "source": {}}]}, "messages[0].content[0]"),
        ({"role": "user", "content": [{"type": "document", "source": {}}]}, "messages[0].content[0].type"),
        ({"role": "tool", "content": "x"}, "messages[0].role"),
        ({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                       "content": [{"type": "image"}]}]}, "messages[0].content[0].content[0].type"),
    ],
)
def test_anthropic_bad_messages_name_the_field(message, param):
    with pytest.raises(ClientError) as info:
        req = structure_or_400({"model": "m", "messages": [message]}, CountTokensRequest)
        chat_messages(req)
    assert info.value.param == param


ONE_MESSAGE = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": []}, "messages", "messages: at least one message is required"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role",
         "messages[0].role must be 'user', 'assistant' or 'system'"),
        ({"system": [{"type": "image", "text": "x"}]}, "system[0].type",
         "system[0].type: only text blocks are supported"),
        ({"tools": [{"name": "s", "type": "web_search_20250305"}]}, "tools[0].type",
         "tools[0].type: tool type 'web_search_20250305' is not supported (only client tools "
         "with an input_schema)"),
        ({"tool_choice": {"type": "some"}}, "tool_choice.type",
         "tool_choice.type must be auto, any, tool or none"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name",
         "tool_choice.name is required for type 'tool'"),
        ({"thinking": {"type": "on"}}, "thinking.type",
         "thinking.type must be enabled, disabled or adaptive"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0"),
        ({"top_k": -1}, "top_k", "top_k must be at least 0, got -1"),
        ({"top_p": 2}, "top_p", "top_p must be at most 1, got 2.0"),
        ({"stop_sequences": ["s"] * 17}, "stop_sequences", "stop_sequences takes at most 16 strings"),
    ],
)
def test_anthropic_refusals_name_the_field(body, param, message):
    with pytest.raises(ClientError) as info:
        structure_or_400({**ONE_MESSAGE, **body}, MessagesRequest)
    assert (info.value.param, info.value.message) == (param, message)


def test_anthropic_accepts_what_it_serves():
    req = structure_or_400(
        {**ONE_MESSAGE, "tools": [{"name": "f", "type": "custom"}, {"name": "g"}],
         "tool_choice": {"type": "tool", "name": "f"}, "thinking": {"type": "adaptive"},
         "system": [{"type": "text", "text": "s"}], "stop_sequences": ["s"] * 16},
        MessagesRequest,
    )
    assert chat_tool_choice(req.tool_choice) == {"type": "function", "function": {"name": "f"}}


def _sse_events(frames: bytes) -> list[tuple[str, dict]]:
    import json

    events = []
    for block in frames.decode().split("\n\n"):
        lines = block.splitlines()
        names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
        data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        if names and data:
            events.append((names[0], json.loads(data[0])))
    return events


def test_a_long_prompt_gets_in_progress_events_besides_its_keepalive_comments(monkeypatch):
    from api.agents import responses_render
    from runtime.messages import Progress

    req = structure_or_400({"model": "m", "input": "hi", "stream": True}, ResponsesRequest)
    renderer = responses_render.ResponsesRenderer(
        req=req, prepared=prepare_request(req, ServerConfig()), store=None, owner="o")
    progress = [Progress(done=done, total=300) for done in (64, 128, 192)]
    # Right after the opening events: comments only.
    frames = renderer.stream_frames(progress[:1])
    assert [name for name, _ in _sse_events(frames)] == ["response.created", "response.in_progress"]
    assert frames.count(b": keepalive 64/300") == 1
    # Once the interval has passed since the last event: an event per interval.
    monkeypatch.setattr(responses_render, "IN_PROGRESS_EVERY_SECONDS", 0.0)
    frames = renderer.stream_frames(progress[1:])
    events = _sse_events(frames)
    assert [name for name, _ in events] == ["response.in_progress"] * 2
    assert [e["sequence_number"] for _, e in events] == [2, 3]
    for _, event in events:
        assert event["response"]["id"] == renderer.id
        assert event["response"]["status"] == "in_progress" and event["response"]["output"] == []
    assert b": keepalive 128/300" in frames and b": keepalive 192/300" in frames
