"""Harmony (gpt-oss): the streaming parser, the prompt's shape, and the Detokenizer with a
real gpt_oss tokenizer (tests/harmony_model.py), all in-process.

The parser's central property: however a reply's text is split into pieces
(down to single characters, markers cut anywhere), the events joined per
kind are the same as for the whole text.
"""

from __future__ import annotations

import json

import mlx_lm
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.detokenizer import DetokenizerCore
from api.renderers import joined_tool_calls
from runtime.harmony import (
    HEADER_LIMIT,
    MARKERS,
    HarmonyEvent,
    HarmonyParser,
    harmony_effort,
    harmony_messages,
    harmony_stop_ids,
    is_harmony_tokenizer,
    merged,
)
from runtime.messages import Delta, Finished, StepOutputs, TextSpec, TokenEvent
from runtime.outbox import Outbox
from runtime.tiny_model import build_tiny_model
from tests.harmony_model import build_tiny_gpt_oss

REPLY = (
    "<|channel|>analysis<|message|>User wants Oslo's weather. <b>Use</b> the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo", "note": "a<|b"}'
)
ANSWER = "<|channel|>final<|message|>It is 12 degrees in Oslo.<|return|>"


def parse(pieces) -> list[HarmonyEvent]:
    parser = HarmonyParser()
    events: list[HarmonyEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return merged(events + parser.finish())


def split(text: str, cuts) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


# ------------------------------------------------------------------ the parser


def test_analysis_tool_call_and_final_become_reasoning_a_call_and_content():
    assert parse([REPLY]) == [
        HarmonyEvent("reasoning", "User wants Oslo's weather. <b>Use</b> the tool."),
        HarmonyEvent("tool_name", "get_weather"),
        HarmonyEvent("tool_arguments", '{"city": "Oslo", "note": "a<|b"}'),
        HarmonyEvent("tool_end"),
    ]
    assert parse([ANSWER]) == [HarmonyEvent("content", "It is 12 degrees in Oslo.")]


def test_a_call_streams_its_name_first_then_argument_fragments():
    parser = HarmonyParser()
    kinds, fragments = [], []
    for ch in REPLY:
        for event in parser.feed(ch):
            kinds.append(event.kind)
            if event.kind == "tool_arguments":
                fragments.append(event.text)
    kinds += [e.kind for e in parser.finish()]
    first_argument = kinds.index("tool_arguments")
    assert kinds.index("tool_name") < first_argument
    assert "reasoning" not in kinds[first_argument:]
    assert kinds[-1] == "tool_end"
    assert len(fragments) > 10  # fed a character at a time, the arguments arrive in pieces
    assert "".join(fragments) == '{"city": "Oslo", "note": "a<|b"}'


def test_the_recipient_may_stand_in_the_role_part_and_commentary_without_one_is_content():
    text = ("<|channel|>commentary<|message|>Checking.<|end|>"
            "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{}<|call|>")
    assert parse([text]) == [
        HarmonyEvent("content", "Checking."),
        HarmonyEvent("tool_name", "lookup"),
        HarmonyEvent("tool_arguments", "{}"),
        HarmonyEvent("tool_end"),
    ]


def test_text_that_is_never_a_header_is_returned_as_content():
    assert parse(["just words, no markers"]) == [HarmonyEvent("content", "just words, no markers")]
    long = "x" * (HEADER_LIMIT + 5)
    parser = HarmonyParser()
    streamed = parser.feed(long)  # over the limit: released at once, not at the end
    assert merged(streamed) == [HarmonyEvent("content", long)]
    assert parser.finish() == []


def test_whitespace_between_messages_is_dropped_and_other_text_kept():
    text = "<|channel|>final<|message|>A<|end|>\n\n<|start|>assistant<|channel|>final<|message|>B"
    assert parse([text]) == [HarmonyEvent("content", "AB")]
    assert parse(["<|channel|>final<|message|>A<|end|> stray"]) == [
        HarmonyEvent("content", "A stray")
    ]


harmony_text = st.lists(
    st.sampled_from([*"ab {}\":<|>\n", "<|", "<|chan", "analysis", "final", "commentary",
                     " to=functions.f", "json"]),
    max_size=12,
).map("".join)


@st.composite
def replies(draw) -> str:
    """Harmony-like replies: well-formed messages, stray markers and marker look-alikes."""
    parts = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["message", "marker", "text"]))
        if kind == "message":
            channel = draw(st.sampled_from(["analysis", "final", "commentary",
                                            "commentary to=functions.get_weather json"]))
            parts.append(f"<|start|>assistant<|channel|>{channel}<|message|>")
            parts.append(draw(harmony_text))
            parts.append(draw(st.sampled_from(["<|end|>", "<|call|>", "<|return|>", ""])))
        elif kind == "marker":
            parts.append(draw(st.sampled_from(MARKERS)))
        else:
            parts.append(draw(harmony_text))
    return "".join(parts)


