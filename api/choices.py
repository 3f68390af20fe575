"""Several choices (``n`` > 1) in one answer: one renderer per choice, combined.

Receives the Session's events, each tagged with its choice's ``index``
(``actors.session``), and hands each to that choice's renderer (a
``ChatRenderer`` or ``TextRenderer`` whose ``index`` it sets), so a choice's
chunks, role, tool-call indices and logprobs come out as they would alone.
Emits, streaming: the choices' chunks interleaved as their tokens arrive,
each choice's final chunk when it ends, then, once all have ended, the usage
chunk (when asked) and ``[DONE]``; a failure of any choice ends the stream
(final chunks with ``abort`` for the choices still running, the usage, the
error event, ``[DONE]``). Not streaming: one body with every choice. Usage
is summed: the prompt counted once, the completions of all choices.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from api.bodies import UsageOut
from api.convert import unstructure
from api.errors import error_body
from api.sse import SSE_DONE, keepalive, sse
from runtime.messages import Delta, Failed, Finished, FinishReason, Progress, Usage


class ChoicesRenderer:
    def __init__(self, make_renderer: Callable[[], object], n: int, *, include_usage: bool):
        """``make_renderer()`` makes one choice's renderer (without usage chunks)."""
        self.renderers = [make_renderer() for _ in range(n)]
        first = self.renderers[0]
        for index, renderer in enumerate(self.renderers):
            renderer.index = index
            renderer.id, renderer.created = first.id, first.created
        self.include_usage = include_usage
        self.ended: dict[int, Finished | Failed] = {}
        self.terminal: Finished | Failed | None = None
        self._closed = False

    # ------------------------------------------------------------ one body

    def add(self, item) -> None:
        if isinstance(item, Progress):
            return
        self.renderers[item.index].add(item)
        if isinstance(item, Finished | Failed):
            self.ended[item.index] = item
            if isinstance(item, Failed) and not isinstance(self.terminal, Failed):
                self.terminal = item
            elif self.terminal is None and len(self.ended) == len(self.renderers):
                self.terminal = Finished(finish_reason=item.finish_reason, usage=self.usage())

    def usage(self) -> Usage:
        """The prompt once (as choice 0 found it in the prompt cache: the others start
        from a copy of its cache), every choice's completion tokens."""
        known = {i: t.usage for i, t in self.ended.items() if t.usage is not None}
        if not known:
            return Usage(prompt_tokens=0, completion_tokens=0, cached_tokens=0)
        first = known.get(0) or next(iter(known.values()))
        return attrs.evolve(first, completion_tokens=sum(u.completion_tokens for u in known.values()))

    def body(self) -> dict:
        bodies = [renderer.body() for renderer in self.renderers]
        body = bodies[0]
        body["choices"] = [choice for b in bodies for choice in b["choices"]]
        body["usage"] = unstructure(UsageOut.of(self.usage()))
        return body

    def failure_body(self, failed: Failed) -> dict:
        return error_body(failed)

    # ------------------------------------------------------------ a stream

    def stream_frames(self, items) -> bytes:
        out: list[bytes] = []
        for item in items:
            if self._closed:
                break
            if isinstance(item, Progress):
                out.append(keepalive(item))
            elif isinstance(item, Delta):
                out.append(self.renderers[item.index].delta_frames(item))
            elif isinstance(item, Finished):
                self.ended[item.index] = item
                out.append(sse(unstructure(self.renderers[item.index].final_chunk(item))))
                if len(self.ended) == len(self.renderers):
                    out += self._closing(None)
            elif isinstance(item, Failed):
                # Every choice's failure in this batch counts towards the usage.
                for other in items:
                    if isinstance(other, Failed):
                        self.ended.setdefault(other.index, other)
                out += self._closing(item)
        return b"".join(out)

    def _closing(self, failed: Failed | None) -> list[bytes]:
        self._closed = True
        out = []
        if failed is not None and failed.usage is not None:
            # It had started: the choices still open end as streams do, then it says why.
            for index, renderer in enumerate(self.renderers):
                if not isinstance(self.ended.get(index), Finished):
                    usage = self.ended[index].usage if index in self.ended else None
                    ended = Finished(finish_reason=FinishReason.ABORT, usage=usage or self.usage())
                    out.append(sse(unstructure(renderer.final_chunk(ended))))
        if self.include_usage and (failed is None or failed.usage is not None):
            ended = Finished(finish_reason=FinishReason.STOP, usage=self.usage())
            out.append(sse(unstructure(self.renderers[0].usage_chunk(ended))))
        if failed is not None:
            out.append(sse(error_body(failed)))
        out.append(SSE_DONE)
        return out
