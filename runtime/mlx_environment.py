"""The MLX settings a long-running server needs: environment variables MLX reads, the
free-buffer cache's bound, and the default step sizes by device.

Owns ``server_defaults``, called by the engine before its first MLX
operation (``runtime.engine.loading.make_engine_core``, in the engine's thread
or process). It receives the environment and sets, where the operator has not,
the variables MLX's CUDA backend reads when it builds its caches (each cache
reads its variable once, when first used). Emits the names it set.

* ``MLX_ENABLE_CACHE_THRASHING_CHECK=0``. MLX's CUDA caches (CUDA graphs, cuDNN
  attention graphs, convolution plans) count their misses over the process's
  life: past twice a cache's capacity (800 for graphs, 512 for attention) every
  miss raises "Cache thrashing is happening", however high the hit rate. A
  server meets new shapes as long as it runs (prefill groups' sizes and prompt
  lengths), so every later step with a new shape would fail its requests.
* ``MLX_CUDA_SDPA_CACHE_SIZE=1024``. Every prefill shape not in the cuDNN
  attention cache builds and finalizes a cuDNN graph (runtime compilation
  included) on the engine's thread: 4 % of the engine's samples in a native
  profile on an H200 at 64 clients (docs/performance.md). The default 256
  cycles through a server's mix of prefill group sizes and prompt lengths.

``bound_buffer_cache`` (called by the same function) keeps MLX's cache of freed
buffers to a sixteenth of the device's memory (below). ``wait_before_batch_copy``
(called by ``runtime.mlx_lm_batches``' generation batch as rows join or leave)
keeps a large batch's KV cache from being held three times at once, and
``default_kv_budget`` leaves room for it to be held twice.

The attention MLX's CUDA backend runs for a prefill and for a masked decode step
is routed by ``runtime.cuda_attention``.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# Prompt tokens per prefill step where --prefill-step-size is not given, by the
# device MLX computes on: mlx-lm's 2048 on a GPU. On the CPU, MLX's attention
# computes each chunk's scores in full, the causally masked ones included, a waste
# that grows with the chunk: a lone 3,120-token prompt of the tiny test model
# prefilled in 1.41 s in chunks of 512 against 1.84 in chunks of 2,048, one of a
# 32-layer, 8-head model in 39 s against 49 (bench/prefill_step_sizes.py).
PREFILL_STEP_SIZES = {"gpu": 2048, "cpu": 512}


def default_prefill_step_size(mx) -> int:
    """The prefill step size for MLX's default device (``PREFILL_STEP_SIZES``)."""
    return PREFILL_STEP_SIZES["gpu" if mx.default_device().type == mx.gpu else "cpu"]


# runtime.decode_lanes' padding limit by device: about the padded key positions whose
# attention costs a decode pass. An H200 step of 16 short rows took 8 ms and rose to
# 80 with one 30k-token row padding them (0.16 us a position); the CPU's passes are
# cheaper beside its attention (the test model: 0.3 us a position, about 1 ms a pass,
# bench/decode_lanes.py: even 8,000 positions cost 3.5 ms); a larger model's pass
# costs more beside its attention, hence the margin.
DECODE_LANE_PADDING = {"gpu": 32768, "cpu": 8192}


def default_decode_lane_padding(mx) -> int:
    """The decode lanes' padding limit for MLX's default device (``DECODE_LANE_PADDING``)."""
    return DECODE_LANE_PADDING["gpu" if mx.default_device().type == mx.gpu else "cpu"]


SERVER_DEFAULTS = {
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
    "MLX_CUDA_SDPA_CACHE_SIZE": "1024",
}


