"""Responses requests -> a ``ChatTurn``: input items, tools and settings in the chat form.

Receives a validated ``ResponsesRequest`` (``api.agents.responses_schema``)
and, for ``previous_response_id``, the stored response it names (looked up
by the route: ``api.agents.responses_store``); emits a ``PreparedRequest``: the ``ChatTurn`` to
generate (chat-template messages, function tools in the chat-completions
form, ``tool_choice`` and ``text.format`` as ``response_format``: enforced,
``api.structured``)
and what the response echoes. Input items are messages, ``function_call``,
``function_call_output`` and ``reasoning`` items; a request naming
``previous_response_id`` gets the stored conversation first. Output items are
turned back into messages by the same code (``input_messages``), so a client
that resends the output by hand gets the same prompt as one that names the
previous response. Every refusal is a ``ClientError`` naming the item's field
(``input[2].content[0].type``).
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from api.agents.blocks import ChatTurn, function_tool, merge_leading_system, tool_arguments
from api.agents.responses_db import StoredResponse
from api.agents.responses_schema import (
    IGNORED_TOOL_TYPES,
    ITEM_ROLES,
    TEXT_PARTS,
    ResponsesRequest,
    TextConfigIn,
)
from api.generation import effort_template_args, sampling_params
from api.schemas import GenerationFields
from runtime.config import ServerConfig
from runtime.errors import ClientError

log = logging.getLogger(__name__)

IMAGE_PARTS = ("input_image", "image_url", "image")

# ---------------------------------------------------- items -> chat messages


def _get(item: dict, key: str, path: str, kinds: type, *, required: bool = False):
    value = item.get(key)
    if value is None:
        if required:
            raise ClientError(f"{path}.{key}: is required", param=f"{path}.{key}")
        return None
    if not isinstance(value, kinds):
        raise ClientError(f"{path}.{key}: has the wrong type", param=f"{path}.{key}")
    return value


def _text(content, path: str) -> str:
    """A message's or tool output's content: a string or text parts, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ClientError(f"{path}: must be a string or an array of content parts", param=path)
    texts = []
    for k, part in enumerate(content):
        at = f"{path}[{k}]"
        if not isinstance(part, dict):
            raise ClientError(f"{at}: must be an object", param=at)
        kind = part.get("type")
        if kind in TEXT_PARTS:
            texts.append(_get(part, "text", at, str, required=True))
        elif kind == "refusal":
            texts.append(_get(part, "refusal", at, str, required=True))
        elif kind in IMAGE_PARTS:
            raise ClientError(
                f"{at}: images are accepted on /v1/chat/completions only (image_url parts, "
                "with a vision-language model)",
                param=at,
            )
        else:
            raise ClientError(
                f"{at}.type: content part type {kind!r} is not supported (text only)",
                param=f"{at}.type",
            )
    return "".join(texts)


class _Conversation:
    """Builds chat messages from Responses items, merging one assistant turn's items."""

    def __init__(self):
        self.messages: list[dict[str, Any]] = []
        self._reasoning: list[str] = []
        self._tool_names: dict[str, str] = {}

    def _assistant(self, *, for_calls: bool) -> dict[str, Any]:
        """The assistant message an item belongs to: the last one, unless text follows calls."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or (not for_calls and last.get("tool_calls")):
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        if self._reasoning:
            last["reasoning_content"] = last.get("reasoning_content", "") + "".join(self._reasoning)
            self._reasoning.clear()
        return last

    def add(self, item: Any, path: str) -> None:
        if not isinstance(item, dict):
            raise ClientError(f"{path}: must be an object", param=path)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _get(item, "role", path, str, required=True)
            if role not in ITEM_ROLES:
                raise ClientError(
                    f"{path}.role must be user, assistant, system or developer", param=f"{path}.role"
                )
            content = item.get("content")
            if content is None:
                raise ClientError(f"{path}.content: is required", param=f"{path}.content")
            text = _text(content, f"{path}.content")
            if role == "assistant":
                self._assistant(for_calls=False)["content"] += text
            else:
                self.messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id = _get(item, "call_id", path, str, required=True)
            name = _get(item, "name", path, str, required=True)
            arguments = tool_arguments(
                _get(item, "arguments", path, str, required=True), param=f"{path}.arguments"
            )
            self._tool_names[call_id] = name
            message = self._assistant(for_calls=True)
            message.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
        elif kind == "function_call_output":
            call_id = _get(item, "call_id", path, str, required=True)
            output = item.get("output")
            if output is None:
                raise ClientError(f"{path}.output: is required", param=f"{path}.output")
            tool: dict[str, Any] = {
                "role": "tool",
                "tool_call_id": call_id,
                "content": _text(output, f"{path}.output"),
            }
            if call_id in self._tool_names:
                tool["name"] = self._tool_names[call_id]
            self.messages.append(tool)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            self._reasoning.append(_text(parts, f"{path}.content"))
        else:
            raise ClientError(
                f"{path}.type: input item type {kind!r} is not supported (message, function_call, "
                "function_call_output, reasoning)",
                param=f"{path}.type",
            )


def input_messages(items: str | list, *, path: str = "input") -> list[dict[str, Any]]:
    """Responses input (or output) items as chat-template messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}] if items else []
    conversation = _Conversation()
    for i, item in enumerate(items):
        conversation.add(item, f"{path}[{i}]")
    return conversation.messages


