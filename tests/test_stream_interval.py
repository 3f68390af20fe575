"""--stream-interval-ms: a streaming response's chunks at most that often, the
tokens in between merged, nothing lost, the first chunk never held back.

A fake Session over a real Outbox, a producer that puts one token every 10 ms
of trio's mock clock (pytest-trio's ``autojump_clock``), and the real
SessionStream and ChatRenderer."""

from __future__ import annotations

import json

import pytest
import trio

from api.generation import SessionStream
from api.renderers import ChatRenderer
from runtime.config import ConfigError, config_from_env
from runtime.messages import Finished, Usage
from runtime.outbox import Outbox

TOKENS = [f"w{i} " for i in range(20)]


class OutboxSession:
    """What SessionStream uses of a Session: receive(), close() and n (one choice)."""

    n = 1

    def __init__(self) -> None:
        self.outbox = Outbox()
        self.closed = False

    async def receive(self):
        return await self.outbox.get()

    def close(self) -> None:
        self.closed = True


async def _produce(outbox: Outbox, step: float) -> None:
    for token in TOKENS:
        outbox.put_delta(content=token)
        await trio.sleep(step)
    outbox.put_terminal(
        Finished(
            finish_reason="stop",
            usage=Usage(prompt_tokens=3, completion_tokens=20, cached_tokens=0),
        )
    )


def _content(chunk: bytes) -> str:
    text = ""
    for line in chunk.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                text += (choice.get("delta") or {}).get("content") or ""
    return text


async def _stream(interval: float) -> list[tuple[float, str]]:
    session = OutboxSession()
    renderer = ChatRenderer(model="m", fingerprint="fp", logprobs=False, include_usage=False)
    stream = SessionStream(session, renderer, interval)
    chunks = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_produce, session.outbox, 0.010)
        async for chunk in stream:
            chunks.append((trio.current_time(), chunk))
    assert session.closed  # the stream ended: the Session was closed
    return [(t, _content(c)) for t, c in chunks]


@pytest.mark.parametrize("interval", [0.0, 0.035, 0.1])
async def test_chunks_come_at_most_once_per_interval_and_lose_nothing(interval, autojump_clock):
    chunks = await _stream(interval)
    text = "".join(content for _, content in chunks)
    assert text == "".join(TOKENS)
    times = [t for t, _ in chunks]
    assert times[0] == pytest.approx(0.0)  # the first token is sent at once
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(g >= interval - 1e-9 for g in gaps)
    if interval == 0.0:
        assert len(chunks) >= len(TOKENS)  # one chunk per token (and the final one)
    else:
        # 20 tokens over 200 ms: about 200 ms / interval chunks, each of several tokens.
        assert len(chunks) <= 0.2 / interval + 3
        assert max(content.count("w") for _, content in chunks) > 1


async def test_a_cancelled_stream_leaves_its_session_while_waiting(autojump_clock):
    session = OutboxSession()
    renderer = ChatRenderer(model="m", fingerprint="fp", logprobs=False, include_usage=False)
    stream = SessionStream(session, renderer, 10.0)
    session.outbox.put_delta(content="a")
    assert _content(await stream.__anext__()) == "a"
    session.outbox.put_delta(content="b")
    with trio.move_on_after(1.0):  # the client goes away during the 10 s wait
        await stream.__anext__()
        pytest.fail("the interval should still have been running")
    await stream.aclose()
    assert session.closed


def test_the_setting_is_checked():
    assert config_from_env({"MLX_TRIO_STREAM_INTERVAL_MS": "40"}).stream_interval_ms == 40.0
    with pytest.raises(ConfigError, match="stream_interval_ms"):
        config_from_env({"MLX_TRIO_STREAM_INTERVAL_MS": "-1"})
