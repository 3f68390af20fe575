"""``api.json_input``: nesting and lone surrogates refused with a 400 naming the path."""

from __future__ import annotations

import json

import pytest

import api.json_input as json_input
from api.json_input import MAX_DEPTH
from runtime.errors import ClientError


def nested_arrays(levels: int, leaf=1):
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def refused(text: str, **kwargs) -> ClientError:
    with pytest.raises(ClientError) as caught:
        json_input.loads(text, **kwargs)
    assert caught.value.status == 400
    return caught.value


def test_the_limit_itself_is_accepted_and_one_more_level_is_not():
    body = {"messages": nested_arrays(MAX_DEPTH - 1)}  # the body is level 1
    assert json_input.loads(json.dumps(body)) == body
    error = refused(json.dumps({"messages": nested_arrays(MAX_DEPTH)}))
    assert error.param == "messages" + "[0]" * (MAX_DEPTH - 1)  # the arrays of levels 2..64
    assert error.message.startswith(error.param + ": ") and str(MAX_DEPTH) in error.message


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 5000])  # parsed; too deep for the parser
def test_the_path_is_the_first_container_past_the_limit(levels):
    arrays = "[" * levels + "1" + "]" * levels
    text = '{"model": "m", "metadata": {"a b": [1, "]", "[", {"x": ' + arrays + "}]}}"
    error = refused(text)
    prefix = 'metadata["a b"][3].x'
    assert error.param == prefix + "[0]" * (MAX_DEPTH - 4)  # the arrays of levels 5..64


def test_objects_count_as_arrays_do():
    value = 1
    for _ in range(MAX_DEPTH):
        value = {"k": value}
    assert json_input.loads(json.dumps(value)) == value
    error = refused(json.dumps({"k": value}))
    assert error.param == ".".join(["k"] * MAX_DEPTH)
    deep_text = '{"k":' * 3000 + "1" + "}" * 3000
    assert refused(deep_text).param == error.param


@pytest.mark.parametrize(
    ("text", "param"),
    [
        (r'{"messages": [{"content": "a\ud800b"}]}', "messages[0].content"),
        (r'{"messages": [{"content": "\udc00"}]}', "messages[0].content"),
        (r'{"messages": [{"content": "\udc00\ud800"}]}', "messages[0].content"),  # reversed
        (r'{"name": "\ud800\u0041"}', "name"),
        (r'{"stop": ["ok", "\uDBFF"]}', "stop[1]"),
        (r'{"metadata": {"\ud800": 1}}', r'metadata["\ud800"]'),
        (r'{"\udfff": 1}', r'["\udfff"]'),
    ],
)
def test_a_lone_surrogate_names_its_field(text, param):
    error = refused(text)
    assert error.param == param
    assert error.message.startswith(param + ": ")
    error.message.encode("utf-8")  # the answer itself must be valid UTF-8
    error.param.encode("utf-8")


def test_surrogate_pairs_and_escaped_backslashes_are_text():
    assert json_input.loads(r'{"a": "\ud83d\ude00"}') == {"a": "\U0001f600"}
    assert json_input.loads(r'{"a": "\\ud800"}') == {"a": "\\ud800"}


def test_a_json_string_inside_the_body_names_its_field():
    where = "messages[0].tool_calls[0].function.arguments"
    error = refused(r'{"city": "\ud800"}', where=where)
    assert error.param == where and error.message.startswith(f"{where} (at city): ")
    error = refused("[" * 2000 + "]" * 2000, where=where)
    assert error.param == where


def test_invalid_json_is_left_to_the_caller():
    with pytest.raises(json.JSONDecodeError):
        json_input.loads('{"a": ')
