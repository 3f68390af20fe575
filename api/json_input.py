"""What a request's JSON may hold, checked right after it is parsed.

Receives JSON text (a request body, ``api.http.read_json``, or a JSON string
inside one: a tool call's ``arguments``); emits the parsed value, or a
``ClientError`` (400) naming where the problem is:

* nesting deeper than ``MAX_DEPTH`` arrays and objects (the body itself is
  level 1): ``param`` is the path of the first array or object past the
  limit, e.g. ``messages[0].content[0][0]...``. Python's json parser
  recurses, as does code that reads the fields later, and a body nested
  about a thousand levels exhausts the interpreter's stack;
* a lone UTF-16 surrogate (``"\\ud800"`` without its pair): Python's json
  module accepts the escape and makes a ``str`` that cannot be encoded to
  UTF-8, which the tokenizer refuses. ``param`` is the field holding it (a
  string value, or the key itself when it is in an object key).

The tree is walked only when the text could hold the problem: more ``[``
and ``{`` than ``MAX_DEPTH`` (a large agent request with many tools: about
half a millisecond for 70 KB), or a ``\\uD800``-``\\uDFFF`` escape (a
surrogate pair is joined by the parser; only strings that are not ASCII are
searched). A text too deep for the parser is scanned without recursion for
the same path. Paths are written as the other 400s write them
(``tools[0].function.name``); a key that is not an identifier is quoted,
``metadata["a b"]``, and a lone surrogate in it escaped (``\\ud800``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from runtime.errors import ClientError

MAX_DEPTH = 64

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The tokens of JSON text that shape its tree: strings (their brackets are text) and punctuation.
_STRUCTURE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:,]')

Part = str | int  # an object key or an array index


def loads(
    text: str,
    *,
    where: str | None = None,
    parse_constant: Callable[[str], Any] | None = None,
) -> Any:
    """``json.loads(text)``, refusing nesting past ``MAX_DEPTH`` and lone surrogates.

    ``where``: the request field ``text`` came from (a JSON string inside the
    body); its errors name that field, and their message says where inside.
    Invalid JSON raises ``json.JSONDecodeError`` (or ``parse_constant``'s
    error), for the caller to word.
    """
    try:
        value = json.loads(text, parse_constant=parse_constant)
    except RecursionError:
        # Only a text nested far past the limit exhausts the parser's stack.
        raise _too_deep(_deep_path_in_text(text), where) from None
    could_be_deep = text.count("[") + text.count("{") > MAX_DEPTH
    could_hold_surrogates = _SURROGATE_ESCAPE.search(text) is not None
    if could_be_deep or could_hold_surrogates:
        found = _find(value, 1, could_hold_surrogates)
        if found is not None:
            kind, parts = found
            parts.reverse()
            if kind == "depth":
                raise _too_deep(parts, where)
            raise _surrogate(parts, where, in_key=kind == "key")
    return value


def _find(value: Any, level: int, surrogates: bool) -> tuple[str, list[Part]] | None:
    """The first problem in ``value`` (at nesting ``level``), in document order:
    "depth" (an array or object past ``MAX_DEPTH``), "string" or "key" (a lone
    surrogate, looked for with ``surrogates``), and its path, innermost first."""
    kind = type(value)
    if kind is str:
        return ("string", []) if surrogates and _lone_surrogate(value) else None
    if kind is not dict and kind is not list:
        return None
    if level > MAX_DEPTH:
        return "depth", []
    level += 1
    if kind is dict:
        for key, item in value.items():
            if surrogates and _lone_surrogate(key):
                return "key", [key]
            inner = type(item)
            if inner is dict or inner is list or (surrogates and inner is str):
                found = _find(item, level, surrogates)
                if found is not None:
                    found[1].append(key)
                    return found
    else:
        for i, item in enumerate(value):
            inner = type(item)
            if inner is dict or inner is list or (surrogates and inner is str):
                found = _find(item, level, surrogates)
                if found is not None:
                    found[1].append(i)
                    return found
    return None


def _lone_surrogate(text: str) -> bool:
    # After parsing, any surrogate left is a lone one (the parser joins pairs).
    return not text.isascii() and _SURROGATE.search(text) is not None


def path_text(parts: list[Part]) -> str:
    """``["messages", 0, "content"]`` -> ``messages[0].content``; lone surrogates escaped."""
    out = []
    for part in parts:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif _IDENTIFIER.fullmatch(part):
            out.append(f".{part}" if out else part)
        else:
            out.append(f"[{json.dumps(part, ensure_ascii=False)}]")
    return "".join(out).encode("utf-8", "backslashreplace").decode("utf-8")


def _within(parts: list[Part], where: str | None) -> tuple[str | None, str]:
    """(param, the place the message names) of a problem at ``parts``."""
    path = path_text(parts)
    if where is None:
        return path or None, path or "the request body"
    return where, f"{where} (at {path or 'its top level'})"


def _too_deep(parts: list[Part] | None, where: str | None) -> ClientError:
    if parts is None:  # the parser's stack ran out, but not at a nesting the scan found
        return ClientError(f"JSON nested deeper than {MAX_DEPTH} levels", param=where)
    param, place = _within(parts, where)
    return ClientError(
        f"{place}: JSON nested deeper than {MAX_DEPTH} levels of arrays and objects",
        param=param,
    )


def _surrogate(parts: list[Part], where: str | None, *, in_key: bool) -> ClientError:
    param, place = _within(parts, where)
    return ClientError(
        f"{place}: {'the key' if in_key else 'the text'} contains a lone UTF-16 surrogate "
        "(a \\uD800-\\uDFFF escape without its pair), which is not valid Unicode",
        param=param,
    )


def _deep_path_in_text(text: str) -> list[Part] | None:
    """The path of the first array or object past ``MAX_DEPTH`` in JSON text, read
    without recursion (for a text too deep for the parser), or None if none is."""
    frames: list[list] = []  # [key or index, expecting a key] of each open container
    for match in _STRUCTURE.finditer(text):
        token = match.group()
        if token == "[" or token == "{":
            if len(frames) >= MAX_DEPTH:
                return [frame[0] for frame in frames]
            frames.append([0, False] if token == "[" else ["", True])
        elif token == "]" or token == "}":
            if frames:
                frames.pop()
        elif not frames:
            continue
        elif token == ",":
            top = frames[-1]
            if isinstance(top[0], int):
                top[0] += 1
            else:
                top[1] = True
        elif token == ":":
            frames[-1][1] = False
        elif frames[-1][1]:  # a string where an object expects its next key
            try:
                frames[-1][0] = json.loads(token)
            except ValueError:
                frames[-1][0] = token
    return None
