"""The engine -> trio hand-over: bounded, in order, and never dropping a message.

A real thread plays the engine (steps as fast as it can, or in bursts), a
trio task plays the ModelLoader (lifecycle notes at random points), and a
consumer takes items at a random pace. Whatever the timing: every message
arrives exactly once, the engine's steps in the order it made them, the
notes in the order they were put, a note put after the engine thread
returned (as ``ModelLost`` is) after all of its steps, and never more than
``steps_ahead`` steps in flight.
"""

from __future__ import annotations

import random
import threading

import pytest
import trio
import trio.lowlevel
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.handover import LIFECYCLE_SLOTS, Handover


@given(
    steps=st.integers(0, 60),
    steps_ahead=st.integers(1, 5),
    notes=st.lists(st.integers(0, 60), max_size=6),
    consumer_delays=st.lists(st.sampled_from([0, 0, 0, 0.001]), min_size=1, max_size=10),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None)
def test_every_message_arrives_once_in_order_within_bounds(
    steps, steps_ahead, notes, consumer_delays, seed
):
    async def main():
        handover = Handover(steps_ahead)
        handover.bind()
        made: list[int] = []  # steps handed over, in order (written by the engine thread)
        in_flight = {"steps": 0, "max": 0}
        lock = threading.Lock()
        rng = random.Random(seed)

        def engine():
            for i in range(steps):
                handover.put_from_thread(("step", i), trio.from_thread.check_cancelled)
                with lock:
                    made.append(i)
                    in_flight["steps"] += 1
                    in_flight["max"] = max(in_flight["max"], in_flight["steps"])

        received: list = []

        async def notes_meanwhile():
            for k, after in enumerate(sorted(notes)):
                while True:
                    with lock:
                        if len(made) >= min(after, steps):
                            break
                    await trio.lowlevel.checkpoint()
                await handover.put(("note", k))

        async def loader():
            async with trio.open_nursery() as inner:
                inner.start_soon(notes_meanwhile)
                await trio.to_thread.run_sync(engine)
            await handover.put(("lost", None))

        async def consumer():
            i = 0
            async for item in handover.receive:
                await trio.sleep(consumer_delays[i % len(consumer_delays)] * rng.random())
                i += 1
                message = item.taken()
                if message[0] == "step":
                    with lock:
                        in_flight["steps"] -= 1
                received.append(message)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            await loader()
            handover.close()

        got_steps = [m[1] for m in received if m[0] == "step"]
        assert got_steps == list(range(steps))  # all, once, in order
        assert [m[1] for m in received if m[0] == "note"] == list(range(len(notes)))
        assert received[-1] == ("lost", None)
        assert in_flight["max"] <= steps_ahead + 1  # counted after the put returned

    trio.run(main)


async def test_a_blocked_engine_thread_sees_cancellation():
    """With no consumer, the engine thread waits for a credit, and leaves when cancelled."""
    handover = Handover(1)
    handover.bind()
    handed = []

    def engine():
        for i in range(3):
            handover.put_from_thread(i, trio.from_thread.check_cancelled)
            handed.append(i)

    with trio.move_on_after(0.5) as scope:
        await trio.to_thread.run_sync(engine)
    assert scope.cancelled_caught
    assert handed == [0]  # one credit: the second put waited until cancelled


async def test_lifecycle_notes_wait_for_room_instead_of_being_dropped():
    handover = Handover(1)
    handover.bind()
    for i in range(LIFECYCLE_SLOTS):
        await handover.put(i)
    with trio.move_on_after(0.2) as scope:
        await handover.put("one too many")
    assert scope.cancelled_caught  # waited: the slots are full
    item = handover.receive.receive_nowait()
    assert item.taken() == 0
    await handover.put("fits now")
    taken = [handover.receive.receive_nowait().taken() for _ in range(LIFECYCLE_SLOTS)]
    assert taken == [*range(1, LIFECYCLE_SLOTS), "fits now"]


def test_steps_ahead_must_be_positive():
    with pytest.raises(ValueError):
        Handover(0)
