"""Structured outputs and tool choice (runtime/grammar/) with real models on the CPU.

A constrained decoding loop written here (mlx-lm forward, the rows' packed
bitmasks filled in one ``fill_bitmasks`` call per step, masked argmax,
``consume``) generates for a corpus of JSON Schemas with a tiny random model
and with the trained demo model; every output must parse and validate with
``jsonschema`` (formats checked too). Then tool_choice required / named / none
on the demo model (which knows get_weather and get_time), thinking before the
constraint, the 400s that name unsupported features, and max_tokens running
out mid-document.
"""

from __future__ import annotations

import json
import pathlib
import pickle

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from runtime.errors import ClientError
from runtime.grammar import (
    ConstraintSpec,
    compile_constraint,
    fill_bitmasks,
    grammar_tokenizer,
)
from tests.conftest import TIME, WEATHER

DEMO_DIR = pathlib.Path(__file__).resolve().parents[1] / "demo_model" / "mlx-trio-demo"

SHORT = {"type": "string", "maxLength": 12}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


def _object(properties: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


# Strings carry a maxLength (or a pattern) so that a random model, which has
# no reason to close a string, still finishes within the token budget.
CORPUS = {
    "flat_string": _object({"city": SHORT}),
    "integer_bounds": _object({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "string_enum": _object({"unit": {"enum": ["celsius", "fahrenheit", "kelvin"]}}),
    "const": _object({"version": {"const": 2}, "kind": {"const": "point"}}),
    "booleans": _object({"ok": {"type": "boolean"}, "done": {"type": "boolean"}}),
    "nullable": _object({"score": {"type": ["integer", "null"], "minimum": -5, "maximum": 5}}),
    "nested_2": _object({"user": _object({"name": SHORT, "id": {"type": "integer", "minimum": 1,
                                                                "maximum": 999}})}),
    "nested_3": _object({"a": _object({"b": _object({"c": {"type": "boolean"}})})}),
    "integer_array": {"type": "array", "items": DIGIT, "minItems": 1, "maxItems": 3},
    "enum_array": _object({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]},
                                    "minItems": 2, "maxItems": 4}}),
    "ref_items": {"$defs": {"item": _object({"sku": {"type": "string", "maxLength": 6},
                                             "qty": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}})},
                  "type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1,
                  "maxItems": 2},
    "defs_reused": {"$defs": {"point": _object({"x": DIGIT, "y": DIGIT})},
                    **_object({"from": {"$ref": "#/$defs/point"},
                               "to": {"$ref": "#/$defs/point"}})},
    "recursive_ref": {"$defs": {"node": _object({"v": DIGIT, "next": {
        "anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}})}, "$ref": "#/$defs/node"},
    "pattern": _object({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}),
    "pattern_top_level": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "format_date": _object({"when": {"type": "string", "format": "date"}}),
    "format_uuid": {"type": "string", "format": "uuid"},
    # a step of its own (multipleOf) instead of the default of ten decimals
    "number_bounds": _object({"t": {"type": "number", "minimum": -1.5, "maximum": 2.5,
                                    "multipleOf": 0.5}}),
    "exclusive_bounds": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 15},
    "multiple_of": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 70},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                         {"type": "string", "maxLength": 3}]},
    "one_of": {"oneOf": [_object({"cat": {"const": True}}),
                         _object({"dog": {"type": "integer", "minimum": 0, "maximum": 3}})]},
    "all_of": {**_object({"a": {"type": "integer", "minimum": 0, "maximum": 5},
                          "b": {"type": "boolean"}}, required=[]),
               "allOf": [{"required": ["a"]}, {"required": ["b"]}]},
    "optional_fields": _object({"id": DIGIT, "note": {"type": "string", "maxLength": 5},
                                "flag": {"type": "boolean"}}, required=["id"]),
    "matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1},
        "minItems": 2, "maxItems": 2}},
    "tuple": {"type": "array", "prefixItems": [DIGIT, {"enum": ["a", "b"]}, {"type": "boolean"}],
              "items": False, "minItems": 3},
    "string_length": _object({"pin": {"type": "string", "minLength": 4, "maxLength": 4}}),
    "array_of_objects": {"type": "array", "items": _object({"k": {"enum": [1, 2, 3]}}),
                         "minItems": 2, "maxItems": 2},
    "mixed_enum": {"enum": ["red", 7, None, True, {"x": 1}]},
    "six_fields": _object({f"f{i}": DIGIT for i in range(6)}),
    "pattern_properties": {"type": "object", "patternProperties": {"^n[0-9]$": {"type": "boolean"}},
                           "additionalProperties": False, "minProperties": 1,
                           "maxProperties": 2},
    "tool_call_shape": _object({"name": {"const": "get_weather"},
                                "arguments": _object({"city": SHORT})}),
}
# Nothing makes a model stop recursing (the random one never does, the demo model
# nests until max_tokens): unbounded recursion is checked along scripted token paths.
UNBOUNDED = {"recursive_ref"}



