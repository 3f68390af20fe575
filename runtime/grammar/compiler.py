"""Structured outputs and enforced tool choice, request side: a request's constraint as a grammar.

Runs in a trio worker thread, right after the prompt is prepared (tokenizer-only
work, no MLX, ~1 ms). ``compile_constraint`` receives a request's
``response_format`` (chat completions' nested ``json_schema`` shape or the
Responses API's flat ``text.format`` shape), ``tools`` and ``tool_choice``
plus the prompt's initial text state, and emits a picklable ``ConstraintSpec``
(a llguidance grammar and the token ids of the model's markers) or ``None``
when nothing is constrained. Bad input, a schema feature the engine cannot
enforce, or a tool-call format it cannot constrain raise ``ClientError``
(400) naming the field. The engine side is ``runtime.grammar.matcher``.

The engine was chosen by measurement (``bench/grammar_engines.py``,
``docs/structured-outputs.md``): llguidance refuses the JSON Schema keywords
it cannot enforce by name instead of ignoring them, compiles in under a
millisecond whatever the vocabulary, and installs as one 8 MB wheel.

Every JSON document is made to end: ``runtime.grammar.schema_bounds`` rewrites its
schema before llguidance sees it. Integers get 64-bit bounds and numbers a bounded integer
part and at most ten decimals where the schema leaves them
open (llguidance bounds digits only through ``minimum``/``maximum`` and a
decimal ``multipleOf``); values the schema leaves free (``{}``, ``true``,
extra properties) get the same bounds through one recursive definition; and
closed documents (``strict: true``, tool arguments) allow no properties the
schema does not name. Whitespace is fixed (``JSON_OPTIONS``) unless the
schema's top-level ``x-guidance`` asks for llguidance's flexible whitespace.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import llguidance

from runtime.errors import ClientError
from runtime.grammar.matcher import GrammarTokenizer, RowMatcher
from runtime.grammar.schema_bounds import SchemaBounds

log = logging.getLogger(__name__)

# JSON as the grammar writes it: one space after each separator and no other
# whitespace ({"a": 1, "b": [1, 2]}: Python's json.dumps and the Hermes tool-call
# style). Free whitespace lets a model that prefers it (a small or random one) pad
# every gap until max_tokens.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False,
                "lenient": False}
# llguidance's JSON options a schema may set in its top-level "x-guidance" (the
# rest, lenient mode above all, would let keywords go unenforced): the whitespace.
WHITESPACE_OPTIONS = {"whitespace_flexible": bool, "whitespace_pattern": str,
                      "item_separator": str, "key_separator": str}
# Before the constrained text (after a think-end marker models write "\n\n").
LEADING_WHITESPACE = r"/[\x20\x0A\x0D\x09]{1,4}/"
MAX_GRAMMAR_CHARS = 512 * 1024

# Tool-call formats whose call text is JSON and can be constrained, by mlx-lm
# tool parser module name (mlx_lm/tool_parsers/<name>.py).
JSON_TOOL_PARSERS = frozenset({"json_tools"})


@attrs.frozen(kw_only=True)
class ConstraintSpec:
    """What the engine needs to constrain one sequence; picklable.

    ``grammar`` is llguidance's serialized grammar (``None`` for
    ``tool_choice: "none"``, which only bans tokens). ``start_in_reasoning``:
    the prompt ends inside a thinking block, so the constraint starts after
    ``think_end``. ``think_start``: a single token with which the model may
    open a thinking block before the constrained text. ``banned``: token
    sequences never produced (the tool-call start marker). ``param``: the
    request field that asked for the constraint (``response_format``,
    ``text.format`` or ``tool_choice``), for refusals made after compiling.
    """

    kind: str  # "json_object" | "json_schema" | "tool_calls" | "no_tool_calls" (+ "|tool_calls")
    grammar: str | None
    start_in_reasoning: bool = False
    think_start: int | None = None
    think_end: tuple[int, ...] = ()
    banned: tuple[tuple[int, ...], ...] = ()
    param: str = "response_format"

    def new_matcher(self, tokenizer: GrammarTokenizer) -> RowMatcher:
        return RowMatcher(self, tokenizer)


def compile_constraint(
    tokenizer,
    *,
    response_format: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool = True,
    initial_state: str = "normal",
    allow_thinking: bool = True,
    response_format_param: str = "response_format",
) -> ConstraintSpec | None:
    """A request's constraint, or ``None`` when its output is free.

    ``tokenizer`` is mlx-lm's ``TokenizerWrapper`` (its tool-call and think
    markers are read; nothing is built). ``initial_state`` is the prompt's
    (``PreparedPrompt.initial_state``): ``"reasoning"`` lets the model finish
    its thinking freely before the constraint applies. ``allow_thinking`` lets
    a model whose prompt does not open a thinking block open one itself first
    (Qwen3's default). ``response_format_param`` names the field in errors
    (``"text.format"`` on the Responses API).

    Raises ``ClientError`` for a malformed field, a schema feature that cannot
    be enforced (named), or a tool choice this model's tool format cannot obey.
    """
    json_schema, json_kind, strict = _response_schema(response_format, response_format_param)
    choice = _tool_choice_mode(tool_choice)
    function_tools = _function_tools(tools)

    if choice in ("required", "named") and not function_tools:
        raise ClientError(f"tool_choice {choice!r} needs at least one function in tools",
                          param="tool_choice")
    if choice == "named":
        name = _named_function(tool_choice)
        if name not in {t.name for t in function_tools}:
            raise ClientError(f"tool_choice names function {name!r}, which is not in tools",
                              param="tool_choice")
        function_tools = [t for t in function_tools if t.name == name]

    markers = _Markers.of(tokenizer)
    # With tool_choice "auto", a JSON reply and tool calls are both allowed (when the
    # model has a tool-call format at all: without one, its tools cannot be called).
    constrain_calls = choice in ("required", "named") or bool(
        choice == "auto" and json_schema is not None and function_tools and markers.tool_start
    )
    banned: tuple[tuple[int, ...], ...] = ()
    if choice == "none" and markers.tool_start:
        banned = (markers.tool_start,)
    if json_schema is None and not constrain_calls and not banned:
        return None
    error_param = response_format_param if json_schema is not None else "tool_choice"
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if not hasattr(hf, "backend_tokenizer"):  # llguidance reads the Rust tokenizer's JSON
        raise ClientError("this model's tokenizer is not a fast (tokenizers) tokenizer; "
                          "its output cannot be constrained", param=error_param)
    if json_schema is None and not constrain_calls:
        return ConstraintSpec(
            kind="no_tool_calls", grammar=None, banned=banned, param="tool_choice"
        )
    if initial_state not in ("normal", "reasoning"):
        raise ClientError(
            f"this model starts its replies in the {initial_state!r} state; structured outputs "
            "and tool_choice cannot be enforced for it", param=error_param)

    alternatives: list[str] = []
    kind = ""
    if json_schema is not None and choice not in ("required", "named"):
        schema_param = _schema_param(response_format, response_format_param)
        alternatives.append(_json_rule(json_schema, schema_param, closed=strict))
        kind = json_kind
    if constrain_calls:
        param = "tool_choice" if choice in ("required", "named") else response_format_param
        alternatives.append(
            _tool_calls_rule(markers, function_tools, choice, parallel_tool_calls, param)
        )
        kind = f"{kind}|tool_calls" if kind else "tool_calls"

    lark = "start: LEADING_WS? body\nbody: " + " | ".join(f"({a})" for a in alternatives)
    lark += f"\nLEADING_WS: {LEADING_WHITESPACE}\n"
    if len(lark) > MAX_GRAMMAR_CHARS:
        raise ClientError(f"the constraint is too large ({len(lark)} characters of grammar; "
                          f"at most {MAX_GRAMMAR_CHARS})", param=response_format_param)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    _check(grammar, error_param)

    start_in_reasoning = initial_state == "reasoning"
    if start_in_reasoning and not markers.think_end:
        raise ClientError("the prompt opens a thinking block but the model has no think-end "
                          "marker to close it", param=response_format_param)
    think_start = None
    if allow_thinking and not start_in_reasoning and markers.think_end:
        if len(markers.think_start) == 1:
            think_start = markers.think_start[0]
    return ConstraintSpec(
        kind=kind,
        grammar=grammar,
        start_in_reasoning=start_in_reasoning,
        think_start=think_start,
        think_end=markers.think_end,
        banned=banned,
        param=error_param,
    )


@attrs.frozen
class _Tool:
    name: str
    parameters: Any
    param: str  # where the parameters schema is in the request


@attrs.frozen
class _Markers:
    tool_parser: str | None
    tool_start: tuple[int, ...]
    tool_end: tuple[int, ...]
    tool_start_text: str
    tool_end_text: str
    think_start: tuple[int, ...]
    think_end: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer) -> _Markers:
        parser = getattr(tokenizer, "tool_parser", None)
        module = getattr(parser, "__module__", "") or ""
        name = module.rsplit(".", 1)[-1] if module.startswith("mlx_lm.tool_parsers.") else None
        if parser is not None and name is None:
            init = getattr(tokenizer, "init_kwargs", None) or {}
            name = init.get("tool_parser_type")
        has_thinking = getattr(tokenizer, "has_thinking", False)
        return cls(
            tool_parser=name,
            tool_start=tuple(getattr(tokenizer, "tool_call_start_tokens", None) or ()),
            tool_end=tuple(getattr(tokenizer, "tool_call_end_tokens", None) or ()),
            tool_start_text=getattr(tokenizer, "tool_call_start", None) or "",
            tool_end_text=getattr(tokenizer, "tool_call_end", None) or "",
            think_start=tuple(tokenizer.think_start_tokens or ()) if has_thinking else (),
            think_end=tuple(tokenizer.think_end_tokens or ()) if has_thinking else (),
        )


def _response_schema(
    response_format: Mapping[str, Any] | None, param: str
) -> tuple[Any, str, bool]:
    """(JSON Schema or None, kind, strict) from either shape of response_format."""
    if response_format is None:
        return None, "", False
    if not isinstance(response_format, Mapping):
        raise ClientError(f"{param} must be an object", param=param)
    kind = response_format.get("type")
    if kind is None and "schema" in response_format:
        kind = "json_schema"  # a bare {name, schema, strict}
    if kind in ("text", None):
        return None, "", False
    if kind == "json_object":
        return {"type": "object"}, "json_object", False
    if kind != "json_schema":
        raise ClientError(f"{param}.type must be 'text', 'json_object' or 'json_schema', "
                          f"not {kind!r}", param=f"{param}.type")
    inner = response_format.get("json_schema", response_format)
    inner_param = f"{param}.json_schema" if "json_schema" in response_format else param
    if not isinstance(inner, Mapping):
        raise ClientError(f"{inner_param} must be an object", param=inner_param)
    name = inner.get("name")
    if name is not None and not isinstance(name, str):
        raise ClientError(f"{inner_param}.name must be a string", param=f"{inner_param}.name")
    schema = inner.get("schema", {"type": "object"})
    if not isinstance(schema, (Mapping, bool)):
        raise ClientError(f"{inner_param}.schema must be a JSON Schema object",
                          param=f"{inner_param}.schema")
    return schema, "json_schema", inner.get("strict") is True


def _schema_param(response_format: Mapping[str, Any], param: str) -> str:
    return f"{param}.json_schema.schema" if "json_schema" in response_format else f"{param}.schema"


def _tool_choice_mode(tool_choice: str | Mapping[str, Any] | None) -> str:
    """One of auto / none / required / named (OpenAI chat and Responses, Anthropic shapes)."""
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice in ("auto", "none", "required"):
            return tool_choice
        raise ClientError(f"tool_choice must be 'auto', 'none', 'required' or a function, "
                          f"not {tool_choice!r}", param="tool_choice")
    if not isinstance(tool_choice, Mapping):
        raise ClientError("tool_choice must be a string or an object", param="tool_choice")
    kind = tool_choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":  # Anthropic's "required"
        return "required"
    if kind in ("function", "tool"):
        _named_function(tool_choice)
        return "named"
    raise ClientError(f"tool_choice type {kind!r} is not supported", param="tool_choice.type")


def _named_function(tool_choice: Mapping[str, Any]) -> str:
    function = tool_choice.get("function")
    if isinstance(function, Mapping):
        name, param = function.get("name"), "tool_choice.function.name"
    else:
        name, param = tool_choice.get("name"), "tool_choice.name"
    if not isinstance(name, str) or not name:
        raise ClientError("tool_choice must name a function", param=param)
    return name


def _function_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[_Tool]:
    """The callable functions, from chat (nested), Responses (flat) or Anthropic tools."""
    out = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, Mapping):
            raise ClientError("each tool must be an object", param=f"tools[{i}]")
        if "function" in tool:
            body, prefix, key = tool["function"], f"tools[{i}].function", "parameters"
        elif "input_schema" in tool:
            body, prefix, key = tool, f"tools[{i}]", "input_schema"
        elif tool.get("type", "function") == "function":
            body, prefix, key = tool, f"tools[{i}]", "parameters"
        else:
            continue  # a built-in tool the model never calls through its tool-call format
        if not isinstance(body, Mapping) or not isinstance(body.get("name"), str):
            raise ClientError("a function tool needs a name", param=f"{prefix}.name")
        parameters = body.get(key)
        if parameters is None:  # no parameters: the function takes none
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(parameters, (Mapping, bool)):
            raise ClientError(f"{prefix}.{key} must be a JSON Schema object",
                              param=f"{prefix}.{key}")
        out.append(_Tool(name=body["name"], parameters=parameters, param=f"{prefix}.{key}"))
    return out


def _json_document(schema: Any, param: str, *, closed: bool) -> dict:
    """The schema llguidance compiles for one document of ``schema``: rewritten so that
    its text ends (``SchemaBounds``), with our JSON options (whitespace as the schema's own
    ``x-guidance`` asks). A ClientError names what cannot be enforced."""
    if schema is False:
        raise ClientError(f"{param} is false: no document satisfies it", param=param)
    if schema is True:
        schema = {}
    options = _json_options(schema.get("x-guidance"), f"{param}.x-guidance")
    body = {k: v for k, v in schema.items() if k != "x-guidance"}
    body = SchemaBounds(body, closed=closed, param=param).rewrite()
    body["x-guidance"] = options
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(body)
    except (ValueError, TypeError) as exc:
        raise ClientError(f"{param} is not a valid JSON Schema: {exc}", param=param) from None
    _check(grammar, param)
    return body


def _json_rule(schema: Any, param: str, *, closed: bool) -> str:
    """A lark expression for a document of ``schema``."""
    return "%json " + json.dumps(_json_document(schema, param, closed=closed))


def _json_options(requested: Any, param: str) -> dict:
    """``JSON_OPTIONS`` with the whitespace a schema's top-level ``x-guidance`` asks for.

    ``whitespace_flexible: true`` (or a ``whitespace_pattern``) is llguidance's
    flexible whitespace: its own separators ``,`` and ``:`` with whitespace around
    them and between all tokens (by default any run of spaces, tabs, CR and LF,
    or the pattern). Separators given with it stay fixed.
    """
    options = dict(JSON_OPTIONS)
    if requested is None:
        return options
    if not isinstance(requested, Mapping):
        raise ClientError(f"{param} must be an object", param=param)
    for key, value in requested.items():
        kind = WHITESPACE_OPTIONS.get(key)
        if kind is None:
            raise ClientError(
                f"{param}.{key} is not supported: only the whitespace options "
                f"{', '.join(WHITESPACE_OPTIONS)} may be set", param=f"{param}.{key}")
        if not isinstance(value, kind):
            raise ClientError(f"{param}.{key} must be a {kind.__name__}", param=f"{param}.{key}")
    flexible = requested.get("whitespace_flexible", "whitespace_pattern" in requested)
    if not flexible and "whitespace_pattern" in requested:
        raise ClientError(f"{param}.whitespace_pattern needs whitespace_flexible true",
                          param=f"{param}.whitespace_pattern")
    if flexible:
        del options["item_separator"], options["key_separator"]
    options.update(requested)
    options["whitespace_flexible"] = flexible
    return options


def _check(grammar: str, param: str) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        detail = messages[0] if messages else "invalid grammar"
        raise ClientError(f"{param} cannot be enforced: {_describe(detail)}", param=param)
    for message in messages:
        if "no tokenizer" not in message:
            log.warning("grammar warning for %s: %s", param, message)


def _describe(message: str) -> str:
    """llguidance's message, trimmed of the grammar echo, with a plain lead for keywords."""
    message = " ".join(message.split("\n   1 |", 1)[0].split())
    if "Unimplemented keys" in message:
        keys = message.split("Unimplemented keys:", 1)[1].strip()
        return f"unsupported JSON Schema keyword(s) {keys}"
    return message


def _lark_token(tokens: tuple[int, ...], text: str) -> str:
    """A marker as a lark terminal: its token id when it is one token, else its text."""
    if len(tokens) == 1:
        return f"<[{tokens[0]}]>"
    return json.dumps(text)


def _tool_calls_rule(
    markers: _Markers, tools: list[_Tool], choice: str, parallel: bool, param: str
) -> str:
    if markers.tool_parser is None or not markers.tool_start:
        raise ClientError("this model has no tool-call format, so tool_choice "
                          f"{choice!r} cannot be enforced", param=param)
    if markers.tool_parser not in JSON_TOOL_PARSERS:
        raise ClientError(
            f"this model's tool-call format ({markers.tool_parser!r}) is not JSON and cannot be "
            f"constrained; tool_choice {choice!r} cannot be enforced (supported formats: "
            f"{', '.join(sorted(JSON_TOOL_PARSERS))})", param=param)
    # Each call is {"name": <name>, "arguments": <arguments>}, written as JSON_OPTIONS
    # writes it (one space after each separator); the arguments are one document of
    # the function's parameters, closed, with the whitespace their schema asks for.
    variants = []
    for tool in tools:
        head = '{"name": ' + json.dumps(tool.name) + ', "arguments": '
        arguments = _json_rule(tool.parameters, tool.param, closed=True)
        variants.append(f'{json.dumps(head)} {arguments} "}}"')
    start = _lark_token(markers.tool_start, markers.tool_start_text)
    end = _lark_token(markers.tool_end, markers.tool_end_text)
    body = " | ".join(f"({v})" for v in variants)
    call = f'{start} "\\n"? ({body}) "\\n"? {end}'
    if parallel and choice != "named":
        return f'({call}) ("\\n"? {call})*'
    return call
