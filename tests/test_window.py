"""Context windows and choices without a server: the window and budget arithmetic,
where a model's window comes from, the renderer of several choices when one
fails, and a follower rank's watch of its launcher and of rank 0."""

from __future__ import annotations

import json
import threading
import types

import attrs
import pytest

from actors.session import fit_max_tokens
from api.choices import ChoicesRenderer
from api.renderers import ChatRenderer
from runtime.distributed import LeaderWatch, ParentWatch
from runtime.engine.loading import context_window
from runtime.errors import ClientError, PayloadTooLarge
from runtime.messages import Delta, Failed, Finished, FinishReason, Usage

# --------------------------------------------------------------- fit_max_tokens


def test_max_tokens_is_lowered_to_what_the_window_leaves():
    assert fit_max_tokens(10**9, prompt_tokens=100, window=4096) == 3996
    assert fit_max_tokens(50, prompt_tokens=100, window=4096) == 50
    assert fit_max_tokens(50, prompt_tokens=4095, window=4096) == 1
    assert fit_max_tokens(10**9, prompt_tokens=4095, window=None) == 10**9


@pytest.mark.parametrize("prompt", [4096, 4307])
def test_a_prompt_that_leaves_no_room_is_a_400_with_both_numbers(prompt):
    with pytest.raises(ClientError) as caught:
        fit_max_tokens(16, prompt_tokens=prompt, window=4096, param="prompt")
    error = caught.value
    assert error.status == 400 and error.code == "context_length_exceeded"
    assert error.param == "prompt"
    assert "4096" in error.message and str(prompt) in error.message


def test_the_kv_budget_lowers_max_tokens_and_refuses_only_a_prompt_that_cannot_fit():
    # 512 bytes a token, 40 000 bytes: 78 tokens in all.
    budget = dict(kv_bytes_per_token=512, kv_budget=40_000)
    assert fit_max_tokens(10**9, prompt_tokens=10, window=2048, **budget) == 68
    assert fit_max_tokens(10**9, prompt_tokens=10, window=2048, choices=2, **budget) == 29
    assert fit_max_tokens(5, prompt_tokens=10, window=2048, **budget) == 5
    with pytest.raises(PayloadTooLarge) as caught:
        fit_max_tokens(5, prompt_tokens=78, window=2048, param="messages", **budget)
    assert caught.value.param == "messages" and "78 tokens" in caught.value.message
    with pytest.raises(PayloadTooLarge):
        fit_max_tokens(5, prompt_tokens=40, window=2048, choices=2, **budget)


# --------------------------------------------------------------- context_window


def model_with(**args):
    return types.SimpleNamespace(args=types.SimpleNamespace(**args))


def tokenizer_with(limit):
    return types.SimpleNamespace(model_max_length=limit)


def test_the_window_is_the_models_or_a_smaller_real_tokenizer_limit():
    assert context_window(model_with(max_position_embeddings=4096), tokenizer_with(int(1e30))) == 4096
    assert context_window(model_with(max_position_embeddings=4096), tokenizer_with(2048)) == 2048
    assert context_window(model_with(max_position_embeddings=4096), tokenizer_with(8192)) == 4096
    assert context_window(model_with(), tokenizer_with(1024)) == 1024
    assert context_window(model_with(), tokenizer_with(None)) is None
    nested = model_with(text_config={"max_position_embeddings": 32768})
    assert context_window(nested, tokenizer_with(int(1e30))) == 32768


def test_max_model_len_replaces_the_models_window(caplog):
    model = model_with(max_position_embeddings=4096)
    assert context_window(model, tokenizer_with(None), 1000) == 1000
    assert context_window(model, tokenizer_with(None), 8192) == 8192
    assert "longer than the model's context window (4096 tokens)" in caplog.text


# ------------------------------------------------------- several choices, one fails


def render_stream(renderer, *batches) -> list[dict | str]:
    frames = []
    for items in batches:
        for block in renderer.stream_frames(items).decode().split("\n\n"):
            if block.startswith("data: "):
                body = block[6:]
                frames.append(body if body == "[DONE]" else json.loads(body))
    return frames