@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return load(tiny_model_path)


@pytest.fixture(scope="module")
def demo():
    return load(str(DEMO_DIR))


def constrained_generate(model, tokenizer, prompt, specs, max_tokens):
    """Greedy decoding of one row per spec, in lockstep, from one shared prompt.

    Per step: one forward for all rows, ONE ``fill_bitmasks`` call for the
    unfinished rows, the packed masks unpacked (a row's ``preferred_opening``
    allowed where it is the unmasked argmax, as the batch sampler does) and
    applied to the logits, argmax, ``consume``. Returns (tokens, finished, matcher) per row.
    """
    vocab = model.args.vocab_size
    gt = grammar_tokenizer(tokenizer, vocab)
    matchers = [spec.new_matcher(gt) for spec in specs]
    rows = len(specs)
    cache = make_prompt_cache(model)
    logits = model(mx.array([list(prompt)] * rows), cache=cache)[:, -1, :]
    bitmask = gt.allocate(rows)
    eos = set(tokenizer.eos_token_ids)
    out, finished = [[] for _ in range(rows)], [False] * rows
    for _ in range(max_tokens):
        active = [i for i in range(rows) if not finished[i]]
        if not active:
            break
        fill_bitmasks([matchers[i] for i in active], bitmask, active)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        first_choice = mx.argmax(logits, axis=-1).tolist()
        for i in active:  # a thinking block opens only where the model would open it
            if matchers[i].preferred_opening == first_choice[i]:
                allowed[i, first_choice[i]] = 1
        chosen = mx.argmax(mx.where(mx.array(allowed.astype(bool)), logits, -mx.inf), axis=-1)
        feed = chosen.tolist()
        for i in active:
            if feed[i] in eos:
                finished[i] = True
            else:
                matchers[i].consume(feed[i])
                out[i].append(feed[i])
        logits = model(mx.array(feed)[:, None], cache=cache)[:, -1, :]
    return list(zip(out, finished, matchers, strict=True))


def validate(schema, text: str) -> None:
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    validator.validate(json.loads(text))


def json_spec(tokenizer, schema, **kwargs):
    return compile_constraint(
        tokenizer, response_format={"type": "json_schema",
                                    "json_schema": {"name": "t", "schema": schema, "strict": True}},
        **kwargs)


def chat(tokenizer, content, **kwargs):
    return tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, **kwargs)


# ------------------------------------------------------------------ corpus


def test_corpus_has_thirty_schemas_that_are_valid_json_schema():
    assert len(CORPUS) >= 30
    for schema in CORPUS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_random_model_outputs_validate_for_every_bounded_schema(tiny):
    model, tokenizer = tiny
    names = [n for n in CORPUS if n not in UNBOUNDED]
    specs = [json_spec(tokenizer, CORPUS[n], allow_thinking=False) for n in names]
    results = constrained_generate(model, tokenizer, chat(tokenizer, "Reply in JSON."),
                                   specs, max_tokens=256)
    for name, (tokens, finished, matcher) in zip(names, results, strict=True):
        text = tokenizer.decode(tokens)
        assert finished, f"{name}: no end within 256 tokens: {text!r}"
        assert matcher.error is None
        validate(CORPUS[name], text)


def test_demo_model_outputs_validate_for_every_bounded_schema(demo):
    model, tokenizer = demo
    names = [n for n in CORPUS if n not in UNBOUNDED]
    specs = [json_spec(tokenizer, CORPUS[n], allow_thinking=False) for n in names]
    prompt = chat(tokenizer, "Reply in JSON.", enable_thinking=False)
    results = constrained_generate(model, tokenizer, prompt, specs, max_tokens=128)
    for name, (tokens, finished, _) in zip(names, results, strict=True):
        text = tokenizer.decode(tokens)
        assert finished, f"{name}: no end within 128 tokens: {text!r}"
        validate(CORPUS[name], text)


def test_json_object_and_the_flat_responses_shape(tiny):
    model, tokenizer = tiny
    schema = _object({"pin": {"type": "string", "pattern": "^[0-9]{3}$"}})
    specs = [
        compile_constraint(tokenizer, response_format={"type": "json_object"},
                           allow_thinking=False),
        # Responses API: text.format carries name/schema/strict without the json_schema level
        compile_constraint(tokenizer, response_format={"type": "json_schema", "name": "p",
                                                       "schema": schema, "strict": True},
                           response_format_param="text.format", allow_thinking=False),
    ]
    assert specs[0].kind == "json_object" and specs[1].kind == "json_schema"
    results = constrained_generate(model, tokenizer, chat(tokenizer, "JSON"), specs, 128)
    object_tokens, _, _ = results[0]
    assert tokenizer.decode(object_tokens).lstrip().startswith("{")
    tokens, finished, _ = results[1]
    assert finished
    validate(schema, tokenizer.decode(tokens))