@settings(max_examples=300, deadline=None)
@given(text=replies(), data=st.data())
def test_any_split_of_the_text_gives_the_same_events(text, data):
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=8)) if text else []
    assert parse(split(text, cuts)) == parse([text])


@settings(max_examples=100, deadline=None)
@given(text=replies())
def test_character_by_character_gives_the_same_events(text):
    assert parse(list(text)) == parse([text])


@settings(max_examples=200, deadline=None)
@given(text=replies())
def test_every_call_is_named_closed_and_nothing_is_lost_but_markup(text):
    events = parse([text])
    kinds = [e.kind for e in events]
    assert kinds.count("tool_name") == kinds.count("tool_end")
    for i, kind in enumerate(kinds):
        if kind == "tool_arguments":
            assert kinds[i - 1] == "tool_name" and kinds[i + 1] == "tool_end"
    # Every character of emitted text is a character of the reply.
    emitted = "".join(e.text for e in events if e.kind != "tool_name")
    remaining = iter(text)
    assert all(ch in remaining for ch in emitted)


# ------------------------------------------------------------------ the prompt's shape


def test_messages_take_the_shape_gpt_oss_templates_read():
    call_a = {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    call_b = {"id": "b", "type": "function", "function": {"name": "g", "arguments": {}}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "preamble", "reasoning_content": "think",
         "tool_calls": [call_a, call_b]},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "assistant", "content": "done", "reasoning": "thought"},
    ]
    assert harmony_messages(messages) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call_a], "thinking": "think"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "assistant", "content": None, "tool_calls": [call_b]},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "assistant", "content": "done", "thinking": "thought"},
    ]
    # one call: the text stands in for missing reasoning; results stay where they are
    one = [{"role": "assistant", "content": "let me look", "tool_calls": [call_a]},
           {"role": "tool", "tool_call_id": "a", "content": "A"}]
    assert harmony_messages(one) == [
        {"role": "assistant", "content": None, "tool_calls": [call_a], "thinking": "let me look"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
    ]


def test_efforts_map_to_the_three_levels():
    assert [harmony_effort(e) for e in ("none", "minimal", "low", "medium", "high", "xhigh")] == [
        "low", "low", "low", "medium", "high", "high"]


# ------------------------------------------------------------------ with a real tokenizer


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return mlx_lm.load(str(build_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "model")))


def test_a_harmony_tokenizer_is_recognised_and_its_stops_found(gpt_oss, tmp_path):
    _, tokenizer = gpt_oss
    assert is_harmony_tokenizer(tokenizer)
    vocab = tokenizer.get_vocab()
    assert harmony_stop_ids(tokenizer) == (vocab["<|return|>"], vocab["<|call|>"])
    _, qwen = mlx_lm.load(str(build_tiny_model(tmp_path / "qwen3")))
    assert not is_harmony_tokenizer(qwen)


def test_the_template_renders_effort_tools_calls_and_results(gpt_oss):
    from runtime.prompts import prepare_chat

    _, tokenizer = gpt_oss
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                               "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "c", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c", "content": "12 C"},
    ]
    prompt = prepare_chat(tokenizer, messages, tools=tools,
                          template_args={"reasoning_effort": "minimal"})
    text = tokenizer.decode(list(prompt.tokens))
    assert "Reasoning: low" in text
    assert "# Instructions\n\nBe brief." in text and "type get_weather = " in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
            '<|message|>{"city": "Oslo"}<|call|>') in text
    assert text.endswith('<|start|>functions.get_weather to=assistant<|channel|>commentary'
                         '<|message|>"12 C"<|end|><|start|>assistant')


