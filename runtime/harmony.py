"""OpenAI's Harmony format (gpt-oss): reading the model's output, shaping its prompt.

Owns ``HarmonyParser``, a sans-IO streaming state machine: fed the decoded
text of a reply piece by piece (any split, down to single characters), it
emits ``HarmonyEvent``s in output order: ``reasoning`` text (the ``analysis``
channel), ``content`` text (the ``final`` channel, and ``commentary`` that
is addressed to no one), and for a ``commentary`` message addressed
``to=functions.NAME`` a tool call as ``tool_name`` (the name, first), then
``tool_arguments`` fragments, then ``tool_end``. However the text is split,
the events joined per kind are the same.

A reply, after a prompt that ends with ``<|start|>assistant``, reads::

    <|channel|>analysis<|message|>THOUGHTS<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>

or, in the next turn, ``<|channel|>final<|message|>ANSWER<|return|>``.
``<|return|>`` and ``<|call|>`` end generation (``harmony_stop_ids``), so the
parser usually never sees them: ``finish`` closes the open message.

Also owns the prompt side's one duty the chat template cannot do itself:
``harmony_messages`` gives a conversation the shape gpt-oss's template reads
(an assistant turn's reasoning as ``thinking``, one tool call per assistant
message, each followed by its result).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
CONSTRAIN = "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)
STOP_MARKERS = (RETURN, CALL)  # each ends generation
MESSAGE_ENDS = (END, RETURN, CALL)

REASONING_EFFORTS = ("low", "medium", "high")

# A header longer than this without <|message|> is not a header: the model is
# writing plain text, which is returned as content.
HEADER_LIMIT = 256

_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@attrs.frozen
class HarmonyEvent:
    kind: str  # "reasoning" | "content" | "tool_name" | "tool_arguments" | "tool_end"
    text: str = ""


class MarkerLexer:
    """Text in, ("marker", m) / ("text", t) items out; a possible marker's start is held back."""

    def __init__(self):
        self._held = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        buf = self._held + text
        self._held = ""
        items: list[tuple[str, str]] = []
        start = search = 0
        while True:
            j = buf.find("<", search)
            if j == -1:
                break
            marker = next((m for m in MARKERS if buf.startswith(m, j)), None)
            if marker is not None:
                if j > start:
                    items.append(("text", buf[start:j]))
                items.append(("marker", marker))
                start = search = j + len(marker)
                continue
            tail = buf[j:]
            if any(m.startswith(tail) for m in MARKERS):  # may complete in the next piece
                self._held = tail
                buf = buf[:j]
                break
            search = j + 1
        if len(buf) > start:
            items.append(("text", buf[start:]))
        return items

    def flush(self) -> list[tuple[str, str]]:
        held, self._held = self._held, ""
        return [("text", held)] if held else []


@attrs.frozen
class Header:
    channel: str | None
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel = _CHANNEL_NAME.search(text)
        recipient = _RECIPIENT.search(text)
        return cls(
            channel=channel.group(1) if channel else None,
            recipient=recipient.group(1) if recipient else None,
        )

    @property
    def body_kind(self) -> str:
        """Where the message's text goes: "reasoning", "content" or "tool"."""
        if self.recipient and self.recipient != "assistant":
            return "tool"
        if self.channel == "analysis":
            return "reasoning"
        return "content"

    @property
    def tool_name(self) -> str:
        name = self.recipient or ""
        return name.removeprefix("functions.")


