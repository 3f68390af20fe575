"""How an engine step fails: one sequence, its whole batch, or the engine itself.

A batch generator's ``next()`` raises ``SequenceError`` to fail one sequence
alone (``SerialGenerator`` does, for the sequence it serves); any other
exception fails every sequence in the batch and the ``EngineCore`` goes on
with a new generator. A batch that failed because the device's memory ran out
(``out_of_memory``) was not failed by its requests: they may be retried once
the batch's memory is free. After ``FAILED_STEPS_TO_RESTART`` such steps in a
row the core raises ``EngineBroken``, which ends the engine loop as a crash; it
raises it at once where the device itself failed (``device_lost``: a CUDA error
that stays with the process, such as an illegal memory access), whose requests
may be retried on the engine that replaces it.
Owns no state; the core counts the failed steps.
"""

from __future__ import annotations

# Steps in a row that failed their whole batch: then the engine, not a request, is broken.
FAILED_STEPS_TO_RESTART = 3

# What MLX's backends raise when an allocation fails, lower-cased: CUDA's
# ("cudaMallocAsync(...) failed: out of memory"), Metal's ("Insufficient Memory",
# "... greater than the maximum allowed buffer size") and the CPU's ("Unable to
# allocate").
OUT_OF_MEMORY_MARKS = ("out of memory", "insufficient memory", "maximum allowed buffer size",
                       "unable to allocate")


# CUDA's errors that stay with the process once raised (every later call fails with
# them), lower-cased as the runtime words them: an illegal address, a device-side
# assertion, a bad instruction or address space, a launch that failed. Seen after a
# step ran an 80 GB H100 out of memory: the next step raised the first.
DEVICE_LOST_MARKS = ("illegal memory access", "device-side assert", "illegal instruction",
                     "misaligned address", "invalid program counter",
                     "not supported on global/shared address space",
                     "unspecified launch failure", "hardware stack error")


def failed_step(error: Exception) -> tuple[str, bool]:
    """What the requests of a step that raised ``error`` are told, and whether they may
    retry (503 with Retry-After): they may where the device's memory ran out, since the
    failed batch's memory is free again once its generator is dropped, and where the
    device failed, since a new engine takes over."""
    if out_of_memory(error):
        return f"the engine ran out of memory in a step ({error}); retry shortly", True
    if device_lost(error):
        return f"the engine's device failed ({error}); the engine restarts, retry shortly", True
    return f"engine step failed: {error}", False


def memory_text() -> str:
    """MLX's memory as a failed step leaves it (active, peak since the process started,
    freed buffers kept), for its log line: what the batch, its copies and the prompt
    cache held when a device ran out."""
    try:
        import mlx.core as mx

        return (f"MLX memory: active {mx.get_active_memory() / 1e9:.2f} GB, peak "
                f"{mx.get_peak_memory() / 1e9:.2f} GB, cached {mx.get_cache_memory() / 1e9:.2f} GB")
    except Exception as exc:  # a device that failed may fail these too
        return f"MLX memory unknown ({exc})"


def device_lost(error: BaseException) -> bool:
    """Whether ``error`` is one of CUDA's errors that no later step in this process
    escapes (``DEVICE_LOST_MARKS``): the engine must be replaced, not given a new batch."""
    return _says(error, DEVICE_LOST_MARKS)


def out_of_memory(error: BaseException) -> bool:
    """Whether a step failed because the device's memory ran out: a ``MemoryError``, or a
    ``RuntimeError`` whose message is one of MLX's failed allocations."""
    return isinstance(error, MemoryError) or _says(error, OUT_OF_MEMORY_MARKS)


def _says(error: BaseException, marks: tuple[str, ...]) -> bool:
    """Whether ``error`` is a ``RuntimeError`` (what MLX raises) whose message, lower-cased,
    holds one of ``marks``."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(mark in text for mark in marks)


class SequenceError(Exception):
    """A batch generator could not go on with one sequence: only its request fails.

    Raised from ``next()`` (``SerialGenerator`` does, for the sequence it
    serves); any other exception from a step fails every sequence in the batch.
    """

    def __init__(self, uid: int, message: str):
        super().__init__(message)
        self.uid = uid
        self.message = message


class EngineBroken(RuntimeError):
    """``FAILED_STEPS_TO_RESTART`` steps in a row failed every sequence they held, or
    one step met an error of the device that stays with the process (``device_lost``).

    A step that raises fails its batch and the engine goes on with a new one,
    which is right when one batch was bad. When the batches that follow fail
    too, MLX itself is in a state no new batch mends (a sticky CUDA error, a
    cache past a limit): this ends the engine loop as a crash, so /health turns
    503 and the ModelLoader starts a fresh engine (a fresh process by default).
    A sticky CUDA error that names itself ends it at its first step.
    """