def grammar_accepts(tokenizer, spec, text: str) -> bool:
    """Whether ``spec`` lets ``text``'s tokens through, one by one, and then the end."""
    gt = grammar_tokenizer(tokenizer)
    matcher, bitmask = spec.new_matcher(gt), gt.allocate(1)
    for token in tokenizer.encode(text, add_special_tokens=False):
        fill_bitmasks([matcher], bitmask)
        if not (bitmask[0, token // 32] >> (token % 32)) & 1:
            return False
        matcher.consume(token)
    fill_bitmasks([matcher], bitmask)
    return all((bitmask[0, t // 32] >> (t % 32)) & 1 for t in tokenizer.eos_token_ids)


def test_recursive_schema_accepts_deep_documents_and_rejects_broken_ones(tiny):
    _, tokenizer = tiny
    spec = json_spec(tokenizer, CORPUS["recursive_ref"], allow_thinking=False)
    deep = json.dumps({"v": 1, "next": {"v": 2, "next": {"v": 3, "next": {"v": 4, "next": None}}}})
    broken = deep.replace('"v": 3', '"v": 33')
    assert grammar_accepts(tokenizer, spec, deep)
    assert not grammar_accepts(tokenizer, spec, broken)


def test_json_whitespace_is_one_space_after_separators_and_nothing_else(tiny_tokenizer):
    spec = json_spec(tiny_tokenizer, CORPUS["nested_3"], allow_thinking=False)
    doc = {"a": {"b": {"c": True}}}
    assert grammar_accepts(tiny_tokenizer, spec, json.dumps(doc))  # {"a": {"b": {"c": true}}}
    assert grammar_accepts(tiny_tokenizer, spec, "\n\n" + json.dumps(doc))  # after </think>
    for other in (json.dumps(doc, separators=(",", ":")), json.dumps(doc, indent=2),
                  json.dumps(doc, indent="\t"), '{ "a": {"b": {"c": true}}}',
                  '{"a":  {"b": {"c": true}}}', '{"a": {"b": {"c": true}} }',
                  '{"a": {"b":\t{"c": true}}}', '{"a": {"b":\r\n{"c": true}}}'):
        assert not grammar_accepts(tiny_tokenizer, spec, other), other
    array = json_spec(tiny_tokenizer, CORPUS["integer_array"], allow_thinking=False)
    assert grammar_accepts(tiny_tokenizer, array, "[1, 2, 3]")
    assert not grammar_accepts(tiny_tokenizer, array, "[1,2,3]")


def with_guidance(schema: dict, **options) -> dict:
    return {**schema, "x-guidance": options}


def test_flexible_whitespace_when_the_schema_asks_for_it(tiny_tokenizer):
    doc = {"a": {"b": {"c": True}}}
    written = (json.dumps(doc), json.dumps(doc, separators=(",", ":")), json.dumps(doc, indent=2),
               json.dumps(doc, indent="\t"), '{ "a" :{"b":\r\n {"c": true}  }\n}')
    flexible = json_spec(tiny_tokenizer, with_guidance(CORPUS["nested_3"], whitespace_flexible=True),
                         allow_thinking=False)
    for text in written:
        assert grammar_accepts(tiny_tokenizer, flexible, text), text
    # a pattern of its own (flexible implied), or compact separators and no whitespace
    pattern = json_spec(tiny_tokenizer, with_guidance(CORPUS["nested_3"], whitespace_pattern=" ?"),
                        allow_thinking=False)
    assert grammar_accepts(tiny_tokenizer, pattern, '{ "a" : {"b":{"c" :true}}}')
    assert not grammar_accepts(tiny_tokenizer, pattern, json.dumps(doc, indent=2))
    compact = json_spec(tiny_tokenizer, with_guidance(CORPUS["nested_3"], item_separator=",",
                                                      key_separator=":"), allow_thinking=False)
    assert grammar_accepts(tiny_tokenizer, compact, written[1])
    assert not grammar_accepts(tiny_tokenizer, compact, written[0])
    # a tool's parameters ask for their own arguments; the call around them is fixed
    tool = {"type": "function", "function": {"name": "f", "parameters": with_guidance(
        CORPUS["nested_3"], whitespace_flexible=True)}}
    spec = compile_constraint(tiny_tokenizer, tools=[tool], tool_choice="required",
                              allow_thinking=False)
    call = '<tool_call>\n{"name": "f", "arguments": %s}\n</tool_call>'
    for text in written:
        assert grammar_accepts(tiny_tokenizer, spec, call % text), text
    assert not grammar_accepts(tiny_tokenizer, spec, call.replace(": ", ":", 1) % written[0])


@pytest.mark.parametrize(("guidance", "named"), [
    ({"lenient": True}, "x-guidance.lenient"),
    ({"coerce_one_of": True}, "x-guidance.coerce_one_of"),
    ({"whitespace_flexible": "yes"}, "x-guidance.whitespace_flexible"),
    ({"whitespace_flexible": False, "whitespace_pattern": " "}, "x-guidance.whitespace_pattern"),
])
def test_only_whitespace_options_may_be_set(tiny_tokenizer, guidance, named):
    with pytest.raises(ClientError) as info:
        json_spec(tiny_tokenizer, {"type": "object", "x-guidance": guidance})
    assert info.value.param == f"response_format.json_schema.schema.{named}"


# ------------------------------------------------------------ closed objects

POINT = {"type": "object", "properties": {"x": DIGIT, "y": DIGIT}, "required": ["x"]}


def tool_spec(tokenizer, parameters, **kwargs):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    return compile_constraint(tokenizer, tools=[tool], allow_thinking=False, **kwargs)


def as_call(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'


def test_strict_schemas_and_tool_arguments_allow_no_properties_they_do_not_name(tiny_tokenizer):
    named, extra = '{"x": 1, "y": 2}', '{"x": 1, "y": 2, "z": 3}'
    strict = json_spec(tiny_tokenizer, POINT, allow_thinking=False)
    assert grammar_accepts(tiny_tokenizer, strict, named)
    assert grammar_accepts(tiny_tokenizer, strict, '{"x": 1}')
    assert not grammar_accepts(tiny_tokenizer, strict, extra)
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        call = tool_spec(tiny_tokenizer, POINT, tool_choice=choice)
        assert grammar_accepts(tiny_tokenizer, call, as_call(named))
        assert not grammar_accepts(tiny_tokenizer, call, as_call(extra))
    # with tool_choice "auto" beside a response_format, the calls are closed too
    both = json_spec(tiny_tokenizer, POINT, tools=[{"type": "function", "function": {
        "name": "f", "parameters": POINT}}], allow_thinking=False)
    assert both.kind == "json_schema|tool_calls"
    assert not grammar_accepts(tiny_tokenizer, both, as_call(extra))
    assert not grammar_accepts(tiny_tokenizer, both, extra)
    # JSON Schema's default without strict; a schema that allows more gets more
    loose = compile_constraint(tiny_tokenizer, allow_thinking=False, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": POINT}})
    assert grammar_accepts(tiny_tokenizer, loose, extra)
    for allowing in ({**POINT, "additionalProperties": True},
                     {**POINT, "additionalProperties": DIGIT},
                     {**POINT, "patternProperties": {"^z$": DIGIT}}):
        assert grammar_accepts(tiny_tokenizer, json_spec(tiny_tokenizer, allowing,
                                                         allow_thinking=False), extra)
        assert grammar_accepts(tiny_tokenizer, tool_spec(tiny_tokenizer, allowing,
                                                         tool_choice="required"), as_call(extra))


def test_closed_objects_reach_every_nested_schema(tiny_tokenizer):
    def refused(schema, text):
        spec = json_spec(tiny_tokenizer, schema, allow_thinking=False)
        return not grammar_accepts(tiny_tokenizer, spec, text)

    nested = {"type": "object", "properties": {"p": POINT}, "required": ["p"]}
    assert refused(nested, '{"p": {"x": 1, "z": 3}}')
    assert not refused(nested, '{"p": {"x": 1}}')
    assert refused({"type": "array", "items": POINT}, '[{"x": 1}, {"x": 1, "z": 3}]')
    assert refused({"type": "array", "prefixItems": [POINT], "items": False}, '[{"x": 1, "z": 3}]')
    assert refused({"anyOf": [POINT, {"type": "null"}]}, '{"x": 1, "z": 3}')
    assert refused({"oneOf": [POINT, {"type": "integer"}]}, '{"x": 1, "z": 3}')
    defs = {"$defs": {"point": POINT}, "type": "object",
            "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"]}
    assert refused(defs, '{"p": {"x": 1, "z": 3}}')
    legacy = {"definitions": {"point": POINT}, "$ref": "#/definitions/point"}
    assert refused(legacy, '{"x": 1, "z": 3}')
    # allOf's members are parts of one object: its names are theirs together
    parts = {"allOf": [{"type": "object", "properties": {"x": DIGIT}, "required": ["x"]},
                       {"$ref": "#/$defs/more"}],
             "$defs": {"more": {"type": "object", "properties": {"y": DIGIT}}}}
    assert not refused(parts, '{"x": 1, "y": 2}')
    assert refused(parts, '{"x": 1, "y": 2, "z": 3}')
    # properties beside anyOf: the object holds its own and its branches' names
    beside = {"type": "object", "properties": {"k": DIGIT}, "required": ["k"],
              "anyOf": [{"properties": {"a": DIGIT}}, {"properties": {"b": DIGIT}}]}
    assert not refused(beside, '{"k": 1, "b": 2}')
    assert refused(beside, '{"k": 1, "z": 2}')


# ----------------------------------------------------------------- numbers


def test_integers_have_at_most_the_digits_of_64_bits_and_schema_bounds_narrow(tiny_tokenizer):
    def accepted(schema, text):
        return grammar_accepts(tiny_tokenizer, json_spec(tiny_tokenizer, schema,
                                                         allow_thinking=False), text)

    plain = {"type": "integer"}
    for text in ("0", "-7", "9223372036854775807", "-9223372036854774784"):
        assert accepted(plain, text), text
    for text in ("9223372036854775808", "12345678901234567890", "-12345678901234567890",
                 "1.5", "1e3"):
        assert not accepted(plain, text), text
    # the schema's own bounds, where tighter, still narrow
    assert accepted({"type": "integer", "minimum": 0}, "9223372036854775807")
    assert not accepted({"type": "integer", "minimum": 0}, "-1")
    assert not accepted({"type": "integer", "maximum": -10}, "-9")
    assert not accepted({"type": "integer", "maximum": 10**30}, "12345678901234567890")
    assert accepted(CORPUS["exclusive_bounds"], "14")
    assert not accepted(CORPUS["exclusive_bounds"], "15")
    assert accepted({"type": ["integer", "null"]}, "null")
    assert not accepted({"type": ["integer", "null"]}, "1" * 20)
    # inside a tool's arguments too
    spec = tool_spec(tiny_tokenizer, {"type": "object", "properties": {"n": plain},
                                      "required": ["n"]}, tool_choice="required")
    assert grammar_accepts(tiny_tokenizer, spec, as_call('{"n": -123}'))
    assert not grammar_accepts(tiny_tokenizer, spec, as_call('{"n": %s}' % ("6" * 20)))


def test_numbers_have_a_bounded_integer_part_at_most_ten_decimals_and_no_exponent(
        tiny_tokenizer):
    def accepted(schema, text):
        return grammar_accepts(tiny_tokenizer, json_spec(tiny_tokenizer, schema,
                                                         allow_thinking=False), text)

    plain = {"type": "number"}
    for text in ("0", "-1.5", "3", "9999999999999999.9999999999", "-0.0000000001"):
        assert accepted(plain, text), text
    for text in ("10000000000000000", "-10000000000000000", "0.12345678901", "1e5", "1E-3",
                 "1.5e10"):
        assert not accepted(plain, text), text
    # the schema's own bounds and step, where tighter, still narrow
    assert not accepted({"type": "number", "minimum": 0}, "-0.5")
    assert not accepted({"type": "number", "exclusiveMaximum": 2.5}, "2.5")
    stepped = CORPUS["number_bounds"]["properties"]["t"]
    assert accepted(stepped, "2.5")
    assert not accepted(stepped, "2.25")
    # a value the schema leaves free (json_object, {}, extra properties) is bounded too
    free = compile_constraint(tiny_tokenizer, response_format={"type": "json_object"},
                              allow_thinking=False)
    assert grammar_accepts(tiny_tokenizer, free, '{"a": [1.5, {"b": null}], "c": "d"}')
    assert not grammar_accepts(tiny_tokenizer, free, '{"a": [1, {"b": %s}]}' % ("1" * 17))
    assert not accepted({}, "0.12345678901")
    assert not accepted({"type": "array"}, "[%s]" % ("1" * 17))


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": 2**64},
    {"type": "integer", "maximum": -(2**63)},
    {"type": "number", "minimum": 1e20},
    {"type": "number", "maximum": -1e16},
])
def test_bounds_beyond_the_digits_a_number_may_have_are_400s(tiny_tokenizer, schema):
    with pytest.raises(ClientError) as info:
        json_spec(tiny_tokenizer, {"type": "object", "properties": {"v": schema}})
    assert info.value.param == "response_format.json_schema.schema"
    assert "bounds must overlap" in info.value.message


# ------------------------------------------------------------- tool choice


def tool_calls_in(tokenizer, text: str) -> list[dict]:
    """The calls of a reply that is (after any thinking block) nothing but tool calls."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    if text.startswith(tokenizer.think_start):
        text = text.partition(tokenizer.think_end)[2]
    assert text.lstrip().startswith(start), text
    blocks = [b.split(end)[0] for b in text.split(start)[1:]]
    return [tokenizer.tool_parser(b, None) for b in blocks]


def test_tool_choice_required_makes_a_valid_call_of_a_given_tool(demo):
    model, tokenizer = demo
    tools = [WEATHER, TIME]
    spec = compile_constraint(tokenizer, tools=tools, tool_choice="required")
    assert spec.kind == "tool_calls"
    prompts = ["What time is it in Tokyo?", "Hello", "What is 12 + 30?"]
    for content in prompts:
        prompt = chat(tokenizer, content, tools=tools)
        [(tokens, finished, _)] = constrained_generate(model, tokenizer, prompt, [spec], 64)
        assert finished
        calls = tool_calls_in(tokenizer, tokenizer.decode(tokens))
        assert calls
        for call in calls:
            parameters = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
            jsonschema.validate(call["arguments"], parameters[call["name"]])


def test_named_tool_choice_calls_that_function_even_when_the_model_wants_another(demo):
    model, tokenizer = demo
    tools = [WEATHER, TIME]
    prompt = chat(tokenizer, "What time is it in Tokyo?", tools=tools)
    [(free_tokens, _, _)] = constrained_generate(
        model, tokenizer, prompt,
        [compile_constraint(tokenizer, tools=tools, tool_choice="required")], 64)
    assert tool_calls_in(tokenizer, tokenizer.decode(free_tokens))[0]["name"] == "get_time"

    spec = compile_constraint(tokenizer, tools=tools, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    [(tokens, finished, _)] = constrained_generate(model, tokenizer, prompt, [spec], 64)
    assert finished
    [call] = tool_calls_in(tokenizer, tokenizer.decode(tokens))
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER["function"]["parameters"])
    # the other shapes of a named choice: Responses (flat) and Anthropic
    for choice in ({"type": "function", "name": "get_weather"},
                   {"type": "tool", "name": "get_weather"}):
        assert compile_constraint(tokenizer, tools=tools, tool_choice=choice) == spec


def test_tool_choice_none_never_produces_the_tool_call_marker(demo):
    model, tokenizer = demo
    tools = [WEATHER]
    prompt = chat(tokenizer, "What's the weather in Stockholm?", tools=tools)
    start = tokenizer.tool_call_start_tokens[0]
    # unconstrained, the demo model calls the tool here: the test can fail
    free_spec = ConstraintSpec(kind="no_tool_calls", grammar=None)
    [(free, _, _)] = constrained_generate(model, tokenizer, prompt, [free_spec], 8)
    assert free[0] == start

    spec = compile_constraint(tokenizer, tools=tools, tool_choice="none")
    assert spec.banned == ((start,),)
    [(tokens, _, _)] = constrained_generate(model, tokenizer, prompt, [spec], 48)
    assert tokens and start not in tokens
    assert tokenizer.tool_call_start not in tokenizer.decode(tokens)
    assert compile_constraint(tokenizer, tools=tools, tool_choice="auto") is None
    assert compile_constraint(tokenizer, tools=tools) is None


def test_json_reply_or_tool_call_when_both_are_asked_for(demo):
    model, tokenizer = demo
    tools = [WEATHER]
    schema = _object({"answer": {"type": "string", "maxLength": 40}})
    spec = json_spec(tokenizer, schema, tools=tools, allow_thinking=False)
    assert spec.kind == "json_schema|tool_calls"
    prompt = chat(tokenizer, "What's the weather in Oslo?", tools=tools)
    [(tokens, finished, _)] = constrained_generate(model, tokenizer, prompt, [spec], 64)
    assert finished
    [call] = tool_calls_in(tokenizer, tokenizer.decode(tokens))  # the model's own choice
    assert call == {"name": "get_weather", "arguments": {"city": "Oslo"}}


def test_multi_token_tool_marker_is_banned_as_a_sequence(tiny_model_path):
    from mlx_lm.tool_parsers import minicpm5
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer = TokenizerWrapper(hf, tool_parser=minicpm5.parse_tool_call,
                                 tool_call_start=minicpm5.tool_call_start,
                                 tool_call_end=minicpm5.tool_call_end)
    marker = tokenizer.tool_call_start_tokens
    assert len(marker) > 1
    spec = compile_constraint(tokenizer, tools=[WEATHER], tool_choice="none")
    gt = grammar_tokenizer(tokenizer)
    matcher, bitmask = spec.new_matcher(gt), gt.allocate(1)
    last = marker[-1]
    for token in marker[:-1]:
        fill_bitmasks([matcher], bitmask)
        assert (bitmask[0, token // 32] >> (token % 32)) & 1
        matcher.consume(token)
    fill_bitmasks([matcher], bitmask)
    assert not (bitmask[0, last // 32] >> (last % 32)) & 1
    # ... and a non-JSON tool format cannot be forced
    with pytest.raises(ClientError) as info:
        compile_constraint(tokenizer, tools=[WEATHER], tool_choice="required")
    assert info.value.param == "tool_choice" and "minicpm5" in info.value.message


# ---------------------------------------------------------------- thinking


def test_reasoning_runs_free_until_think_end_then_the_schema_applies(demo):
    model, tokenizer = demo
    schema = _object({"answer": {"type": "integer", "minimum": -99, "maximum": 198}})
    think_end = tokenizer.think_end
    # the prompt ends inside a thinking block (initial_state "reasoning")
    prompt = chat(tokenizer, "What is 47 + 85?") + list(tokenizer.think_start_tokens)
    inside = json_spec(tokenizer, schema, initial_state="reasoning")
    assert inside.start_in_reasoning and inside.think_start is None
    # the model opens the block itself (Qwen3's default), or may not
    opens = json_spec(tokenizer, schema)
    assert opens.think_start == tokenizer.think_start_tokens[0]
    plain = chat(tokenizer, "What is 47 + 85?")
    [(a, done_a, _)] = constrained_generate(model, tokenizer, prompt, [inside], 96)
    [(b, done_b, _)] = constrained_generate(model, tokenizer, plain, [opens], 96)
    for tokens, finished in ((a, done_a), (b, done_b)):
        assert finished
        text = tokenizer.decode(tokens)
        reasoning, _, answer = text.partition(think_end)
        assert "132" in reasoning, text  # it thought freely, in its own words
        validate(schema, answer)


def test_no_end_of_sequence_while_reasoning(tiny):
    _, tokenizer = tiny
    spec = json_spec(tokenizer, _object({"a": DIGIT}), initial_state="reasoning")
    gt = grammar_tokenizer(tokenizer)
    matcher, bitmask = spec.new_matcher(gt), gt.allocate(1)
    eos = next(iter(tokenizer.eos_token_ids))
    fill_bitmasks([matcher], bitmask)
    allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: gt.vocab_size]
    assert not allowed[eos] and allowed.sum() == gt.vocab_size - len(tokenizer.eos_token_ids)
    for token in tokenizer.think_end_tokens:
        matcher.consume(token)
    assert matcher.phase == "grammar"


# ------------------------------------------------------------ errors, ends


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
    ({"type": "string", "format": "zip-code"}, "zip-code"),
    ({"type": "string", "pattern": "^(?!x)"}, "look-around"),
    # x-guidance in a nested schema is no option: the keyword is still refused
    ({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}, "uniqueItems"),
])
def test_unsupported_schema_features_are_refused_by_name(tiny_tokenizer, schema, named):
    with pytest.raises(ClientError) as info:
        json_spec(tiny_tokenizer, {"type": "object", "properties": {"x": schema}})
    assert info.value.status == 400
    assert info.value.param == "response_format.json_schema.schema"
    assert named in info.value.message
    with pytest.raises(ClientError) as info:
        compile_constraint(tiny_tokenizer, response_format={"type": "json_schema", "name": "n",
                                                            "schema": schema},
                           response_format_param="text.format")
    # at the top of a schema, x-guidance's lenient mode is itself refused, by name
    top = "x-guidance.lenient" if "x-guidance" in schema else None
    assert info.value.param == ".".join(filter(None, ("text.format.schema", top)))
    assert (top or named) in info.value.message
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(ClientError) as info:
        compile_constraint(tiny_tokenizer, tools=[WEATHER, bad_tool], tool_choice="required")
    assert info.value.param == ".".join(filter(None, ("tools[1].function.parameters", top)))
    assert (top or named) in info.value.message


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": False}}},
     "response_format.json_schema.schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"},
     "tools[0].function.name"),
])
def test_malformed_fields_are_400s_naming_them(tiny_tokenizer, kwargs, param):
    with pytest.raises(ClientError) as info:
        compile_constraint(tiny_tokenizer, **kwargs)
    assert info.value.param == param


def test_free_requests_have_no_constraint(tiny_tokenizer):
    assert compile_constraint(tiny_tokenizer) is None
    assert compile_constraint(tiny_tokenizer, response_format={"type": "text"}) is None


def test_max_tokens_too_small_stops_with_partial_text_and_no_error(tiny):
    model, tokenizer = tiny
    spec = json_spec(tokenizer, CORPUS["six_fields"], allow_thinking=False)
    [(tokens, finished, matcher)] = constrained_generate(
        model, tokenizer, chat(tokenizer, "JSON"), [spec], max_tokens=5)
    assert len(tokens) == 5 and not finished and matcher.error is None
    text = tokenizer.decode(tokens)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert text.lstrip().startswith("{")


# ------------------------------------------------------- engine-side parts


def test_spec_is_picklable_and_the_grammar_tokenizer_is_cached(tiny_tokenizer):
    spec = json_spec(tiny_tokenizer, CORPUS["nested_2"])
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert grammar_tokenizer(tiny_tokenizer) is grammar_tokenizer(tiny_tokenizer)
    wide = grammar_tokenizer(tiny_tokenizer, 640)
    assert wide.vocab_size == 640 and wide.words == 20 and wide.allocate(3).shape == (3, 20)


def test_one_fill_writes_only_the_given_rows_and_padding_tokens_are_never_allowed(tiny):
    model, tokenizer = tiny
    gt = grammar_tokenizer(tokenizer, len(tokenizer.vocab) + 40)  # a model padded past its vocab
    specs = [json_spec(tokenizer, CORPUS[n]) for n in ("string_enum", "integer_array")]
    matchers = [s.new_matcher(gt) for s in specs]
    bitmask = gt.allocate(4)
    bitmask[:] = 12345
    fill_bitmasks(matchers, bitmask, [3, 1])
    assert (bitmask[[0, 2]] == 12345).all()
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    assert not allowed[[1, 3], len(tokenizer.vocab):].any()
    assert not (allowed[1] == allowed[3]).all()  # "{" for one, "[" for the other


def test_matchers_of_one_grammar_are_copies_of_one_compiled_template(tiny_tokenizer, monkeypatch):
    """A grammar seen again is copied, not compiled again; each copy has its own state;
    the templates kept are bounded, the oldest dropped first."""
    import runtime.grammar.matcher as matcher_module

    gt = grammar_tokenizer(tiny_tokenizer, 700)  # a tokenizer of its own: no templates yet
    spec = json_spec(tiny_tokenizer, CORPUS["integer_bounds"], allow_thinking=False)
    others = [json_spec(tiny_tokenizer, CORPUS[n], allow_thinking=False)
              for n in ("string_enum", "integer_array")]
    compiled = []
    real = matcher_module.llguidance.LLMatcher

    def counting(*args, **kwargs):
        compiled.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(matcher_module.llguidance, "LLMatcher", counting)
    first, second = spec.new_matcher(gt), spec.new_matcher(gt)
    assert compiled == [spec.grammar]
    first.consume(tiny_tokenizer.encode("x", add_special_tokens=False)[0])  # outside: fails
    assert first.phase == "failed" and second.phase == "grammar"
    bitmask = gt.allocate(1)
    fill_bitmasks([second], bitmask)
    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
    assert set(allowed) != set(tiny_tokenizer.eos_token_ids)  # the copy starts afresh
    monkeypatch.setattr(matcher_module, "MATCHER_TEMPLATES", 2)
    for other in others:
        other.new_matcher(gt)
    spec.new_matcher(gt)  # pushed out by the two others: compiled again
    assert compiled == [spec.grammar, others[0].grammar, others[1].grammar, spec.grammar]


def test_masks_filled_on_the_pool_equal_those_filled_one_by_one(tiny_tokenizer, monkeypatch):
    import runtime.grammar.matcher as matcher_module

    gt = grammar_tokenizer(tiny_tokenizer)
    specs = [json_spec(tiny_tokenizer, CORPUS[n], allow_thinking=False)
             for n in ("string_enum", "integer_array", "integer_bounds", "nested_2")]
    masks = []
    for min_rows in (1, 1000):  # every fill on the pool, then every fill one by one
        monkeypatch.setattr(matcher_module, "PARALLEL_FILL_MIN_ROWS", min_rows)
        matchers = [s.new_matcher(gt) for s in specs]
        bitmask = gt.allocate(len(matchers))
        fill_bitmasks(matchers, bitmask)
        masks.append(bitmask.copy())
    assert (masks[0] == masks[1]).all() and not (masks[0] == -1).all()


def test_a_token_outside_the_grammar_ends_the_row(tiny_tokenizer):
    spec = json_spec(tiny_tokenizer, CORPUS["integer_bounds"], allow_thinking=False)
    gt = grammar_tokenizer(tiny_tokenizer)
    matcher, bitmask = spec.new_matcher(gt), gt.allocate(1)
    matcher.consume(tiny_tokenizer.encode("x", add_special_tokens=False)[0])
    assert matcher.phase == "failed" and matcher.error
    fill_bitmasks([matcher], bitmask)
    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
    assert set(allowed) == set(tiny_tokenizer.eos_token_ids)
