"""Property tests for the request Outbox and for the prompt cache's segment plan."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.messages import Delta, Failed, Finished, Progress, ToolCall, Usage
from runtime.outbox import Outbox
from runtime.prompts import SEGMENTED_ROLES, THINKING_TAIL_TOKENS, plan_segments

# ------------------------------------------------------------------- Outbox

USAGE = Usage(prompt_tokens=1, completion_tokens=2, cached_tokens=0)

op = st.one_of(
    st.tuples(
        st.just("delta"),
        st.text(alphabet="ab é\n", max_size=4),
        st.text(alphabet="xy", max_size=3),
        st.integers(0, 2),
    ),
    st.tuples(st.just("progress"), st.integers(0, 100)),
    st.tuples(st.just("terminal"), st.sampled_from(["finished", "failed"])),
    st.tuples(st.just("take")),
    st.tuples(st.just("close")),
)


def terminal_message(kind: str, n: int):
    if kind == "finished":
        return Finished(finish_reason=f"stop{n}", usage=USAGE)
    return Failed(message=f"boom{n}")


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=30))
def test_outbox_interleavings(ops):
    outbox = Outbox()
    want_content, want_reasoning, want_calls = [], [], []
    want_terminal = None
    want_progress = None  # the progress note a take() should return next
    closed = False
    takes: list[tuple] = []

    def take():
        nonlocal want_progress
        items = outbox.take()
        takes.append(items)
        progress = [i for i in items if isinstance(i, Progress)]
        assert progress == ([want_progress] if want_progress is not None else [])
        want_progress = None

    for n, (kind, *args) in enumerate(ops):
        accepting = not closed and want_terminal is None
        if kind == "delta":
            content, reasoning, n_calls = args
            calls = tuple(
                ToolCall(name=f"f{n}", arguments="{}", id=f"c{n}_{i}") for i in range(n_calls)
            )
            outbox.put_delta(content=content, reasoning=reasoning, tool_calls=calls)
            if accepting:
                want_content.append(content)
                want_reasoning.append(reasoning)
                want_calls.extend(calls)
        elif kind == "progress":
            outbox.put_progress(Progress(done=args[0], total=100))
            if accepting:
                want_progress = Progress(done=args[0], total=100)
        elif kind == "terminal":
            message = terminal_message(args[0], n)
            outbox.put_terminal(message)
            if accepting:
                want_terminal = message
            assert outbox.has_terminal == (want_terminal is not None)
        elif kind == "take":
            take()
        else:
            outbox.close()
            closed = True
            assert outbox.closed
    take()
    assert outbox.take() == ()

    items = [i for batch in takes for i in batch]
    deltas = [i for i in items if isinstance(i, Delta)]
    assert "".join(d.content for d in deltas) == "".join(want_content)
    assert "".join(d.reasoning for d in deltas) == "".join(want_reasoning)
    assert [c for d in deltas for c in d.tool_calls] == want_calls
    assert all(d.content or d.reasoning or d.tool_calls or d.logprobs for d in deltas)
    terminals = [i for i in items if isinstance(i, Finished | Failed)]
    if want_terminal is None:
        assert terminals == []
    else:
        assert terminals == [want_terminal] and terminals[0] is want_terminal
        assert items[-1] is want_terminal  # always last: nothing is taken after it
    for batch in takes:  # each take: at most one progress, one delta, one terminal, in order
        kinds = [0 if isinstance(i, Progress) else 1 if isinstance(i, Delta) else 2 for i in batch]
        assert kinds == sorted(set(kinds))


script_op = st.one_of(
    st.tuples(st.just("delta"), st.text(alphabet="abc", min_size=1, max_size=3)),
    st.tuples(st.just("progress"), st.integers(0, 9)),
    st.tuples(st.just("checkpoint")),
)


@settings(max_examples=40, deadline=None)
@given(
    script=st.lists(script_op, max_size=25),
    consumer_pauses=st.lists(st.booleans(), max_size=25),
    end=st.sampled_from(["finished", "failed"]),
)
async def test_get_receives_everything_the_producer_puts(script, consumer_pauses, end):
    outbox = Outbox()
    received: list = []
    terminal = terminal_message(end, 0)

    async def producer():
        for kind, *args in script:
            if kind == "delta":
                outbox.put_delta(content=args[0])
            elif kind == "progress":
                outbox.put_progress(Progress(done=args[0], total=9))
            else:
                await trio.lowlevel.checkpoint()
        outbox.put_terminal(terminal)
        outbox.put_delta(content="after the end")  # dropped

    async def consumer():
        pauses = iter(consumer_pauses)
        while True:
            items = await outbox.get()
            assert items, "get() never returns an empty batch"
            received.extend(items)
            if isinstance(items[-1], Finished | Failed):
                break
            if next(pauses, False):
                await trio.lowlevel.checkpoint()
        with pytest.raises(trio.EndOfChannel):
            await outbox.get()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            nursery.start_soon(producer)

    content = "".join(i.content for i in received if isinstance(i, Delta))
    assert content == "".join(args[0] for kind, *args in script if kind == "delta")
    assert [i for i in received if isinstance(i, Finished | Failed)] == [terminal]
    assert received[-1] is terminal
    done = [i.done for i in received if isinstance(i, Progress)]
    sent = [args[0] for kind, *args in script if kind == "progress"]
    assert all(d in sent for d in done)  # progress notes may be merged, never invented
    if sent:
        # The last progress note is never lost: it is delivered before the terminal.
        assert done and done[-1] == sent[-1]


async def test_close_wakes_a_waiting_consumer():
    outbox = Outbox()

    async def consumer(task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        with pytest.raises(trio.EndOfChannel):
            await outbox.get()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(consumer)
            await trio.lowlevel.checkpoint()
            outbox.close()
            outbox.put_delta(content="dropped")
    assert outbox.take() == ()


# ------------------------------------------------------------ plan_segments

THINK = 99  # the think-start token in these prompts
SEGMENT_TYPES = ("system", "user", "assistant")


def rfind_think(prompt, start):
    """Like ``TokenizerWrapper.rfind_think_start``: start is clamped at 0."""
    for i in range(len(prompt) - 1, max(start, 0) - 1, -1):
        if prompt[i] == THINK:
            return i
    return -1


def divergence(system_prefix, prompt) -> int | None:
    """First index where the two differ, within their common length."""
    for i, (a, b) in enumerate(zip(system_prefix, prompt, strict=False)):
        if a != b:
            return i
    return None


token = st.one_of(st.integers(0, 20), st.just(THINK))


@st.composite
def plan_inputs(draw):
    prompt = tuple(draw(st.lists(token, max_size=30)))
    mode = draw(st.sampled_from(["none", "empty", "diverging", "random", "prefix", "extends"]))
    if mode == "none":
        system_prefix = None
    elif mode == "empty":
        system_prefix = []
    elif mode == "diverging":  # a real system prompt: shared prefix, then a different turn
        k = draw(st.integers(0, len(prompt)))
        tail = draw(st.lists(st.integers(21, 30), min_size=1, max_size=5))
        system_prefix = list(prompt[:k]) + tail
    elif mode == "random":
        system_prefix = draw(st.lists(token, max_size=30))
    elif mode == "prefix":  # the system rendering is a prefix of the prompt: no divergence
        system_prefix = list(prompt[: draw(st.integers(0, len(prompt)))])
    else:
        system_prefix = list(prompt) + draw(st.lists(token, max_size=5))
    last_role = draw(st.sampled_from(["user", "user", "assistant", "system", "tool"]))
    thinking = draw(st.booleans())
    return prompt, system_prefix, last_role, thinking


@settings(max_examples=400, deadline=None)
@given(plan_inputs())
def test_plan_segments(inputs):
    prompt, system_prefix, last_role, thinking = inputs
    d = divergence(system_prefix or [], prompt)
    has_system = bool(last_role in SEGMENTED_ROLES and prompt and system_prefix and d)

    plan = plan_segments(
        prompt,
        last_role=last_role,
        system_prefix=system_prefix,
        think_start_at=rfind_think if thinking else None,
    )
    segments, types = plan.segments, plan.segment_types
    assert sum(segments, ()) == prompt
    assert len(types) == len(segments) >= 1
    assert set(types) <= set(SEGMENT_TYPES)
    # In order, each at most once; every segment non-empty (mlx-lm drops empty
    # segments, which would shift the segment types).
    assert list(types) == sorted(set(types), key=SEGMENT_TYPES.index)
    if prompt:
        assert all(segments)
    if last_role not in SEGMENTED_ROLES or not prompt:
        assert (segments, types) == ((prompt,), ("assistant",))
        return
    # A system segment iff the system rendering diverges from the prompt at d > 0;
    # it is then exactly the shared prefix.
    assert ("system" in types) == has_system
    if has_system:
        assert segments[0] == prompt[:d]
    # A thinking tail: the last think token among the last 11 starts the assistant segment.
    found = rfind_think(prompt, len(prompt) - THINKING_TAIL_TOKENS) if thinking else -1
    if found >= 0:
        # The tail never overlaps the system segment.
        tail = max(found, d) if has_system else found
        assert types[-1] == "assistant"
        assert segments[-1] == prompt[tail:]
    else:
        assert "assistant" not in types


def test_plan_segments_think_token_inside_system_segment():
    prompt = (1, 2, THINK, 3, 4, 5, 6, 7, 8, 9, 10, 11)
    system_prefix = (1, 2, THINK, 3, 50)  # diverges at index 4
    plan = plan_segments(
        prompt, last_role="user", system_prefix=system_prefix, think_start_at=rfind_think
    )
    # The tail never reaches back into the system segment: it starts where that ends.
    assert plan.segments == ((1, 2, THINK, 3), (4, 5, 6, 7, 8, 9, 10, 11))
    assert plan.segment_types == ("system", "assistant")