def server_defaults(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set each of ``SERVER_DEFAULTS`` the environment does not set; the names set."""
    environ = os.environ if environ is None else environ
    chosen = [name for name in SERVER_DEFAULTS if name not in environ]
    for name in chosen:
        environ[name] = SERVER_DEFAULTS[name]
    return chosen


# What prefill does with MLX's freed buffers after each chunk (``--prefill-buffers``):
# keep them for reuse within the bound below, or clear them as mlx-lm does.
PREFILL_BUFFER_MODES = ("keep", "clear")

# Freed buffers MLX keeps for reuse: at most this share of the device's memory
# (and at least MIN_CACHE_BYTES). A batch's KV cache is rebuilt whole when
# sequences join it, leave it, or grow past its allocation (all of it copied), so
# with long prompts each rebuild frees buffers of tens of GB that no later
# allocation of another size reuses; MLX's default (the whole memory limit) kept
# them until an allocation failed (16 agent sessions of 12k tokens on an H200
# ran out of memory at their first decode steps).
CACHE_SHARE = 1 / 16
MIN_CACHE_BYTES = 2 << 30


# MLX's ``device_info`` keys for the device's memory: Metal's, CUDA's (an H200's).
MEMORY_KEYS = ("memory_size", "total_memory")


def device_memory(mx) -> int:
    """The bytes of memory MLX reports for its device; 0 where it reports none (its CPU
    backend)."""
    try:
        info = mx.device_info()
        return next((int(info[key]) for key in MEMORY_KEYS if info.get(key)), 0)
    except Exception:
        return 0


# A prompt group's prefill attention (``runtime.mlx_lm_prefill.size_prefill_group``):
# one layer's float32 scores in the group's deepest step stay within this share of the
# device's memory. A group of more than one prompt attends under mlx-lm's array mask,
# which MLX computes unfused, holding the scores several times over (the products, the
# masked ones, the softmax); mlx-lm's own BatchGenerator, given eight cold 32k-token
# prompts at once, ran an H200 (141 GB) out of memory in its first prefill step.
PREFILL_SCORES_SHARE = 1 / 16
SCORE_BYTES = 4  # float32: MLX's fallback computes the softmax in float32


def prefill_score_budget(mx, heads: int) -> int | None:
    """Score elements per attention head that a prompt group's deepest prefill step may
    hold (``PREFILL_SCORES_SHARE`` of the device's memory); None where MLX does not
    report the memory (its CPU backend), which leaves groups unbounded."""
    memory = device_memory(mx)
    if not memory:
        return None
    return int(memory * PREFILL_SCORES_SHARE) // (SCORE_BYTES * max(1, heads))


def bound_buffer_cache(mx) -> int | None:
    """Lower MLX's free-buffer cache limit to ``CACHE_SHARE`` of the device's memory
    (never raise it); the limit set, or None where the memory size is unknown."""
    memory = device_memory(mx)
    if not memory:
        return None
    limit = max(MIN_CACHE_BYTES, int(memory * CACHE_SHARE))
    previous = mx.set_cache_limit(limit)
    if previous < limit:
        mx.set_cache_limit(previous)
        return previous
    return limit


# A decoding batch whose KV cache holds at least this share of the device's memory
# waits for the device before a row joins it or leaves it (``wait_before_batch_copy``),
# and a batch that large copies and grows a layer at a time (``runtime.batch_layers``).
BATCH_COPY_WAIT_SHARE = 1 / 8


def memory_bytes(mx) -> int:
    """The device's memory as MLX reports it, or the machine's RAM where it reports
    none (its CPU backend, whose arrays live there)."""
    return device_memory(mx) or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def large_batch_bytes(mx) -> int:
    """The KV bytes from which a decoding batch counts as large (``BATCH_COPY_WAIT_SHARE``
    of ``memory_bytes``): it waits before its copies, and keeps leaving rows' places
    (``runtime.vacant_rows``)."""
    return int(memory_bytes(mx) * BATCH_COPY_WAIT_SHARE)


def kv_bytes(caches: list) -> int:
    """The bytes a batch's KV layers hold in their keys and values arrays."""
    return sum(array.nbytes for c in caches
               for array in (getattr(c, "keys", None), getattr(c, "values", None))
               if array is not None)


def wait_before_batch_copy(mx, caches: list) -> bool:
    """Wait for the device before a decoding batch's layers are copied whole (mlx-lm's
    ``BatchKVCache`` concatenates its rows with a joining batch's, and selects the rows
    that stay into new arrays), where they hold at least ``BATCH_COPY_WAIT_SHARE`` of
    the device's memory. Returns whether it waited.

    A copy holds the batch twice until the step in flight, which reads the old arrays,
    is done. A row that leaves and one that joins a step later then held it three
    times: sixteen agent sessions of 14k tokens (27 GB of KV) ran an 80 GB H100 out of
    memory at 61 GB active. Waiting first frees the last copy's old arrays, so a copy
    never finds another in flight; it costs the host's head start on that one step.
    Nothing waits where the batch is small."""
    large = large_batch_bytes(mx)
    if kv_bytes(caches) < large:
        return False
    mx.synchronize()
    return True


# The default KV budget's share of the memory the weights leave (the accelerator's,
# or the machine's RAM on the CPU). A decoding batch's KV cache is copied as rows join
# or leave it and as it grows (mlx-lm's BatchKVCache): a batch below
# ``BATCH_COPY_WAIT_SHARE`` of the memory is held twice for a moment, a larger one once
# and a layer more (``runtime.batch_layers``). The rest holds the weights' neighbours:
# the prompt cache, MLX's freed buffers and the steps' activations. At half the memory,
# the budget let a batch and its copies alone fill the device; on an 80 GB H100 a
# budget of 59 % ran sixteen 24k-token agent sessions out of memory in their first
# turns even with the copies a layer at a time (docs/performance.md).
KV_BUDGET_SHARE = 0.35


def _share_beside_weights(mx, weights_bytes: int, share: float) -> int:
    """``share`` of the accelerator's memory (the machine's RAM on the CPU) less
    ``weights_bytes`` (at least a quarter of it)."""
    memory = memory_bytes(mx)
    return int(max(memory - weights_bytes, memory // 4) * share)


def default_kv_budget(mx, weights_bytes: int = 0) -> int:
    """``KV_BUDGET_SHARE`` of the memory the weights leave (``_share_beside_weights``)."""
    return _share_beside_weights(mx, weights_bytes, KV_BUDGET_SHARE)


# The prompt cache's default byte limit, a share of the memory the weights leave, shared
# with the running sequences (the cache gives way to the batch's KV caches: it holds at
# most this share less what the batch holds). With the batch at most KV_BUDGET_SHARE
# and its copy as long again at most, the KV caches stay within 0.45 + 0.35 = 80 % of
# that memory; the rest holds MLX's freed buffers and the steps' activations. With only an
# entry count (ten), sixteen agent sessions of 24k tokens on an 80 GB H100 could hold
# the batch, its copy and ten 2.9 GB entries at once, and ran out of memory, after
# which CUDA's state was broken (an illegal memory access in the next step).
PROMPT_CACHE_BUDGET_SHARE = 0.45


def default_prompt_cache_budget(mx, weights_bytes: int = 0) -> int:
    """``PROMPT_CACHE_BUDGET_SHARE`` of the memory the weights leave
    (``_share_beside_weights``)."""
    return _share_beside_weights(mx, weights_bytes, PROMPT_CACHE_BUDGET_SHARE)


def weights_bytes(model) -> int:
    """The bytes of ``model``'s parameters."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