class _NoAborts:
    """The Scheduler's port as the Detokenizer sees it; nothing here aborts."""

    def abort(self, request_id, reason) -> None:
        raise AssertionError(f"request {request_id} aborted: {reason}")


def _detokenize(tokenizer, ids, *, eos: int | None):
    core = DetokenizerCore(scheduler=_NoAborts())
    outbox = Outbox()
    core.open(1, TextSpec(tools=None), outbox, tokenizer)
    for t in ids:
        core.on_outputs(StepOutputs(tokens=(TokenEvent(request_id=1, token=t),)))
    core.on_outputs(StepOutputs(tokens=(TokenEvent(request_id=1, token=eos or 0,
                                                   finish_reason="stop"),)))
    items = outbox.take()
    deltas = [i for i in items if isinstance(i, Delta)]
    (finished,) = [i for i in items if isinstance(i, Finished)]
    return deltas, finished


def test_the_detokenizer_splits_a_harmony_reply_into_reasoning_and_a_call(gpt_oss):
    _, tokenizer = gpt_oss
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    assert tokenizer.get_vocab()["<|channel|>"] in ids  # the markers are single tokens
    deltas, finished = _detokenize(tokenizer, ids, eos=tokenizer.get_vocab()["<|call|>"])
    assert "".join(d.reasoning for d in deltas) == (
        "User wants Oslo's weather. <b>Use</b> the tool.")
    assert "".join(d.content for d in deltas) == ""
    (call,) = joined_tool_calls([c for d in deltas for c in d.tool_calls])
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Oslo", "note": "a<|b"}
    assert finished.finish_reason == "tool_calls"

    ids = tokenizer.encode(ANSWER.removesuffix("<|return|>"), add_special_tokens=False)
    deltas, finished = _detokenize(tokenizer, ids, eos=tokenizer.get_vocab()["<|return|>"])
    assert "".join(d.content for d in deltas) == "It is 12 degrees in Oslo."
    assert finished.finish_reason == "stop"


def test_a_call_streams_in_parts_that_share_its_id(gpt_oss):
    _, tokenizer = gpt_oss
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    deltas, _ = _detokenize(tokenizer, ids, eos=tokenizer.get_vocab()["<|call|>"])
    parts = [c for d in deltas for c in d.tool_calls]
    assert len(parts) > 2  # the name, then the arguments over several tokens
    assert parts[0].name == "get_weather" and parts[0].arguments == ""
    assert {p.id for p in parts} == {parts[0].id}
    assert all(p.name == "" for p in parts[1:])
    assert "".join(p.arguments for p in parts) == '{"city": "Oslo", "note": "a<|b"}'


def test_a_call_without_arguments_gets_an_empty_object(gpt_oss):
    _, tokenizer = gpt_oss
    text = "<|channel|>commentary to=functions.f json<|message|>"
    deltas, finished = _detokenize(tokenizer, tokenizer.encode(text, add_special_tokens=False),
                                   eos=None)
    parts = [c for d in deltas for c in d.tool_calls]
    assert [(p.name, p.arguments) for p in parts] == [("f", ""), ("", "{}")]
    assert finished.finish_reason == "tool_calls"


def test_messages_thinking_and_output_effort_become_a_reasoning_level():
    from api.agents.messages_input import template_args
    from api.agents.messages_schema import CountTokensRequest
    from api.convert import structure_or_400
    from runtime.config import ServerConfig

    def effort(**fields):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
        req = structure_or_400(body, CountTokensRequest)
        return template_args(req, ServerConfig()).get("reasoning_effort")

    assert effort() is None
    assert effort(thinking={"type": "disabled"}) == "low"
    assert effort(thinking={"type": "adaptive"}) is None
    assert [effort(thinking={"type": "enabled", "budget_tokens": b}) for b in (1024, 8000, 20000)] == [
        "low", "medium", "high"]
    assert effort(thinking={"type": "enabled", "budget_tokens": 1024},
                  output_config={"effort": "max"}) == "high"
    assert effort(output_config={"effort": "whatever"}) is None
