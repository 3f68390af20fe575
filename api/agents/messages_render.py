"""Session events -> an Anthropic ``Message`` or its event stream.

Receives what a Session sends (``Delta``, ``Progress``, then ``Finished`` or
``Failed``) through the shared ``AgentRenderer`` / ``BlockAssembler``
(``api.agents.blocks``); emits the ``Message`` body (``thinking``, ``text``
and ``tool_use`` blocks, ``stop_reason``, usage with the cached prompt as
``cache_read_input_tokens``), or its event stream (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``, ``ping`` while the prompt is processed, and an ``error``
event for a failure after the stream started).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from api.agents.blocks import AgentRenderer, Appended, BlockEvent, Closed, Opened, sse_event
from api.agents.messages_errors import error_body
from runtime.messages import Failed, Finished, Progress

log = logging.getLogger(__name__)

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
        return error_body(failed)

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
            return [
                sse_event(
                    "content_block_start",
                    {"type": "content_block_start", "index": block.index,
                     "content_block": self._block(block, empty=True)},
                )
            ]
        if isinstance(event, Appended):
            if block.kind == "tool":
                return [self._delta(block.index, {"type": "input_json_delta",
                                                  "partial_json": event.text})]
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
            return [sse_event("error", error_body(terminal))]
        delta = {"stop_reason": stop_reason(terminal), "stop_sequence": terminal.stop_sequence}
        return [
            sse_event("message_delta", {"type": "message_delta", "delta": delta,
                                        "usage": self._usage(terminal)}),
            sse_event("message_stop", {"type": "message_stop"}),
        ]


