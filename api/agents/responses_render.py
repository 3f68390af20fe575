"""Session events -> a Responses ``response`` object or its event stream.

Receives what a Session sends (``Delta``, ``Progress``, then ``Finished`` or
``Failed``) through the shared ``AgentRenderer`` / ``BlockAssembler``
(``api.agents.blocks``); emits the ``response`` object (output items
``reasoning``, ``message``, ``function_call``), or its event stream with
``sequence_number``s (``response.created``, ``response.in_progress``,
``response.output_item.added`` / ``.done``, ``response.content_part.added``
/ ``.done``, ``response.output_text.delta`` / ``.done``,
``response.reasoning_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done``, then
``response.completed``, ``response.incomplete`` or ``response.failed``; while
a long prompt is processed, ``: keepalive`` comments and, every
``IN_PROGRESS_EVERY_SECONDS``, ``response.in_progress`` again).
A finished response is put in the ``ResponseStore`` with its conversation,
under the owner the route gives (the request's API key, hashed).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import attrs

from api.agents.blocks import AgentRenderer, Appended, BlockEvent, Closed, Opened, sse_event
from api.agents.responses_input import PreparedRequest, input_messages
from api.agents.responses_schema import ResponsesRequest, TextConfigIn
from api.agents.responses_store import ResponseStore, StoredResponse
from api.errors import error_body
from api.sse import keepalive
from runtime.errors import ClientError
from runtime.messages import Failed, Finished, Progress

log = logging.getLogger(__name__)

# While a long prompt is processed, a stream gets a ``: keepalive`` comment every
# step and a ``response.in_progress`` event at most this often: an event, because
# some clients' idle timers count events and not comments (Codex's stream idle
# timeout, 300 s by default, reads events through an SSE parser that drops comments).
IN_PROGRESS_EVERY_SECONDS = 10.0


class ResponsesRenderer(AgentRenderer):
    """Session events -> a ``response`` object or its event stream; stores it when done."""

    def __init__(
        self,
        *,
        req: ResponsesRequest,
        prepared: PreparedRequest,
        store: ResponseStore,
        owner: str,
        prompt_tokens: Callable[[], int] = lambda: 0,
    ):
        super().__init__(prompt_tokens=prompt_tokens)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.req = req
        self.prepared = prepared
        self.store = store
        self.owner = owner
        self._item_ids: dict[int, str] = {}
        self._sequence = 0
        self._last_event = time.monotonic()  # of the stream's last event (not a comment)

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
                stored = StoredResponse(body=body, conversation=conversation)
                self.store.put(self.id, self.owner, stored)
        return body

    def body(self) -> dict:
        return self._finish()

    def failure_body(self, failed: Failed) -> dict:
        return error_body(failed)

    # ---- streaming

    def _event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        self._last_event = time.monotonic()
        return sse_event(kind, payload)

    def opening_frames(self) -> list[bytes]:
        snapshot = self.response()
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def progress_frames(self, progress: Progress) -> list[bytes]:
        frames = [keepalive(progress)]
        if time.monotonic() - self._last_event >= IN_PROGRESS_EVERY_SECONDS:
            frames.append(self._event("response.in_progress", response=self.response()))
        return frames

    def block_frames(self, event: BlockEvent) -> list[bytes]:
        block = event.block
        where = {"item_id": self._item_id(block), "output_index": block.index}
        if isinstance(event, Opened):
            frames = [self._event("response.output_item.added", output_index=block.index,
                                  item=self._item(block, empty=True))]
            if block.kind != "tool":
                frames.append(self._event("response.content_part.added", **where, content_index=0,
                                          part=self._part(block, "")))
            return frames
        if isinstance(event, Appended):
            if block.kind == "tool":
                return [self._event("response.function_call_arguments.delta", **where,
                                    delta=event.text)]
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


