"""The renderers of the OpenAI endpoints: a Session's events -> SSE frames or one JSON body.

``ChatRenderer`` and ``TextRenderer`` receive a Session's events (``Delta``,
``Progress``, ``Finished``, ``Failed``) and emit SSE frames
(``stream_frames``, framed by ``api.sse``) or one JSON body (``body``) of the
types in ``api.bodies``, the same way for streaming and non-streaming
requests, for one choice (``index``); ``api.choices`` combines several.
Each accumulates its request's content, reasoning, tool calls and logprobs.
"""

from __future__ import annotations

import time
import uuid

from api.bodies import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    FunctionOut,
    PromptCacheOut,
    TextChoice,
    TextCompletion,
    TextLogprobs,
    ToolCallOut,
    TopLogprob,
    UsageOut,
)
from api.convert import unstructure
from api.errors import error_body
from api.sse import SSE_DONE, dumps, keepalive, sse
from runtime.messages import (
    Delta,
    Failed,
    Finished,
    FinishReason,
    Progress,
    TokenLogprob,
    ToolCall,
)


class _Renderer:
    """Accumulates a request's events; renders chunks (streaming) or one body."""

    id_prefix = "cmpl"

    def __init__(self, *, model: str, fingerprint: str, logprobs: bool, include_usage: bool):
        self.index = 0  # the choice this renderer renders (api.choices sets it)
        self.id = f"{self.id_prefix}-{uuid.uuid4()}"
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.want_logprobs = logprobs
        self.include_usage = include_usage
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.logprobs: list[TokenLogprob] = []
        self.terminal: Finished | Failed | None = None
        self._content_template: list[str] | None = None

    def add(self, item) -> None:
        if isinstance(item, Delta):
            self.content.append(item.content)
            self.reasoning.append(item.reasoning)
            self.tool_calls.extend(item.tool_calls)
            self.logprobs.extend(item.logprobs)
        elif isinstance(item, Finished | Failed):
            self.terminal = item

    def failure_body(self, failed: Failed) -> dict:
        """The JSON body of a non-streaming request that failed."""
        return error_body(failed)

    _CONTENT = "\x00content\x00"  # a marker no generated text contains

    def content_frame(self, content: str) -> bytes:
        """The common frame, text only: the chunk type unstructured once per request,
        then the text spliced in (most frames of a stream are these)."""
        if self._content_template is None:
            # The first frame is built in full (a chat stream's first delta names
            # the role); the template is the frame as every later one looks.
            first = sse(unstructure(self.delta_chunk(Delta(content=content))))
            frame = self.delta_chunk(Delta(content=self._CONTENT))
            text = "data: " + dumps(unstructure(frame)) + "\n\n"
            marker = dumps(self._CONTENT)
            self._content_template = text.split(marker)
            return first
        before, after = self._content_template
        return (before + dumps(content) + after).encode()

    def delta_frames(self, item: Delta) -> bytes:
        """The frame of one ``Delta`` (nothing if it renders to nothing)."""
        if item.content and not (item.reasoning or item.tool_calls or self.want_logprobs):
            return self.content_frame(item.content)
        frame = self.delta_chunk(item)
        return b"" if frame is None else sse(unstructure(frame))

    def stream_frames(self, items) -> bytes:
        out = []
        for item in items:
            if isinstance(item, Progress):
                out.append(keepalive(item))
            elif isinstance(item, Delta):
                out.append(self.delta_frames(item))
            elif isinstance(item, Finished):
                out.append(sse(unstructure(self.final_chunk(item))))
                if self.include_usage:
                    out.append(sse(unstructure(self.usage_chunk(item))))
                out.append(SSE_DONE)
            elif isinstance(item, Failed):
                if item.usage is not None:
                    # It had started: the stream ends as streams do, then says why.
                    ended = Finished(finish_reason=FinishReason.ABORT, usage=item.usage)
                    out.append(sse(unstructure(self.final_chunk(ended))))
                    if self.include_usage:
                        out.append(sse(unstructure(self.usage_chunk(ended))))
                out.append(sse(error_body(item)))
                out.append(SSE_DONE)
        return b"".join(out)


def joined_tool_calls(calls) -> list[ToolCall]:
    """``calls`` with the parts of each call streamed in parts joined into one call."""
    out: list[ToolCall] = []
    for call in calls:
        if out and out[-1].id == call.id:
            last = out[-1]
            out[-1] = ToolCall(name=last.name or call.name, id=last.id,
                               arguments=last.arguments + call.arguments)
        else:
            out.append(call)
    return out


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _legacy_top(entry: TokenLogprob) -> dict[str, float]:
    """The N most likely, best first, then the sampled token if it is not among them
    (tokens that read the same keep the best logprob: the keys are texts)."""
    top: dict[str, float] = {}
    for _, text, lp in entry.top:
        top.setdefault(text, lp)
    top.setdefault(entry.text, entry.logprob)
    return top


