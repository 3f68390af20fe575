"""Structured outputs and enforced tool choice at the API edge: a Session's ``constrain`` step.

Receives what a request of any endpoint asks of its output (a
``response_format`` in either OpenAI shape, ``tools``, ``tool_choice`` in any
of the three APIs' shapes, whether calls may be parallel, and the chat
template arguments, for ``enable_thinking``). Emits the ``constrain``
callable a ``Session`` runs in its worker thread right after the prompt is
prepared (``runtime.grammar.compile_constraint`` with the prompt's
``initial_state``), or ``None`` when the request asks for nothing the engine
must enforce. Also the checks of the chat-completions fields' shapes, stated
on the fields (``api.schemas``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from api.errors import InvalidParam
from runtime.grammar import compile_constraint
from runtime.messages import PreparedPrompt

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
TOOL_CHOICE_MODES = ("auto", "none", "required")


def constrain_step(
    *,
    response_format: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool = True,
    template_args: Mapping[str, Any] | None = None,
    response_format_param: str = "response_format",
) -> Callable[[Any, PreparedPrompt], Any] | None:
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
    return functools.partial(
        _compile,
        response_format=response_format,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        allow_thinking=allow_thinking,
        response_format_param=response_format_param,
    )


def _compile(tokenizer, prompt: PreparedPrompt, **fields):
    return compile_constraint(tokenizer, initial_state=prompt.initial_state, **fields)


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
