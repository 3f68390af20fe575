"""Structured outputs and enforced tool choice at the API edge: a Session's ``constrain`` step.

Receives what a request of any endpoint asks of its output (a
``response_format`` in either OpenAI shape, ``tools``, ``tool_choice`` in any
of the three APIs' shapes, whether calls may be parallel, and the chat
template arguments, for ``enable_thinking``). Emits the ``constrain``
step a ``Session`` runs right after the prompt is prepared (a ``ConstrainStep``:
``runtime.grammar.compile_constraint`` with the prompt's ``initial_state``, in a
worker thread unless compiled lately), or ``None`` when the request asks for
nothing the engine must enforce. Also the checks of the chat-completions fields' shapes, stated
on the fields (``api.schemas``).
"""

from __future__ import annotations

import collections
import json
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from api.errors import InvalidParam
from runtime.grammar import ConstraintSpec, compile_constraint
from runtime.messages import PreparedPrompt

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# Constraints compiled lately, kept per tokenizer: the same schema or tools come
# again and again (an agent sends its tools with every turn), and building and
# checking a grammar costs milliseconds of the worker thread (more for many tools).
COMPILED_CONSTRAINTS = 64
TOOL_CHOICE_MODES = ("auto", "none", "required")


def constrain_step(
    *,
    response_format: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool = True,
    template_args: Mapping[str, Any] | None = None,
    response_format_param: str = "response_format",
) -> ConstrainStep | None:
    """The Session's ``constrain(tokenizer, prompt)`` for these fields, or ``None``.

    ``None`` when there is no ``response_format`` (or it is ``text``) and no
    ``tool_choice`` beyond ``auto``: the output is free, nothing is compiled.
    ``enable_thinking: false`` in ``template_args`` also forbids the model to
    open a thinking block before the constrained text.
    """
    free_format = response_format is None or (
        isinstance(response_format, Mapping) and response_format.get("type") == "text"
    )
    if free_format and tool_choice in (None, "auto"):
        return None
    allow_thinking = (template_args or {}).get("enable_thinking", True) is not False
    return ConstrainStep(dict(
        response_format=response_format,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        allow_thinking=allow_thinking,
        response_format_param=response_format_param,
    ))


_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compiled_lock = threading.Lock()


class ConstrainStep:
    """One request's constraint fields; called, ``compile_constraint`` for them, or the
    same fields' spec compiled lately (a field it refuses raises every time:
    refusals are not kept). ``recent`` only looks: the Session calls it on the trio
    thread and hands a miss to a worker thread, so a request whose grammar is
    already compiled (an agent's tools, every turn) takes no thread hop."""

    def __init__(self, fields: dict[str, Any]):
        self.fields = fields

    def _key(self, prompt: PreparedPrompt) -> str:
        return json.dumps([prompt.initial_state, self.fields], sort_keys=True, default=repr)

    def recent(self, tokenizer, prompt: PreparedPrompt) -> ConstraintSpec | None:
        """The spec compiled lately for these fields and this prompt's start, or None."""
        key = self._key(prompt)
        with _compiled_lock:
            recent = _compiled.get(tokenizer)
            if recent is None or key not in recent:
                return None
            recent.move_to_end(key)
            return recent[key]

    def __call__(self, tokenizer, prompt: PreparedPrompt) -> ConstraintSpec:
        spec = self.recent(tokenizer, prompt)
        if spec is not None:
            return spec
        spec = compile_constraint(tokenizer, initial_state=prompt.initial_state, **self.fields)
        with _compiled_lock:
            recent = _compiled.setdefault(tokenizer, collections.OrderedDict())
            recent[self._key(prompt)] = spec
            while len(recent) > COMPILED_CONSTRAINTS:
                recent.popitem(last=False)
        return spec


# ------------------------------------------------ field checks (api.schemas)


def check_response_format(name: str, value: Mapping[str, Any]) -> None:
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise InvalidParam(
            f"{name}.type", f"{name}.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}"
        )
    if kind == "json_schema" and not isinstance(value.get("json_schema"), Mapping):
        raise InvalidParam(
            f"{name}.json_schema", f"{name} of type json_schema needs a json_schema object"
        )


def check_tool_choice(name: str, value: str | Mapping[str, Any]) -> None:
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise InvalidParam(
                name, f"{name} must be {', '.join(TOOL_CHOICE_MODES)} or a function object"
            )
        return
    if value.get("type") != "function":
        raise InvalidParam(f"{name}.type", f"{name}.type must be 'function'")
    function = value.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidParam(f"{name}.function.name", f"{name} must name a function")
