"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``.

Receives a Responses request (``input`` as a string or a list of items:
messages, ``function_call``, ``function_call_output`` and ``reasoning``
items; ``instructions``; function tools; ``previous_response_id``), turns it
into a ``ChatTurn`` and generates through the same Session and Detokenizer as
chat completions. Emits a ``response`` object, or its event stream with
``sequence_number``s (``response.created``, ``response.in_progress``,
``response.output_item.added`` / ``.done``, ``response.content_part.added``
/ ``.done``, ``response.output_text.delta`` / ``.done``,
``response.reasoning_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done``, then
``response.completed``, ``response.incomplete`` or ``response.failed``).

Owns the ``ResponseStore``: a bounded in-memory LRU of finished responses
(``store: true``, the default) with the conversation that led to each, so a
request naming ``previous_response_id`` rebuilds the earlier turns exactly:
the same chat messages, so the same prompt prefix, which the prompt cache
then reuses. Output items are turned back into messages by the same code
that reads input items, so a client that resends the output by hand gets the
same prompt as one that names the previous response.
"""

from __future__ import annotations

import collections
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
from quart import Blueprint, Response

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
    sampling_params,
    sse_event,
    tool_arguments,
)
from api.convert import structure_or_400
from api.errors import error_body
from runtime.config import ServerConfig
from runtime.errors import ClientError, NotFound
from runtime.messages import Failed, Finished, Progress

log = logging.getLogger(__name__)

RESPONSE_STORE_SIZE = 256  # finished responses kept for previous_response_id and GET

# Tool types some clients always send that a local model cannot serve: accepted
# and left out of the prompt (see docs/api.md). Any other non-function type is a 400.
IGNORED_TOOL_TYPES = frozenset({"web_search", "web_search_preview", "image_generation"})


# ------------------------------------------------------------------ requests


@attrs.frozen(kw_only=True)
class TextFormatIn:
    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


@attrs.frozen(kw_only=True)
class TextConfigIn:
    format: TextFormatIn | None = None
    verbosity: str | None = None


@attrs.frozen(kw_only=True)
class ReasoningIn:
    effort: str | None = None
    summary: str | None = None


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    model: str = "default_model"
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool | None = None
    text: TextConfigIn | None = None
    reasoning: ReasoningIn | None = None
    metadata: dict[str, Any] | None = None
    conversation: Any = None
    prompt: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # ours, as on chat completions
    timeout: float | None = None  # ours, as on chat completions

    def validate(self) -> None:
        check_range("max_output_tokens", self.max_output_tokens, low=1)
        check_range("temperature", self.temperature, low=0)
        check_range("top_p", self.top_p, low=0, high=1)
        check_range("timeout", self.timeout, low=0.001)
        if self.background:
            raise ClientError("background responses are not supported", param="background")
        if self.conversation is not None:
            raise ClientError(
                "conversations are not supported: use previous_response_id", param="conversation"
            )
        if self.prompt is not None:
            raise ClientError("prompt templates are not supported", param="prompt")
        if isinstance(self.tool_choice, str) and self.tool_choice not in ("auto", "none", "required"):
            raise ClientError("tool_choice must be auto, none or required", param="tool_choice")
        if self.text is not None and self.text.format is not None:
            kind = self.text.format.type
            if kind not in ("text", "json_schema", "json_object"):
                raise ClientError(
                    "text.format.type must be text, json_schema or json_object", param="text.format.type"
                )
            if kind == "json_schema" and (self.text.format.schema is None or not self.text.format.name):
                raise ClientError(
                    "text.format of type json_schema needs 'name' and 'schema'", param="text.format"
                )


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


TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


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
            if role not in ("user", "assistant", "system", "developer"):
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


# --------------------------------------------------------------------- store


@attrs.frozen(kw_only=True)
class StoredResponse:
    body: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]  # chat messages through this response, no instructions


class ResponseStore:
    """A bounded LRU of finished responses (in memory, lost on restart)."""

    def __init__(self, max_entries: int = RESPONSE_STORE_SIZE):
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


# ------------------------------------------------------------------ requests


@attrs.frozen(kw_only=True)
class PreparedRequest:
    """A validated request: the turn to generate, and what the response echoes."""

    turn: ChatTurn
    history: tuple[dict[str, Any], ...]  # messages before this response, no instructions
    namespaces: dict[str, str]


def prepare_request(req: ResponsesRequest, config: ServerConfig, store: ResponseStore) -> PreparedRequest:
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise ClientError(
                f"previous response {req.previous_response_id!r} not found (responses are kept in "
                f"memory, the latest {store.max_entries})",
                param="previous_response_id",
            )
        history = [dict(m) for m in previous.conversation]
    history += input_messages(req.input)
    if not history:
        raise ClientError("input must not be empty", param="input")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    tools, namespaces = chat_tools(req.tools)
    template_args = dict(config.chat_template_args)
    if req.reasoning is not None and req.reasoning.effort == "none":
        template_args["enable_thinking"] = False
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
        sampling=sampling_params(config, temperature=req.temperature, top_p=req.top_p),
    )
    return PreparedRequest(turn=turn, history=tuple(history), namespaces=namespaces)


# -------------------------------------------------------------------- output


class ResponsesRenderer(AgentRenderer):
    """Session events -> a ``response`` object or its event stream; stores it when done."""

    def __init__(
        self,
        *,
        req: ResponsesRequest,
        prepared: PreparedRequest,
        store: ResponseStore,
        prompt_tokens: Callable[[], int] = lambda: 0,
    ):
        super().__init__(prompt_tokens=prompt_tokens)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.req = req
        self.prepared = prepared
        self.store = store
        self._item_ids: dict[int, str] = {}
        self._sequence = 0

    # ---- items

    def _item_id(self, block) -> str:
        prefix = {"reasoning": "rs", "text": "msg", "tool": "fc"}[block.kind]
        return self._item_ids.setdefault(block.index, f"{prefix}_{uuid.uuid4().hex[:24]}")

    def _status(self, block) -> str:
        if not block.closed:
            return "in_progress"
        last = block.index == len(self.assembler.blocks) - 1
        if last and isinstance(self.terminal, Finished) and self.terminal.finish_reason == "length":
            return "incomplete"
        return "completed"

    def _part(self, block, text: str) -> dict[str, Any]:
        if block.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, block, *, empty: bool = False) -> dict[str, Any]:
        item_id = self._item_id(block)
        status = "in_progress" if empty else self._status(block)
        if block.kind == "tool":
            call = block.call
            item = {
                "type": "function_call",
                "id": item_id,
                "call_id": call.id,
                "name": call.name,
                "arguments": "" if empty else call.arguments,
                "status": status,
            }
            if call.name in self.prepared.namespaces:
                item["namespace"] = self.prepared.namespaces[call.name]
            return item
        content = [] if empty else [self._part(block, block.text)]
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
                    "status": status}
        return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                "content": content}

    # ---- the response object

    def _usage(self) -> dict[str, Any] | None:
        if not isinstance(self.terminal, Finished):
            return None
        usage = self.terminal.usage
        return {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        }

    def response(self) -> dict[str, Any]:
        req, terminal = self.req, self.terminal
        status, error, incomplete = "in_progress", None, None
        if isinstance(terminal, Failed):
            status = "failed"
            error = {"code": "server_error", "message": terminal.message}
        elif isinstance(terminal, Finished):
            status = "completed"
            if terminal.finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        sampling = self.prepared.turn.sampling
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": [self._item(b) for b in self.assembler.blocks] if terminal is not None else [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.store,
            "temperature": sampling.temperature,
            "text": {"format": _format_out(req.text)},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": sampling.top_p,
            "truncation": "disabled",
            "usage": self._usage(),
            "metadata": req.metadata or {},
        }

    def _finish(self) -> dict[str, Any]:
        body = self.response()
        if self.req.store and isinstance(self.terminal, Finished):
            try:
                output = input_messages(body["output"], path="output")
            except ClientError as exc:  # e.g. a tool call whose arguments are not an object
                log.warning("response %s not stored: %s", self.id, exc.message)
            else:
                conversation = (*self.prepared.history, *output)
                self.store.put(self.id, StoredResponse(body=body, conversation=conversation))
        return body

    def body(self) -> dict:
        return self._finish()

    def failure_body(self, failed: Failed) -> dict:
        return error_body(failed)

    # ---- streaming

    def _event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(kind, payload)

    def opening_frames(self) -> list[bytes]:
        snapshot = self.response()
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def progress_frames(self, progress: Progress) -> list[bytes]:
        return [f": keepalive {progress.done}/{progress.total}\n\n".encode()]

    def block_frames(self, event: BlockEvent) -> list[bytes]:
        block = event.block
        where = {"item_id": self._item_id(block), "output_index": block.index}
        if isinstance(event, Opened):
            frames = [self._event("response.output_item.added", output_index=block.index,
                                  item=self._item(block, empty=True))]
            if block.kind == "tool":
                frames.append(self._event("response.function_call_arguments.delta", **where,
                                          delta=block.call.arguments))
            else:
                frames.append(self._event("response.content_part.added", **where, content_index=0,
                                          part=self._part(block, "")))
            return frames
        if isinstance(event, Appended):
            if block.kind == "reasoning":
                return [self._event("response.reasoning_text.delta", **where, content_index=0,
                                    delta=event.text)]
            return [self._event("response.output_text.delta", **where, content_index=0,
                                delta=event.text, logprobs=[])]
        assert isinstance(event, Closed)
        frames = []
        if block.kind == "tool":
            frames.append(self._event("response.function_call_arguments.done", **where,
                                      name=block.call.name, arguments=block.call.arguments))
        else:
            if block.kind == "reasoning":
                frames.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                          text=block.text))
            else:
                frames.append(self._event("response.output_text.done", **where, content_index=0,
                                          text=block.text, logprobs=[]))
            frames.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=self._part(block, block.text)))
        frames.append(self._event("response.output_item.done", output_index=block.index,
                                  item=self._item(block)))
        return frames

    def closing_frames(self, terminal: Finished | Failed) -> list[bytes]:
        body = self._finish()
        kind = {"failed": "response.failed", "incomplete": "response.incomplete"}.get(
            body["status"], "response.completed"
        )
        return [self._event(kind, response=body)]


def _format_out(text: TextConfigIn | None) -> dict[str, Any]:
    if text is None or text.format is None:
        return {"type": "text"}
    return {k: v for k, v in attrs.asdict(text.format).items() if v is not None}


# -------------------------------------------------------------------- routes


def responses_blueprint(
    rt,
    config: ServerConfig,
    *,
    generate: Callable[..., Awaitable[Response]],
    read_json: Callable[[], Awaitable[Any]],
    store: ResponseStore | None = None,
) -> Blueprint:
    bp = Blueprint("openai_responses", __name__)
    responses = store if store is not None else ResponseStore()

    @bp.post("/v1/responses")
    async def create_response():
        req = structure_or_400(await read_json(), ResponsesRequest)
        prepared = prepare_request(req, config, responses)
        session = open_session(
            rt, config, prepared.turn, model=await rt.resolve(req.model), timeout=req.timeout
        )
        renderer = ResponsesRenderer(
            req=req, prepared=prepared, store=responses,
            prompt_tokens=lambda: len(session.prompt.tokens) if session.prompt else 0,
        )
        return await generate(session, renderer, req.stream)

    @bp.get("/v1/responses/<response_id>")
    async def get_response(response_id: str):
        entry = responses.get(response_id)
        if entry is None:
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        return Response(json.dumps(entry.body), content_type="application/json")

    @bp.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str):
        if not responses.delete(response_id):
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        body = {"id": response_id, "object": "response", "deleted": True}
        return Response(json.dumps(body), content_type="application/json")

    return bp
