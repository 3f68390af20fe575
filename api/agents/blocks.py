"""What the agent APIs (OpenAI Responses, Anthropic Messages) share.

Both APIs answer with an ordered list of blocks (reasoning, text, tool call)
and stream each block as start / deltas / stop. ``BlockAssembler`` is that
shared state machine (sans-IO): it receives a Session's ``Delta`` events,
which the Detokenizer already split into content, reasoning and parsed tool
calls (the one tool-call and reasoning state machine of every endpoint), and
emits ``Opened`` / ``Appended`` / ``Closed`` block events in output order.
``AgentRenderer`` drives it for both wire formats, streaming or not.

Requests of both APIs become a ``ChatTurn``: chat-template messages, tools in
the chat-completions form, and what the engine enforces (``tool_choice``,
``response_format``: ``api.structured``). ``open_session`` turns a
``ChatTurn`` into a Session the way the chat route does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import attrs

from api.cache_scope import prompt_cache_scope
from api.generation import deadline
from api.json_input import loads as load_json
from api.sse import dumps
from api.structured import constrain_step
from runtime.config import ServerConfig
from runtime.errors import ClientError
from runtime.messages import Delta, Failed, Finished, Progress, SamplingParams, ToolCall
from runtime.prompts import prepare_chat

# ------------------------------------------------------------------ requests


@attrs.frozen(kw_only=True)
class ChatTurn:
    """One request of an agent API, as the chat template and the Session take it.

    ``tool_choice`` is in the chat-completions form (``"auto"``, ``"none"``,
    ``"required"`` or ``{"type": "function", "function": {"name": ...}}``);
    ``response_format`` in the shape of the field ``response_format_param``
    names (chat's ``{"type": "json_schema", "json_schema": {...}}`` or the
    Responses API's flat ``text.format``). Both are enforced by constrained
    decoding (``api.structured``); ``parallel_tool_calls`` false allows one call.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    response_format_param: str = "response_format"
    parallel_tool_calls: bool = True
    template_args: dict[str, Any] = attrs.field(factory=dict)
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()


def function_tool(name: str, description: str | None, parameters: Any) -> dict[str, Any]:
    """A tool in the chat-completions form that chat templates render."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def merge_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One system message first: many chat templates accept no other layout.

    Leading system messages are joined with a blank line; later ones keep
    their place. Deterministic, so a conversation rebuilt from the same
    pieces renders to the same prompt prefix.
    """
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n <= 1:
        return messages
    text = "\n\n".join(m["content"] for m in messages[:n] if m["content"])
    return [{"role": "system", "content": text}, *messages[n:]]


def tool_arguments(arguments: Any, *, param: str) -> dict[str, Any]:
    """Tool-call arguments as the object chat templates render."""
    if isinstance(arguments, str):
        try:
            arguments = load_json(arguments, where=param) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ClientError("tool call arguments must be a JSON object", param=param) from None
    if not isinstance(arguments, dict):
        raise ClientError("tool call arguments must be a JSON object", param=param)
    return arguments


def prepare_turn(tokenizer, *, turn: ChatTurn):
    """The prompt of ``turn``, in a worker thread always (a stored conversation can make a
    short request body a long prompt, so the chat route's short-body rule does not apply)."""
    return prepare_chat(tokenizer, turn.messages, tools=turn.tools, template_args=turn.template_args)


def open_session(
    rt,
    config: ServerConfig,
    turn: ChatTurn,
    *,
    model,
    timeout: float | None = None,
    prompt_param: str = "messages",
    cache_salt: str | None = None,
):
    """A (not yet entered) Session generating ``turn`` with the chat markup;
    ``prompt_param``: the request field a prompt too long for the model is blamed on;
    ``cache_salt``: the request's, for its prompt-cache scope (``api.cache_scope``)."""
    return rt.session(
        cache_scope=prompt_cache_scope(config, cache_salt),
        prepare=functools.partial(prepare_turn, turn=turn),
        sampling=turn.sampling,
        max_tokens=turn.max_tokens,
        stop=turn.stop,
        tools=turn.tools,
        markup=True,
        timeout=deadline(timeout, config),
        model=model,
        prompt_param=prompt_param,
        constrain=constrain_step(
            response_format=turn.response_format,
            tools=turn.tools,
            tool_choice=turn.tool_choice,
            parallel_tool_calls=turn.parallel_tool_calls,
            template_args=turn.template_args,
            response_format_param=turn.response_format_param,
        ),
    )


def prompt_length(session) -> int:
    """The prompt's length in tokens once ``session`` is entered (0 before)."""
    return len(session.prompt.tokens) if session.prompt is not None else 0


# -------------------------------------------------------------------- blocks


@attrs.define
class Block:
    """One output block: reasoning or text (``text`` grows), or a tool call (``call``'s
    arguments grow when the call is streamed in parts)."""

    index: int
    kind: str  # "reasoning" | "text" | "tool"
    text: str = ""
    call: ToolCall | None = None
    closed: bool = False


@attrs.frozen
class Opened:
    block: Block  # its ``text`` may already hold the first Appended piece


@attrs.frozen
class Appended:
    block: Block
    text: str


@attrs.frozen
class Closed:
    block: Block


BlockEvent = Opened | Appended | Closed


class BlockAssembler:
    """Sans-IO: ``Delta``s in, block events out, in output order.

    A delta's parts are taken in the order a model writes them: reasoning,
    then text, then tool calls. A text or reasoning block opens at its first
    non-whitespace character and whitespace at its end is dropped (chat
    templates put newlines around thinking and tool-call markup; agent
    clients show blocks as they are, and Anthropic refuses whitespace-only
    text blocks when a client sends them back): whitespace is held back
    until more text of the same kind follows. A tool call is one block: it
    opens with the call's name, its arguments are appended (whole, or piece
    by piece for a call streamed in parts, which share the call's id), and
    it closes when the next block opens or the reply ends.
    """

    def __init__(self):
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._held = ""  # whitespace at the end of the open block, not yet sent

    def feed(self, delta: Delta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if delta.reasoning:
            self._text("reasoning", delta.reasoning, events)
        if delta.content:
            self._text("text", delta.content, events)
        for call in delta.tool_calls:
            block = self._open
            if block is None or block.kind != "tool" or block.call.id != call.id:
                self._close(events)
                block = Block(index=len(self.blocks), kind="tool",
                              call=attrs.evolve(call, arguments=""))
                self.blocks.append(block)
                self._open = block
                events.append(Opened(block))
            if call.arguments:
                block.call = attrs.evolve(block.call, arguments=block.call.arguments + call.arguments)
                events.append(Appended(block, call.arguments))
        return events

    def close(self) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        self._close(events)
        return events

    def _text(self, kind: str, text: str, events: list[BlockEvent]) -> None:
        block = self._open
        if block is not None and block.kind == kind:
            body = text.rstrip()
            if not body:  # only whitespace: hold it until more text comes
                self._held += text
                return
            piece = self._held + body
            self._held = text[len(body):]
            block.text += piece
            events.append(Appended(block, piece))
            return
        stripped = text.strip()
        if not stripped:
            return  # whitespace between blocks, or before the first one
        self._close(events)
        piece = text.lstrip()
        body = piece.rstrip()
        block = Block(index=len(self.blocks), kind=kind, text=body)
        self.blocks.append(block)
        self._open = block
        self._held = piece[len(body):]
        events += [Opened(block), Appended(block, body)]

    def _close(self, events: list[BlockEvent]) -> None:
        if self._open is not None:
            self._open.closed = True
            events.append(Closed(self._open))
            self._open = None
            self._held = ""


class AgentRenderer:
    """Session events -> one wire format's frames or body (subclasses say which).

    The interface ``api.generation.generate`` drives: ``add`` and
    ``terminal`` (non-streaming), ``body`` / ``failure_body``, and
    ``stream_frames`` (streaming). ``prompt_tokens`` gives the prompt's
    length once the Session is entered (for usage sent before the end).
    """

    def __init__(self, *, prompt_tokens: Callable[[], int] = lambda: 0):
        self.assembler = BlockAssembler()
        self.terminal: Finished | Failed | None = None
        self._prompt_tokens = prompt_tokens
        self._started = False

    @property
    def prompt_tokens(self) -> int:
        return self._prompt_tokens()

    # ---- non-streaming

    def add(self, item) -> None:
        if isinstance(item, Delta):
            self.assembler.feed(item)
        elif isinstance(item, Finished | Failed):
            self.terminal = item  # first: a block closed by the end may render differently
            self.assembler.close()

    # ---- streaming

    def stream_frames(self, items) -> bytes:
        out: list[bytes] = []
        if not self._started:
            self._started = True
            out += self.opening_frames()
        for item in items:
            if isinstance(item, Progress):
                out += self.progress_frames(item)
            elif isinstance(item, Delta):
                for event in self.assembler.feed(item):
                    out += self.block_frames(event)
            elif isinstance(item, Finished | Failed):
                self.terminal = item  # first: a block closed by the end may render differently
                for event in self.assembler.close():
                    out += self.block_frames(event)
                out += self.closing_frames(item)
        return b"".join(out)

    # ---- for subclasses

    def opening_frames(self) -> list[bytes]:
        raise NotImplementedError

    def progress_frames(self, progress: Progress) -> list[bytes]:
        raise NotImplementedError

    def block_frames(self, event: BlockEvent) -> list[bytes]:
        raise NotImplementedError

    def closing_frames(self, terminal: Finished | Failed) -> list[bytes]:
        raise NotImplementedError

    def body(self) -> dict:
        raise NotImplementedError

    def failure_body(self, failed: Failed) -> dict:
        raise NotImplementedError


def sse_event(name: str, payload: Any) -> bytes:
    """One named server-sent event (both agent APIs name their events)."""
    return f"event: {name}\ndata: {dumps(payload)}\n\n".encode()
