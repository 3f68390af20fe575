"""Anthropic Messages requests -> a ``ChatTurn``: the conversation as chat-template messages.

Receives a validated ``MessagesRequest`` or ``CountTokensRequest``
(``api.agents.messages_schema``); emits the ``ChatTurn`` to generate (or, for
``count_tokens``, to measure): the system prompt first (text blocks joined),
``text`` / ``thinking`` / ``tool_use`` blocks of an assistant message as one
assistant message with ``reasoning_content`` and ``tool_calls``,
``tool_result`` blocks as ``tool`` messages in place, tools with
``input_schema`` as chat-completions function tools, ``tool_choice`` in the
chat-completions form (enforced: ``api.structured``), ``thinking`` as the chat template's
``enable_thinking`` and, with ``output_config.effort``, its ``reasoning_effort``
(gpt-oss's level). A block it cannot serve is a ``ClientError`` naming it
(``messages[0].content[1].type``).
"""

from __future__ import annotations

from typing import Any

from api.agents.blocks import ChatTurn, function_tool, merge_leading_system
from api.agents.messages_schema import (
    ContentBlockIn,
    CountTokensRequest,
    MessagesRequest,
    ToolChoiceIn,
)
from api.generation import sampling_params
from api.schemas import GenerationFields
from runtime.config import ServerConfig
from runtime.errors import ClientError


def _tool_result_text(block: ContentBlockIn, where: str) -> str:
    content = block.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for k, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise ClientError(
                f"{where}.content[{k}].type: only text is supported inside a tool_result",
                param=f"{where}.content[{k}].type",
            )
        parts.append(part.text)
    return "\n".join(parts)


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat-template messages (system first, tool results as tool messages)."""
    out: list[dict[str, Any]] = []
    if isinstance(req.system, str):
        if req.system:
            out.append({"role": "system", "content": req.system})
    elif req.system:
        out.append({"role": "system", "content": "\n\n".join(b.text for b in req.system)})
    tool_names: dict[str, str] = {}
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        if message.role == "assistant":
            out.append(_assistant_message(message.content, where, tool_names))
        elif message.role == "system":  # Claude Code's mid-conversation system messages
            out.extend(_user_messages(message.content, where, {}, role="system"))
        else:
            out.extend(_user_messages(message.content, where, tool_names))
    return merge_leading_system(out)


def _assistant_message(blocks: list[ContentBlockIn], where: str, tool_names: dict) -> dict:
    text, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            text.append(block.text or "")
        elif block.type == "thinking":
            reasoning.append(block.thinking or "")
        elif block.type == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read
        elif block.type == "tool_use":
            for key in ("id", "name"):
                if not getattr(block, key):
                    raise ClientError(
                        f"{at}.{key}: is required (a tool_use block needs 'id' and 'name')",
                        param=f"{at}.{key}",
                    )
            if block.input is not None and not isinstance(block.input, dict):
                raise ClientError(f"{at}.input must be an object", param=f"{at}.input")
            tool_names[block.id] = block.name
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": block.input or {}},
                }
            )
        else:
            raise ClientError(
                f"{at}.type: content block type {block.type!r} is not supported in assistant "
                "messages (text, thinking, tool_use)",
                param=f"{at}.type",
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _user_messages(
    blocks: list[ContentBlockIn], where: str, tool_names: dict, *, role: str = "user"
) -> list[dict]:
    out: list[dict[str, Any]] = []
    text: list[str] = []

    def flush_text():
        if text:
            out.append({"role": role, "content": "\n\n".join(text)})
            text.clear()

    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            if block.text is None:
                raise ClientError(f"{at}: a text block needs 'text'", param=f"{at}.text")
            text.append(block.text)
        elif block.type == "tool_result" and role == "user":
            if not block.tool_use_id:
                raise ClientError(f"{at}: a tool_result needs 'tool_use_id'", param=f"{at}.tool_use_id")
            flush_text()
            tool: dict[str, Any] = {
                "role": "tool",
                "tool_call_id": block.tool_use_id,
                "content": _tool_result_text(block, at),
            }
            if block.tool_use_id in tool_names:
                tool["name"] = tool_names[block.tool_use_id]
            out.append(tool)
        elif block.type == "image":
            raise ClientError(
                f"{at}: images are accepted on /v1/chat/completions only (image_url parts, "
                "with a vision-language model)",
                param=at,
            )
        else:
            allowed = "text, tool_result" if role == "user" else "text"
            raise ClientError(
                f"{at}.type: content block type {block.type!r} is not supported in {role} "
                f"messages ({allowed})",
                param=f"{at}.type",
            )
    flush_text()
    return out


def chat_tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    return [function_tool(t.name, t.description, t.input_schema) for t in req.tools]


def chat_tool_choice(choice: ToolChoiceIn | None) -> str | dict | None:
    """Anthropic's tool_choice in the chat-completions form (enforced: api.structured)."""
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def template_args(req: CountTokensRequest, config: ServerConfig) -> dict[str, Any]:
    args = dict(config.chat_template_args)
    if req.thinking is not None:
        args["enable_thinking"] = req.thinking.type != "disabled"
        effort = thinking_effort(req.thinking.type, req.thinking.budget_tokens)
        if effort is not None:
            args["reasoning_effort"] = effort
    effort = req.output_config.effort if req.output_config else None
    if effort in OUTPUT_EFFORTS:
        args["reasoning_effort"] = OUTPUT_EFFORTS[effort]
    return args


# ``output_config.effort`` as a reasoning level (it wins over the thinking budget's).
OUTPUT_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high"}


# A thinking budget's reasoning level, for templates that take one (gpt-oss):
# below the first bound "low", below the second "medium", else "high".
THINKING_BUDGET_BOUNDS = (4096, 16384)


def thinking_effort(kind: str, budget_tokens: int | None) -> str | None:
    """The ``reasoning_effort`` that Messages' ``thinking`` asks for (None: the template's own)."""
    if kind == "disabled":
        return "low"
    if kind != "enabled" or budget_tokens is None:
        return None
    low, medium = THINKING_BUDGET_BOUNDS
    return "low" if budget_tokens < low else "medium" if budget_tokens < medium else "high"


def chat_turn(req: MessagesRequest, config: ServerConfig) -> ChatTurn:
    return ChatTurn(
        messages=chat_messages(req),
        tools=chat_tools(req),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=not (req.tool_choice and req.tool_choice.disable_parallel_tool_use),
        template_args=template_args(req, config),
        max_tokens=req.max_tokens,
        sampling=sampling_params(
            GenerationFields(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
            config,
        ),
        stop=tuple(s for s in req.stop_sequences or () if s),
    )


def counted_turn(req: CountTokensRequest, config: ServerConfig) -> ChatTurn:
    """The turn whose prompt ``count_tokens`` measures (never generated)."""
    return ChatTurn(
        messages=chat_messages(req),
        tools=chat_tools(req),
        template_args=template_args(req, config),
        max_tokens=1,
        sampling=sampling_params(GenerationFields(), config),
    )