def chat_logprobs(entries) -> ChatLogprobs:
    """Per-token logprobs as chat gives them (and text completions with ``logprobs: true``)."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                id=e.token,
                token=e.text,
                logprob=e.logprob,
                bytes=_bytes(e.text),
                top_logprobs=[
                    TopLogprob(id=token, token=text, logprob=lp, bytes=_bytes(text))
                    for token, text, lp in e.top
                ],
            )
            for e in entries
        ]
    )


class ChatRenderer(_Renderer):
    id_prefix = "chatcmpl"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._tool_index = 0
        self._last_call_id: str | None = None  # the call streamed last (its parts follow)
        self._role_sent = False  # OpenAI names the role in a stream's first delta only

    def _tool_out(self, calls, *, streaming: bool) -> list[ToolCallOut] | None:
        """Calls as OpenAI writes them. A call streamed in parts (``ToolCall``s sharing
        an id): one entry in a body; in a stream, its first part with id, type and
        name, each later one with its index and its piece of the arguments alone."""
        if not calls:
            return None
        out = []
        calls = joined_tool_calls(calls)
        for call in calls:
            if streaming and call.id == self._last_call_id:
                out.append(ToolCallOut(index=self._tool_index - 1,
                                       function=FunctionOut(arguments=call.arguments)))
                continue
            out.append(
                ToolCallOut(
                    id=call.id,
                    type="function",
                    function=FunctionOut(name=call.name, arguments=call.arguments),
                    index=self._tool_index if streaming else None,
                )
            )
            self._tool_index += 1
            self._last_call_id = call.id
        return out

    def _logprobs_out(self, entries) -> ChatLogprobs | None:
        if not self.want_logprobs:
            return None
        return chat_logprobs(entries)

    def _chunk(
        self, delta: ChatDelta, finish_reason, logprobs=None, usage=None, prompt_cache=None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=[
                ChatChunkChoice(
                    index=self.index, delta=delta, finish_reason=finish_reason, logprobs=logprobs
                )
            ]
            if usage is None
            else [],
            usage=usage,
            prompt_cache=prompt_cache,
        )

    def delta_chunk(self, item: Delta) -> ChatCompletionChunk | None:
        tool_calls = self._tool_out(item.tool_calls, streaming=True)
        if not (item.content or item.reasoning or tool_calls or (self.want_logprobs and item.logprobs)):
            return None
        delta = ChatDelta(
            role=None if self._role_sent else "assistant",
            content=item.content or None,
            reasoning=item.reasoning or None,
            reasoning_content=item.reasoning or None,
            tool_calls=tool_calls,
        )
        logprobs = self._logprobs_out(item.logprobs) if item.logprobs else None
        self._role_sent = True
        return self._chunk(delta, None, logprobs)

    def final_chunk(self, finished: Finished) -> ChatCompletionChunk:
        return self._chunk(
            ChatDelta(), finished.finish_reason, prompt_cache=PromptCacheOut.of(finished.usage)
        )

    def usage_chunk(self, finished: Finished) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(), None, usage=UsageOut.of(finished.usage))

    def body(self) -> dict:
        assert isinstance(self.terminal, Finished)
        content = "".join(self.content)
        reasoning = "".join(self.reasoning)
        message = ChatMessageOut(
            role="assistant",
            content=content or None,
            reasoning=reasoning or None,
            reasoning_content=reasoning or None,
            tool_calls=self._tool_out(self.tool_calls, streaming=False),
        )
        return unstructure(
            ChatCompletion(
                id=self.id,
                object="chat.completion",
                created=self.created,
                model=self.model,
                system_fingerprint=self.fingerprint,
                choices=[
                    ChatChoice(
                        index=self.index,
                        message=message,
                        finish_reason=self.terminal.finish_reason,
                        logprobs=self._logprobs_out(self.logprobs),
                    )
                ],
                usage=UsageOut.of(self.terminal.usage),
                prompt_cache=PromptCacheOut.of(self.terminal.usage),
            )
        )


class TextRenderer(_Renderer):
    """``logprobs_form``: ``"legacy"`` (OpenAI's completions shape: tokens,
    token_logprobs, top_logprobs with the sampled token among them, text_offset)
    or ``"content"`` (chat's shape, for mlx_lm.server's ``logprobs: true``)."""

    id_prefix = "cmpl"

    def __init__(self, *, logprobs_form: str = "legacy", **kwargs):
        super().__init__(**kwargs)
        self.logprobs_form = logprobs_form
        self._offset = 0

    def _logprobs_out(self, entries) -> TextLogprobs | ChatLogprobs | None:
        if not self.want_logprobs:
            return None
        if self.logprobs_form == "content":
            return chat_logprobs(entries)
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.text)
        return TextLogprobs(
            tokens=[e.text for e in entries],
            token_logprobs=[e.logprob for e in entries],
            # The N most likely, and always the sampled token (OpenAI: up to N + 1).
            top_logprobs=[_legacy_top(e) for e in entries],
            text_offset=offsets,
            token_ids=[e.token for e in entries],
        )

    def _completion(
        self, text: str, finish_reason, logprobs=None, usage=None, prompt_cache=None
    ) -> TextCompletion:
        return TextCompletion(
            id=self.id,
            object="text_completion",
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=[
                TextChoice(
                    index=self.index, text=text, finish_reason=finish_reason, logprobs=logprobs
                )
            ]
            if usage is None or finish_reason is not None
            else [],
            usage=usage,
            prompt_cache=prompt_cache,
        )

    def delta_chunk(self, item: Delta) -> TextCompletion | None:
        if not item.content and not (self.want_logprobs and item.logprobs):
            return None
        logprobs = self._logprobs_out(item.logprobs) if item.logprobs else None
        return self._completion(item.content, None, logprobs)

    def final_chunk(self, finished: Finished) -> TextCompletion:
        prompt_cache = PromptCacheOut.of(finished.usage)
        return self._completion("", finished.finish_reason, prompt_cache=prompt_cache)

    def usage_chunk(self, finished: Finished) -> TextCompletion:
        return self._completion("", None, usage=UsageOut.of(finished.usage))

    def body(self) -> dict:
        assert isinstance(self.terminal, Finished)
        return unstructure(
            self._completion(
                "".join(self.content),
                self.terminal.finish_reason,
                self._logprobs_out(self.logprobs),
                UsageOut.of(self.terminal.usage),
                PromptCacheOut.of(self.terminal.usage),
            )
        )