class HarmonyParser:
    """Sans-IO: ``feed(text)`` and ``finish()`` return ``HarmonyEvent``s.

    States: ``header`` (reading a message's header, up to ``<|message|>``),
    ``body`` (the message's text, up to ``<|end|>``, ``<|call|>`` or
    ``<|return|>``), ``between`` (after a message, before ``<|start|>``).
    A reply starts in ``header``: the prompt ends with ``<|start|>assistant``.
    Text between messages is content unless it is only whitespace.
    """

    def __init__(self):
        self._lexer = MarkerLexer()
        self._state = "header"
        self._header = ""
        self._kind = "content"  # the open body's kind
        self._between_ws = ""  # whitespace seen between messages, held
        self._between_text = False  # text other than whitespace seen since the last message
        self.tool_calls = 0

    def feed(self, text: str) -> list[HarmonyEvent]:
        events: list[HarmonyEvent] = []
        for kind, value in self._lexer.feed(text):
            self._item(kind, value, events)
        return events

    def finish(self) -> list[HarmonyEvent]:
        """The reply ended (a stop token, a length limit): close what is open."""
        events: list[HarmonyEvent] = []
        for kind, value in self._lexer.flush():
            self._item(kind, value, events)
        if self._state == "header" and self._header:
            events.append(HarmonyEvent("content", self._header))  # not a header after all
        elif self._state == "body":
            self._close_body(events)
        self._state, self._header = "between", ""
        return events

    def _item(self, kind: str, value: str, events: list[HarmonyEvent]) -> None:
        if self._state == "header":
            self._header_item(kind, value, events)
        elif self._state == "body":
            self._body_item(kind, value, events)
        else:
            self._between_item(kind, value, events)

    def _header_item(self, kind: str, value: str, events: list[HarmonyEvent]) -> None:
        if kind == "marker" and value == MESSAGE:
            header = Header.parse(self._header)
            self._header = ""
            self._state = "body"
            self._kind = header.body_kind
            if self._kind == "tool":
                self.tool_calls += 1
                events.append(HarmonyEvent("tool_name", header.tool_name))
        elif kind == "marker" and value == START:
            self._header = ""  # a new header: the unfinished one said nothing
        elif kind == "marker" and value in MESSAGE_ENDS:
            self._header = ""
            self._to_between()
        else:
            self._header += value
            if len(self._header) > HEADER_LIMIT:
                events.append(HarmonyEvent("content", self._header))
                self._header = ""
                self._to_between()
                self._between_text = True

    def _body_item(self, kind: str, value: str, events: list[HarmonyEvent]) -> None:
        if kind == "marker" and value in MESSAGE_ENDS:
            self._close_body(events)
            self._to_between()
        elif kind == "marker" and value == START:
            self._close_body(events)
            self._state, self._header = "header", ""
        elif value:
            kind_out = "tool_arguments" if self._kind == "tool" else self._kind
            events.append(HarmonyEvent(kind_out, value))

    def _between_item(self, kind: str, value: str, events: list[HarmonyEvent]) -> None:
        if kind == "marker" and value in (START, CHANNEL):
            self._state, self._between_ws = "header", ""
            self._header = value if value == CHANNEL else ""
        elif kind == "text":
            if self._between_text:
                events.append(HarmonyEvent("content", value))
            elif value.strip():
                events.append(HarmonyEvent("content", self._between_ws + value))
                self._between_ws, self._between_text = "", True
            else:
                self._between_ws += value
        # other markers between messages carry nothing

    def _close_body(self, events: list[HarmonyEvent]) -> None:
        if self._kind == "tool":
            events.append(HarmonyEvent("tool_end"))
        self._kind = "content"

    def _to_between(self) -> None:
        self._state, self._between_ws, self._between_text = "between", "", False


def merged(events: Iterable[HarmonyEvent]) -> list[HarmonyEvent]:
    """Adjacent text events of one kind joined (tool names and ends stay apart): what
    the same text gives, however it was split."""
    out: list[HarmonyEvent] = []
    for event in events:
        if (
            out
            and out[-1].kind == event.kind
            and event.kind in ("reasoning", "content", "tool_arguments")
        ):
            out[-1] = HarmonyEvent(event.kind, out[-1].text + event.text)
        else:
            out.append(event)
    return out


# ------------------------------------------------------------------ detection


_harmony_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_harmony_tokenizer(tokenizer) -> bool:
    """Whether the tokenizer's vocabulary has every Harmony marker as one token
    (remembered per tokenizer: a 200 k vocabulary is slow to list)."""
    try:
        return _harmony_tokenizers[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary to show
        return False
    found = all(m in vocab for m in MARKERS)
    try:
        _harmony_tokenizers[tokenizer] = found
    except TypeError:  # cannot be weakly referenced: asked again next time
        pass
    return found


def harmony_stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids of ``<|return|>`` and ``<|call|>``, each of which ends a reply."""
    vocab = tokenizer.get_vocab()
    return tuple(vocab[m] for m in STOP_MARKERS if m in vocab)


# ---------------------------------------------------------------- prompt side


def harmony_effort(effort: Any) -> Any:
    """A client's reasoning effort as one of gpt-oss's three levels (others unchanged)."""
    return {"none": "low", "minimal": "low", "xhigh": "high"}.get(effort, effort)


def harmony_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages in the shape gpt-oss's chat template reads.

    An assistant turn's reasoning (``reasoning_content`` or ``reasoning``)
    becomes ``thinking``; a turn with tool calls keeps its reasoning (or,
    without one, its text) as ``thinking`` and drops its text, since the
    template refuses both. The template renders one tool call per assistant
    message and names each tool result after the call before it, so a turn
    with several calls becomes one message per call, each followed by its
    result when a later tool message answers that call's id.
    """
    results = {
        str(m["tool_call_id"]): j
        for j, m in enumerate(messages)
        if m.get("role") == "tool" and m.get("tool_call_id")
    }
    moved: set[int] = set()  # tool results already placed after their call
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if i in moved:
            continue
        if message.get("role") != "assistant":
            out.append(dict(message))
            continue
        shaped = {k: v for k, v in message.items() if k not in ("reasoning_content", "reasoning")}
        thinking = message.get("reasoning_content") or message.get("reasoning")
        calls = list(message.get("tool_calls") or [])
        if not calls:
            if thinking:
                shaped["thinking"] = thinking
            out.append(shaped)
            continue
        thinking = thinking or message.get("content") or None
        for n, call in enumerate(calls):
            one = dict(shaped, tool_calls=[call], content=None)
            if n == 0 and thinking:
                one["thinking"] = thinking
            out.append(one)
            j = results.get(str(call.get("id")))
            if len(calls) > 1 and j is not None and j > i and j not in moved:
                moved.add(j)
                out.append(dict(messages[j]))
    return out
