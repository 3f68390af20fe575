"""The Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Receives Anthropic request bodies (system, messages with text / tool_use /
tool_result / thinking blocks, tools with ``input_schema``, tool_choice,
thinking, stop_sequences, sampling fields); turns them into a ``ChatTurn``
(chat-template messages) and generates through the same Session and
Detokenizer as chat completions. Emits an Anthropic ``Message`` body, or its
event stream (``message_start``, ``content_block_start`` / ``_delta`` /
``_stop``, ``message_delta``, ``message_stop``, and ``ping`` while the prompt
is processed). Every error on these routes is in Anthropic's shape:
``{"type": "error", "error": {"type", "message"}}`` with the HTTP status.

Headers (``x-api-key``, ``anthropic-version``, ``anthropic-beta``) and the
``?beta=true`` query are accepted and ignored. A model name that starts with
``claude`` and names no local model is served by the default model.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio
from quart import Blueprint, Response
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from api.agent_blocks import (
    AgentRenderer,
    Appended,
    BlockEvent,
    ChatTurn,
    Closed,
    Opened,
    check_range,
    function_tool,
    merge_leading_system,
    open_session,
    prepare_turn,
    sampling_params,
    sse_event,
)
from api.convert import structure_or_400
from runtime.config import ServerConfig
from runtime.errors import ClientError, NotFound, ServerError
from runtime.messages import Failed, Finished, Progress

log = logging.getLogger(__name__)

MAX_STOP_SEQUENCES = 16

# ------------------------------------------------------------------ requests


@attrs.frozen(kw_only=True)
class TextBlockIn:
    """A block inside a ``tool_result`` (only text is supported)."""

    type: str
    text: str | None = None


@attrs.frozen(kw_only=True)
class ContentBlockIn:
    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: Any = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[TextBlockIn] | None = None
    is_error: bool | None = None
    # thinking
    thinking: str | None = None
    signature: str | None = None


@attrs.frozen(kw_only=True)
class MessageIn:
    role: str
    content: str | list[ContentBlockIn]


@attrs.frozen(kw_only=True)
class SystemBlockIn:
    type: str
    text: str


@attrs.frozen(kw_only=True)
class ToolIn:
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None


@attrs.frozen(kw_only=True)
class ToolChoiceIn:
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


@attrs.frozen(kw_only=True)
class ThinkingIn:
    type: str
    budget_tokens: int | None = None


@attrs.frozen(kw_only=True)
class CountTokensRequest:
    """The fields that shape the prompt (all of ``/v1/messages/count_tokens``)."""

    model: str
    messages: list[MessageIn]
    system: str | list[SystemBlockIn] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None

    def validate(self) -> None:
        if not self.messages:
            raise ClientError("messages: at least one message is required", param="messages")
        for i, message in enumerate(self.messages):
            if message.role not in ("user", "assistant", "system"):
                raise ClientError(
                    f"messages[{i}].role must be 'user', 'assistant' or 'system'",
                    param=f"messages[{i}].role",
                )
        if isinstance(self.system, list):
            for i, block in enumerate(self.system):
                if block.type != "text":
                    raise ClientError(
                        f"system[{i}].type: only text blocks are supported", param=f"system[{i}].type"
                    )
        for i, tool in enumerate(self.tools or ()):
            if tool.type not in (None, "custom"):
                raise ClientError(
                    f"tools[{i}].type: tool type {tool.type!r} is not supported (only client tools "
                    "with an input_schema)",
                    param=f"tools[{i}].type",
                )
        if self.tool_choice is not None:
            if self.tool_choice.type not in ("auto", "any", "tool", "none"):
                raise ClientError(
                    "tool_choice.type must be auto, any, tool or none", param="tool_choice.type"
                )
            if self.tool_choice.type == "tool" and not self.tool_choice.name:
                raise ClientError("tool_choice.name is required for type 'tool'", param="tool_choice.name")
        if self.thinking is not None and self.thinking.type not in ("enabled", "disabled", "adaptive"):
            raise ClientError(
                "thinking.type must be enabled, disabled or adaptive", param="thinking.type"
            )


@attrs.frozen(kw_only=True)
class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    timeout: float | None = None  # ours, as on chat completions

    def validate(self) -> None:
        super().validate()
        check_range("max_tokens", self.max_tokens, low=1)
        check_range("temperature", self.temperature, low=0)
        check_range("top_p", self.top_p, low=0, high=1)
        check_range("top_k", self.top_k, low=0)
        check_range("timeout", self.timeout, low=0.001)
        if self.stop_sequences is not None and len(self.stop_sequences) > MAX_STOP_SEQUENCES:
            raise ClientError(
                f"stop_sequences takes at most {MAX_STOP_SEQUENCES} strings", param="stop_sequences"
            )


# ------------------------------------------------------- request -> ChatTurn


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
            if not block.id or not block.name:
                raise ClientError(f"{at}: a tool_use block needs 'id' and 'name'", param=at)
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
    return args


def chat_turn(req: MessagesRequest, config: ServerConfig) -> ChatTurn:
    return ChatTurn(
        messages=chat_messages(req),
        tools=chat_tools(req),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=not (req.tool_choice and req.tool_choice.disable_parallel_tool_use),
        template_args=template_args(req, config),
        max_tokens=req.max_tokens,
        sampling=sampling_params(config, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
        stop=tuple(s for s in req.stop_sequences or () if s),
    )


# -------------------------------------------------------------------- output

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens", "abort": "end_turn"}


def stop_reason(finished: Finished) -> str:
    if finished.finish_reason == "stop" and finished.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finished.finish_reason, "end_turn")


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        log.warning("tool call arguments are not a JSON object: %r", arguments[:200])
        return {}
    return value


ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class MessagesRenderer(AgentRenderer):
    """Session events -> an Anthropic ``Message`` or its event stream."""

    def __init__(self, *, model: str, prompt_tokens: Callable[[], int] = lambda: 0):
        super().__init__(prompt_tokens=prompt_tokens)
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model

    def _block(self, block, *, empty: bool) -> dict[str, Any]:
        if block.kind == "tool":
            call = block.call
            return {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.name,
                "input": {} if empty else tool_input(call.arguments),
            }
        if block.kind == "reasoning":
            return {"type": "thinking", "thinking": "" if empty else block.text, "signature": ""}
        return {"type": "text", "text": "" if empty else block.text}

    def _usage(self, finished: Finished) -> dict[str, int]:
        usage = finished.usage
        return {
            "input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
        }

    def _message(self, content, *, stop: str | None, stop_sequence: str | None, usage) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def body(self) -> dict:
        assert isinstance(self.terminal, Finished)
        finished = self.terminal
        return self._message(
            [self._block(b, empty=False) for b in self.assembler.blocks],
            stop=stop_reason(finished),
            stop_sequence=finished.stop_sequence,
            usage=self._usage(finished),
        )

    def failure_body(self, failed: Failed) -> dict:
        return error_body(failed.status, failed.message)

    # ---- streaming

    def opening_frames(self) -> list[bytes]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        message = self._message([], stop=None, stop_sequence=None, usage=usage)
        return [sse_event("message_start", {"type": "message_start", "message": message})]

    def progress_frames(self, progress: Progress) -> list[bytes]:
        return [sse_event("ping", {"type": "ping"})]

    def block_frames(self, event: BlockEvent) -> list[bytes]:
        block = event.block
        if isinstance(event, Opened):
            frames = [
                sse_event(
                    "content_block_start",
                    {"type": "content_block_start", "index": block.index,
                     "content_block": self._block(block, empty=True)},
                )
            ]
            if block.kind == "tool":
                delta = {"type": "input_json_delta", "partial_json": block.call.arguments}
                frames.append(self._delta(block.index, delta))
            return frames
        if isinstance(event, Appended):
            if block.kind == "reasoning":
                return [self._delta(block.index, {"type": "thinking_delta", "thinking": event.text})]
            return [self._delta(block.index, {"type": "text_delta", "text": event.text})]
        assert isinstance(event, Closed)
        frames = []
        if block.kind == "reasoning":  # clients keep the signature to send the block back
            frames.append(self._delta(block.index, {"type": "signature_delta", "signature": ""}))
        frames.append(
            sse_event("content_block_stop", {"type": "content_block_stop", "index": block.index})
        )
        return frames

    def _delta(self, index: int, delta: dict) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def closing_frames(self, terminal: Finished | Failed) -> list[bytes]:
        if isinstance(terminal, Failed):
            return [sse_event("error", error_body(terminal.status, terminal.message))]
        delta = {"stop_reason": stop_reason(terminal), "stop_sequence": terminal.stop_sequence}
        return [
            sse_event("message_delta", {"type": "message_delta", "delta": delta,
                                        "usage": self._usage(terminal)}),
            sse_event("message_stop", {"type": "message_stop"}),
        ]


# -------------------------------------------------------------------- routes


async def resolve_model(rt, name: str):
    """The model for ``name``: a local one if it names one, else (for Claude names) the default."""
    try:
        return await rt.resolve(name)
    except NotFound:
        if name.lower().startswith("claude"):
            log.debug("Anthropic model name %r served by the default model", name)
            return await rt.resolve(None)
        raise


def messages_blueprint(
    rt,
    config: ServerConfig,
    *,
    generate: Callable[..., Awaitable[Response]],
    read_json: Callable[[], Awaitable[Any]],
) -> Blueprint:
    bp = Blueprint("anthropic_messages", __name__)

    def anthropic_error(status: int, message: str, retry_after: int | None = None) -> Response:
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        return Response(json.dumps(error_body(status, message)), status=status, headers=headers,
                        content_type="application/json")

    @bp.errorhandler(ServerError)
    async def on_server_error(error: ServerError):
        return anthropic_error(error.status, error.message, error.retry_after)

    @bp.errorhandler(RequestEntityTooLarge)
    async def on_too_large(error):
        return anthropic_error(413, f"the request body is larger than {config.max_request_bytes} bytes")

    @bp.errorhandler(HTTPException)
    async def on_http_error(error: HTTPException):
        return anthropic_error(error.code or 500, error.description or error.name)

    @bp.errorhandler(Exception)
    async def on_unexpected(error: Exception):
        log.exception("unexpected error while serving an Anthropic request")
        return anthropic_error(500, f"internal error: {type(error).__name__}")

    @bp.post("/v1/messages")
    async def messages():
        req = structure_or_400(await read_json(), MessagesRequest)
        turn = chat_turn(req, config)
        session = open_session(rt, config, turn, model=await resolve_model(rt, req.model), timeout=req.timeout)
        renderer = MessagesRenderer(model=req.model, prompt_tokens=lambda: _prompt_length(session))
        return await generate(session, renderer, req.stream)

    @bp.post("/v1/messages/count_tokens")
    async def count_tokens():
        req = structure_or_400(await read_json(), CountTokensRequest)
        turn = ChatTurn(
            messages=chat_messages(req),
            tools=chat_tools(req),
            template_args=template_args(req, config),
            max_tokens=1,
            sampling=sampling_params(config, temperature=None, top_p=None),
        )
        handle = await rt.acquire(await resolve_model(rt, req.model))
        try:
            prompt = await trio.to_thread.run_sync(
                lambda: prepare_turn(handle.tokenizer, turn=turn), limiter=rt.tokenize_limiter
            )
        finally:
            rt.release()
        return Response(json.dumps({"input_tokens": len(prompt.tokens)}), content_type="application/json")

    return bp


def _prompt_length(session) -> int:
    return len(session.prompt.tokens) if session.prompt is not None else 0
