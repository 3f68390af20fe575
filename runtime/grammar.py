"""Structured outputs and enforced tool choice: constraints as grammars, masks per row.

Two halves, one per side of the engine boundary (no trio, no HTTP, no MLX):

* **Request side** (a trio worker thread; tokenizer-only work):
  ``compile_constraint`` receives a request's ``response_format`` (chat
  completions' nested ``json_schema`` shape or the Responses API's flat
  ``text.format`` shape), ``tools`` and ``tool_choice`` plus the prompt's
  initial text state, and returns a picklable ``ConstraintSpec`` (a
  llguidance grammar and the token ids of the model's markers) or ``None``
  when nothing is constrained. Bad input, a schema feature the engine cannot
  enforce, or a tool-call format it cannot constrain raise ``ClientError``
  (400) naming the field.
* **Engine side**: ``grammar_tokenizer`` turns the model's tokenizer into
  llguidance's form once (cached per tokenizer and mask width);
  ``ConstraintSpec.new_matcher`` makes one ``RowMatcher`` per sequence;
  ``fill_bitmasks`` fills the packed token bitmasks of all constrained rows
  of a step in ONE llguidance call (parallel over its thread pool). Layout:
  int32 words, bit ``j`` of word ``i`` allows token ``32 * i + j``.

A row goes through phases: ``reasoning`` (the prompt ends inside a thinking
block, or the model opened one: anything but end-of-sequence until the
think-end marker), ``grammar`` (llguidance decides; once the grammar is
complete only end-of-sequence tokens are allowed) and, for
``tool_choice: "none"``, ``free`` (everything but the tool-call start marker).
A grammar that cannot finish within ``max_tokens`` simply runs out of tokens
(finish reason ``length``): nothing here needs to know.

The engine was chosen by measurement (``bench/grammar_engines.py``,
``docs/structured-outputs.md``): llguidance refuses the JSON Schema keywords
it cannot enforce by name instead of ignoring them, compiles in under a
millisecond whatever the vocabulary, and installs as one 8 MB wheel.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from runtime.errors import ClientError

log = logging.getLogger(__name__)

# Whitespace the JSON grammar allows between tokens: what JSON writers produce
# (nothing, one or two spaces, or a newline and an indent of up to 32 spaces
# or tabs), so a model writes JSON compact or pretty-printed as it was trained
# to, but cannot loop on whitespace.
JSON_WHITESPACE = r"(?:[\x20\x09]{0,2}|\r?\n[\x20\x09]{0,32})"
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE, "lenient": False}
# Before the constrained text (after a think-end marker models write "\n\n").
LEADING_WHITESPACE = r"/[\x20\x0A\x0D\x09]{1,4}/"
MAX_GRAMMAR_CHARS = 512 * 1024

# Tool-call formats whose call text is JSON and can be constrained, by mlx-lm
# tool parser module name (mlx_lm/tool_parsers/<name>.py).
JSON_TOOL_PARSERS = frozenset({"json_tools"})


# ----------------------------------------------------------- request side


@attrs.frozen(kw_only=True)
class ConstraintSpec:
    """What the engine needs to constrain one sequence; picklable.

    ``grammar`` is llguidance's serialized grammar (``None`` for
    ``tool_choice: "none"``, which only bans tokens). ``start_in_reasoning``:
    the prompt ends inside a thinking block, so the constraint starts after
    ``think_end``. ``think_start``: a single token with which the model may
    open a thinking block before the constrained text. ``banned``: token
    sequences never produced (the tool-call start marker).
    """

    kind: str  # "json_object" | "json_schema" | "tool_calls" | "no_tool_calls" (+ "|tool_calls")
    grammar: str | None
    start_in_reasoning: bool = False
    think_start: int | None = None
    think_end: tuple[int, ...] = ()
    banned: tuple[tuple[int, ...], ...] = ()

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
    json_schema, json_kind = _response_schema(response_format, response_format_param)
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
        return ConstraintSpec(kind="no_tool_calls", grammar=None, banned=banned)
    if initial_state not in ("normal", "reasoning"):
        raise ClientError(
            f"this model starts its replies in the {initial_state!r} state; structured outputs "
            "and tool_choice cannot be enforced for it", param=error_param)

    alternatives: list[str] = []
    kind = ""
    if json_schema is not None and choice not in ("required", "named"):
        schema_param = _schema_param(response_format, response_format_param)
        alternatives.append(_json_rule(json_schema, schema_param))
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
) -> tuple[Any, str]:
    """(JSON Schema or None, kind) from either shape of response_format."""
    if response_format is None:
        return None, ""
    if not isinstance(response_format, Mapping):
        raise ClientError(f"{param} must be an object", param=param)
    kind = response_format.get("type")
    if kind is None and "schema" in response_format:
        kind = "json_schema"  # a bare {name, schema, strict}
    if kind in ("text", None):
        return None, ""
    if kind == "json_object":
        return {"type": "object"}, "json_object"
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
    return schema, "json_schema"


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


def _with_options(schema: Any) -> Any:
    """The schema with our JSON options (a client's own ``x-guidance`` is replaced:
    it could switch on lenient mode, which ignores unknown keywords)."""
    if schema is True:
        schema = {}
    body = {k: v for k, v in schema.items() if k != "x-guidance"}
    body["x-guidance"] = JSON_OPTIONS
    return body


def _json_rule(schema: Any, param: str) -> str:
    """A lark expression for a document of ``schema``; a ClientError names what fails."""
    if schema is False:
        raise ClientError(f"{param} is false: no document satisfies it", param=param)
    body = _with_options(schema)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(body, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise ClientError(f"{param} is not a valid JSON Schema: {exc}", param=param) from None
    _check(grammar, param)
    return "%json " + json.dumps(body)


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
    variants = []
    for tool in tools:
        _json_rule(tool.parameters, tool.param)  # names the tool's field on failure
        variants.append({
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    call_schema = _with_options(variants[0] if len(variants) == 1 else {"anyOf": variants})
    start = _lark_token(markers.tool_start, markers.tool_start_text)
    end = _lark_token(markers.tool_end, markers.tool_end_text)
    call = f'{start} "\\n"? %json {json.dumps(call_schema)} "\\n"? {end}'
    if parallel and choice != "named":
        return f'({call}) ("\\n"? {call})*'
    return call


# ------------------------------------------------------------- engine side


class GrammarTokenizer:
    """A tokenizer in llguidance's form, for masks ``vocab_size`` tokens wide.

    Build through ``grammar_tokenizer`` (cached). ``vocab_size`` is the
    model's logits width, which may exceed the tokenizer's own vocabulary;
    tokens past the tokenizer's are never allowed.
    """

    def __init__(self, tokenizer, vocab_size: int | None = None):
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or {hf.eos_token_id})
        self.ll = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = self.ll.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self.eos_token_ids = tuple(eos)
        every = np.full(self.words, -1, dtype=np.int32)
        tail = self.vocab_size % 32
        if tail:
            every.view(np.uint32)[-1] = (1 << tail) - 1
        self.every_row = every
        self.no_eos_row = _with_bits(every, eos, False)
        self.eos_only_row = _with_bits(np.zeros(self.words, dtype=np.int32), eos, True)

    def allocate(self, rows: int) -> np.ndarray:
        """A C-contiguous (rows, words) int32 bitmask, all allowed."""
        return llguidance.numpy.allocate_token_bitmask(rows, self.vocab_size)


_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def grammar_tokenizer(tokenizer, vocab_size: int | None = None) -> GrammarTokenizer:
    """The cached ``GrammarTokenizer`` of ``tokenizer`` for masks ``vocab_size`` wide.

    The first call per tokenizer costs ~0.02 s for a 1k vocabulary and a few
    seconds for 150k (build it when the model loads); later calls are a
    dictionary lookup. Thread-safe.
    """
    with _tokenizers_lock:
        by_size = _tokenizers.setdefault(tokenizer, {})
        built = by_size.get(vocab_size)
        if built is None:
            built = by_size[vocab_size] = GrammarTokenizer(tokenizer, vocab_size)
        return built


def _with_bits(row: np.ndarray, tokens, allowed: bool) -> np.ndarray:
    row = row.copy()
    bits = row.view(np.uint32)
    for token in tokens:
        if allowed:
            bits[token // 32] |= np.uint32(1 << (token % 32))
        else:
            bits[token // 32] &= ~np.uint32(1 << (token % 32))
    return row


class RowMatcher:
    """One sequence's constraint state on the engine side.

    ``consume(token)`` with every token the sequence produces;
    ``fill_bitmasks`` writes what it allows next. A token the mask did not
    allow (the caller skipped the mask) puts the matcher in the ``failed``
    phase: it then allows only end-of-sequence, and ``error`` says why.
    """

    __slots__ = ("spec", "phase", "error", "_ll", "_tokenizer", "_started", "_recent", "_free_row")

    def __init__(self, spec: ConstraintSpec, tokenizer: GrammarTokenizer):
        self.spec = spec
        self._tokenizer = tokenizer
        self.error: str | None = None
        self._started = False  # any token consumed yet
        self._recent: list[int] = []  # the last few tokens, for multi-token markers
        self._ll = None
        if spec.grammar is not None:
            self._ll = llguidance.LLMatcher(tokenizer.ll, spec.grammar, log_level=0)
            if self._ll.is_error():
                raise ValueError(f"grammar rejected by the engine: {self._ll.get_error()}")
        singles = [seq[0] for seq in spec.banned if len(seq) == 1]
        if spec.grammar is None:
            self.phase = "free"
            self._free_row = _with_bits(tokenizer.every_row, singles, False)
        else:
            self.phase = "reasoning" if spec.start_in_reasoning else "grammar"
            # reasoning: anything but the end of the sequence (the constrained text must follow)
            self._free_row = _with_bits(tokenizer.no_eos_row, singles, False)

    def consume(self, token: int) -> None:
        opening = self.may_open_thinking
        self._started = True
        if self.phase == "grammar":
            if opening and token == self.spec.think_start:
                self.phase = "reasoning"  # the model opened a thinking block first
                self._remember(token)
            elif not self._ll.consume_token(token):
                self._fail(f"token {token} is outside the grammar: {self._ll.get_error()}")
        elif self.phase == "reasoning":
            self._remember(token)
            end = self.spec.think_end
            if end and tuple(self._recent[-len(end):]) == end:
                self.phase = "grammar"
        elif self.phase == "free":
            self._remember(token)

    @property
    def may_open_thinking(self) -> bool:
        return self.phase == "grammar" and self.spec.think_start is not None and not self._started

    def _remember(self, token: int) -> None:
        self._recent.append(token)
        keep = max([len(self.spec.think_end)] + [len(s) for s in self.spec.banned])
        if len(self._recent) > keep:
            del self._recent[:-keep]

    def _fail(self, reason: str) -> None:
        log.warning("constrained sequence left its grammar (%s); ending it", reason)
        self.phase, self.error = "failed", reason

    def _fix_row(self, row: np.ndarray) -> None:
        """Bits the grammar alone does not set: an optional thinking opening, banned sequences."""
        bits = row.view(np.uint32)
        if self.may_open_thinking:
            t = self.spec.think_start
            bits[t // 32] |= np.uint32(1 << (t % 32))
        if self.phase in ("free", "reasoning"):
            for seq in self.spec.banned:
                if len(seq) > 1 and tuple(self._recent[-(len(seq) - 1):]) == seq[:-1]:
                    t = seq[-1]
                    bits[t // 32] &= ~np.uint32(1 << (t % 32))


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _shared_executor() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()  # 80 % of the CPUs, at most 32 threads
        return _executor


def fill_bitmasks(
    matchers: Sequence[RowMatcher], bitmask: np.ndarray, rows: Sequence[int] | None = None
) -> None:
    """Write what each matcher allows next into ``bitmask[rows[i]]`` (default: row ``i``).

    ``bitmask``: a C-contiguous int32 array ``(n, words)`` with ``words ==
    tokenizer.words`` (``GrammarTokenizer.allocate``). All rows in the grammar
    phase are filled by one llguidance call, in parallel on its thread pool
    (the GIL is released); the others get precomputed rows.
    """
    if rows is None:
        rows = range(len(matchers))
    grammar_rows, grammar_matchers = [], []
    for matcher, row in zip(matchers, rows, strict=True):
        if matcher.phase == "grammar":
            grammar_rows.append((matcher._ll, row))
            grammar_matchers.append(matcher)
        elif matcher.phase == "failed":
            bitmask[row] = matcher._tokenizer.eos_only_row
        else:
            bitmask[row] = matcher._free_row
    if grammar_rows:
        llguidance.numpy.fill_next_token_bitmask_par(_shared_executor(), grammar_rows, bitmask)
        for matcher, (ll, row) in zip(grammar_matchers, grammar_rows, strict=True):
            if ll.is_error():  # e.g. a parser limit hit while computing this mask
                matcher._fail(ll.get_error())
                bitmask[row] = matcher._tokenizer.eos_only_row
    for matcher, row in zip(matchers, rows, strict=True):
        if matcher.spec.think_start is not None or matcher.spec.banned:
            matcher._fix_row(bitmask[row])