def usage(completion: int) -> Usage:
    return Usage(prompt_tokens=9, completion_tokens=completion, cached_tokens=0)


def choices_renderer(n: int = 3) -> ChoicesRenderer:
    def make():
        return ChatRenderer(model="m", fingerprint="f", logprobs=False, include_usage=False)

    return ChoicesRenderer(make, n, include_usage=True)


def test_a_failing_choice_ends_the_stream_as_one_choice_would():
    renderer = choices_renderer()
    shutdown = Failed(message="the server is shutting down", status=503,
                      type="service_unavailable", retry_after=5)
    frames = render_stream(
        renderer,
        [Delta(content="a", index=0), Delta(content="b", index=1), Delta(content="c", index=2)],
        [Finished(finish_reason=FinishReason.STOP, usage=usage(4), index=1)],
        [attrs.evolve(shutdown, usage=usage(6), index=0),
         attrs.evolve(shutdown, usage=usage(5), index=2)],
        [Delta(content="late", index=2)],  # after the end: nothing
    )
    assert frames[-1] == "[DONE]"
    finals = {f["choices"][0]["index"]: f["choices"][0]["finish_reason"]
              for f in frames[:-1] if "choices" in f and f["choices"]
              and f["choices"][0]["finish_reason"]}
    assert finals == {1: "stop", 0: "abort", 2: "abort"}
    usage_frame, error = frames[-3], frames[-2]
    assert usage_frame["usage"]["prompt_tokens"] == 9
    assert usage_frame["usage"]["completion_tokens"] == 4 + 6 + 5
    assert error["error"]["message"] == "the server is shutting down"
    assert all("late" not in json.dumps(f) for f in frames)


def test_several_choices_in_one_body():
    renderer = choices_renderer(2)
    for item in (Delta(content="x", index=1), Delta(content="y", index=0),
                 Finished(finish_reason=FinishReason.LENGTH, usage=usage(3), index=1)):
        renderer.add(item)
    assert renderer.terminal is None
    renderer.add(Finished(finish_reason=FinishReason.STOP, usage=usage(2), index=0))
    body = renderer.body()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] \
        == [(0, "y", "stop"), (1, "x", "length")]
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] == 9


# ---------------------------------------------------------- a follower's watch


def test_a_parent_that_is_gone_is_seen():
    assert not ParentWatch().gone()
    assert ParentWatch(pid=2**22 + 12345).gone()  # not our parent: ours has gone, as it were
    assert not ParentWatch(pid=1).gone()  # started by init: nothing to watch


def test_the_leader_watch_leaves_when_rank0_falls_silent_or_the_launcher_goes():
    left = threading.Event()
    statuses = []

    def leave(status):
        statuses.append(status)
        left.set()

    watch = LeaderWatch(ParentWatch(), timeout=0.3, interval=0.05, leave=leave)
    watch.start()
    assert not left.wait(0.5)  # silence counts only from the first tick
    watch.tick()
    assert watch.reason() is None
    assert left.wait(5) and statuses == [1]
    assert "rank 0 has sent no step or heartbeat" in watch.reason()

    gone = LeaderWatch(ParentWatch(pid=2**22 + 12345), timeout=60)
    assert "the launcher" in gone.reason()


# ------------------------------------------------- Hypercorn's shutdown deadline


class ClosingSession:
    def __init__(self):
        self.deadlines = []

    def server_closing(self, deadline: float) -> None:
        self.deadlines.append(deadline)


async def test_a_deadline_on_the_request_is_a_shutdown_but_a_cancelled_request_is_not():
    import trio

    from api.generation import _notice_server_deadline

    session = ClosingSession()
    _notice_server_deadline(session)  # no deadline: serving as usual
    deadline = trio.current_time() + 3
    with trio.move_on_at(deadline):  # Hypercorn's graceful timeout, as a request sees it
        _notice_server_deadline(session)
        await trio.lowlevel.checkpoint()
    assert session.deadlines == [deadline]
    with trio.CancelScope() as scope:
        scope.cancel()  # the client left: the effective deadline reads -inf
        _notice_server_deadline(session)
        await trio.lowlevel.checkpoint()
    assert session.deadlines == [deadline]