def chat_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict] | None, dict[str, str]]:
    """Function tools in the chat form, and the namespace of each namespaced tool's name.

    A ``namespace`` tool's functions are offered to the model under their own
    names; a call of one comes back with its ``namespace`` set.
    """
    if not tools:
        return None, {}
    out: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}

    def function(tool: dict, path: str) -> dict:
        name = _get(tool, "name", path, str, required=True)
        parameters = _get(tool, "parameters", path, dict)
        return function_tool(name, _get(tool, "description", path, str), parameters)

    for i, tool in enumerate(tools):
        path = f"tools[{i}]"
        kind = tool.get("type")
        if kind == "function":
            out.append(function(tool, path))
        elif kind == "namespace":
            namespace = _get(tool, "name", path, str, required=True)
            for j, inner in enumerate(_get(tool, "tools", path, list, required=True)):
                at = f"{path}.tools[{j}]"
                if not isinstance(inner, dict) or inner.get("type") != "function":
                    raise ClientError(
                        f"{at}.type: only function tools are supported in a namespace", param=f"{at}.type"
                    )
                out.append(function(inner, at))
                namespaces[inner["name"]] = namespace
        elif kind in IGNORED_TOOL_TYPES:
            log.debug("ignoring a %s tool (not served by a local model)", kind)
        else:
            raise ClientError(
                f"{path}.type: tool type {kind!r} is not supported (function and namespace tools)",
                param=f"{path}.type",
            )
    return out or None, namespaces


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """The Responses tool_choice in the chat-completions form (enforced: api.structured)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: TextConfigIn | None) -> dict | None:
    """``text.format`` as given (the flat shape; enforced: api.structured), None for text."""
    if text is None or text.format is None or text.format.type == "text":
        return None
    return {k: v for k, v in attrs.asdict(text.format).items() if v is not None}


# ------------------------------------------------------------------ the turn


@attrs.frozen(kw_only=True)
class PreparedRequest:
    """A validated request: the turn to generate, and what the response echoes."""

    turn: ChatTurn
    history: tuple[dict[str, Any], ...]  # messages before this response, no instructions
    namespaces: dict[str, str]


def prepare_request(
    req: ResponsesRequest, config: ServerConfig, previous: StoredResponse | None = None
) -> PreparedRequest:
    """The turn, after ``previous``'s conversation: the response ``req.previous_response_id``
    names, as the store gave it to this request's API key; None (not stored, or another
    key's) is a 400, as for an id never seen."""
    if req.previous_response_id is not None and previous is None:
        raise ClientError(
            f"previous response {req.previous_response_id!r} not found (never stored, deleted, "
            "expired or evicted, or stored with another API key)",
            param="previous_response_id",
        )
    history = [dict(m) for m in previous.conversation] if previous is not None else []
    history += input_messages(req.input)
    if not history:
        raise ClientError("input must not be empty", param="input")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    tools, namespaces = chat_tools(req.tools)
    template_args = dict(config.chat_template_args)
    template_args.update(effort_template_args(req.reasoning.effort if req.reasoning else None))
    template_args.update(req.chat_template_kwargs or {})
    turn = ChatTurn(
        messages=merge_leading_system(messages + history),
        tools=tools,
        tool_choice=chat_tool_choice(req.tool_choice),
        response_format=response_format(req.text),
        response_format_param="text.format",
        parallel_tool_calls=req.parallel_tool_calls,
        template_args=template_args,
        max_tokens=req.max_output_tokens or config.max_tokens,
        sampling=sampling_params(
            GenerationFields(temperature=req.temperature, top_p=req.top_p), config
        ),
    )
    return PreparedRequest(turn=turn, history=tuple(history), namespaces=namespaces)


