"""Every use of mlx-lm's private parts, but its batch generator's (``runtime.mlx_lm_batches``).

The rest of the code uses mlx-lm's public API only (``load``,
``BatchGenerator``, ``stream_generate``, ``LRUPromptCache``'s methods, the
tokenizer wrapper, the samplers). What we need beyond it lives here, each
piece with the reason and what it relies on; ``tests/test_mlx_lm_internals.py``
checks every one of them against the installed mlx-lm and fails naming the
attribute when an upgrade changes it (docs/upgrading-mlx-lm.md: what to do).

* ``use_prompt_trie``: puts another trie in place of ``LRUPromptCache._trie``
  (mlx-lm's ``PromptTrie``, which its ``insert_cache``, ``fetch_nearest_cache``
  and ``trim_to`` go through: ``add``, ``get``, ``pop``, ``pop_prefixes``,
  ``search``); the engine's store takes ``runtime.prompt_trie``'s radix trie.
* ``shared_prefix_length``: the longest prefix an entry shares, from that
  trie's ``shared_prefix``, or walking mlx-lm's ``PromptTrie._trie`` (the prompt
  cache's reuse floor, ``runtime.prompt_cache_store``).
* ``prompt_cache_has_entry``, ``prompt_cache_entry`` and
  ``remove_prompt_cache_entry``: one named entry of an ``LRUPromptCache``
  (``_trie``, ``_lru``, ``_n_bytes``, ``_n_bytes_by_type``): the engine applies
  the prompt-cache policy's evictions (handing an evicted entry to the disk
  tier first) and reports what mlx-lm's ``insert_cache`` dropped by itself.
* ``new_eviction_order``: ``LRUPromptCache.CacheOrder``, mlx-lm's eviction
  order (one LRU per segment type), which the prompt-cache policy decides with.
* ``keep_leading_space``: a text completion keeps its first space; sets
  ``SPMStreamingDetokenizer.trim_space`` or defeats
  ``BPEStreamingDetokenizer._maybe_trim_space`` (``actors.detokenizer``).
* ``convert_chat``: ``mlx_lm.server.convert_chat``, the prompt of a model
  without a chat template (``runtime.prompts``); a module of mlx-lm's server
  script, not of its library API.
* ``sharded_load_on_the_default_stream``: keeps the barrier at the end of
  ``mlx_lm.utils.sharded_load`` off the CPU stream on a GPU
  (``runtime.engine.loading``).
* ``keep_freed_buffers_in_generate``: the name ``mx`` in ``mlx_lm.generate``,
  overlaid so that its ``clear_cache`` after every prefill chunk does nothing
  (``--prefill-buffers keep``; ``runtime.engine.loading``).
* ``queue_evals_in_generate`` and ``evals_queued``: the same name's ``eval``, which
  queues a prefill chunk without waiting for it while sequences decode
  (``runtime.mlx_lm_batches``).
* ``filter_layers``, ``layer_paddings`` and ``joined_paddings``: ``BatchKVCache``'s
  ``filter`` for all of a batch's layers at once, and the paddings its ``extend``
  makes; its ``left_padding``, ``offset``, ``_idx``, ``keys`` and ``values``
  (``runtime.mlx_lm_batches``' batches filter, and the generation batch extends,
  with them).

The private parts of mlx-lm's ``BatchGenerator`` and its batches (row hooks,
prefill groups, the coming prefill) are the same kind of
reliance, in ``runtime.mlx_lm_batches``.

One more reliance lives beside what it serves: ``runtime.compiled_decode``
relies on the attribute layout of mlx-lm's llama / qwen2 / qwen3 / qwen3_moe decoder
layers, and ``tests/test_compiled_decode.py`` compares its tokens and logits
with mlx-lm's own layers.

Receives and emits nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

# ------------------------------------------------------------ the prompt cache


def use_prompt_trie(cache: Any, trie: Any) -> None:
    """Index an empty ``LRUPromptCache``'s entries with ``trie`` instead of mlx-lm's
    ``PromptTrie``: ``trie`` answers ``add``, ``get``, ``pop``, ``pop_prefixes`` and
    ``search`` as it does, and ``shared_prefix(model, tokens)`` and ``value(model,
    tokens)`` (the value for exactly those tokens, or None) for the lookups below.

    Relies on ``LRUPromptCache._trie`` being the one index its methods go through
    (``tests/test_mlx_lm_internals.py``)."""
    from mlx_lm.models.cache import PromptTrie

    if not isinstance(getattr(cache, "_trie", None), PromptTrie) or len(cache):
        raise ValueError("use_prompt_trie needs an empty LRUPromptCache with mlx-lm's trie")
    cache._trie = trie


def shared_prefix_length(cache: Any, model: Any, tokens: Sequence[int]) -> int | None:
    """How many leading ``tokens`` some entry of an ``LRUPromptCache`` shares with them.

    ``None`` when the cache is not laid out as this was written for (then the
    caller must not take the shortcut). With mlx-lm's trie, relies on
    ``cache._trie._trie``: a dict from model key to nested dicts keyed by token id.
    """
    shared_prefix = getattr(getattr(cache, "_trie", None), "shared_prefix", None)
    if shared_prefix is not None:
        return shared_prefix(model, tokens)
    try:
        node = cache._trie._trie.get(model)
    except AttributeError:
        return None
    shared = 0
    for tok in tokens:
        if node is None:
            break
        node = node.get(tok)
        shared += node is not None
    return shared


def _trie_node(cache: Any, model: Any, tokens: Sequence[int]) -> dict | None:
    """The node of ``cache``'s trie at the end of ``tokens`` (None: no such path)."""
    node = cache._trie._trie.get(model)
    for tok in tokens:
        if node is None:
            return None
        node = node.get(tok)
    return node


def _entry(cache: Any, model: Any, tokens: Sequence[int]) -> Any:
    """The trie's value (an ``LRUPromptCache.CacheEntry``) for exactly ``tokens``, or None.

    With mlx-lm's trie, relies on ``cache._trie._trie``: nested dicts keyed by token
    id, an entry stored under the key ``"__value__"`` of its last token's node."""
    value = getattr(cache._trie, "value", None)
    if value is not None:
        return value(model, tokens)
    node = _trie_node(cache, model, tokens)
    return None if node is None else node.get("__value__")


def prompt_cache_has_entry(cache: Any, model: Any, tokens: Sequence[int]) -> bool:
    """Whether an ``LRUPromptCache`` holds an entry for exactly ``tokens``."""
    return _entry(cache, model, tokens) is not None


def prompt_cache_entry(cache: Any, model: Any, tokens: Sequence[int]) -> tuple[list, str] | None:
    """The stored layers (no copy) and segment type of the entry for exactly ``tokens``,
    or None.

    Relies on the ``"__value__"`` of the entry's node being mlx-lm's
    ``LRUPromptCache.CacheEntry`` (its ``prompt_cache`` and ``cache_type``)."""
    entry = _entry(cache, model, tokens)
    if entry is None:
        return None
    return entry.prompt_cache, entry.cache_type


def remove_prompt_cache_entry(cache: Any, model: Any, tokens: Sequence[int]) -> int | None:
    """Remove the entry for exactly ``tokens`` from an ``LRUPromptCache``; its bytes, or
    None if there was none.

    What ``LRUPromptCache.trim_to`` does for the entry its order picks, for a
    named one: ``_trie.pop``, ``_lru.remove`` and the byte counters
    ``_n_bytes`` and ``_n_bytes_by_type``."""
    tokens = list(tokens)
    if not prompt_cache_has_entry(cache, model, tokens):
        return None
    entry = cache._trie.pop(model, tokens)
    cache._lru.remove(model, tokens)
    cache._n_bytes -= entry.nbytes
    cache._n_bytes_by_type[entry.cache_type] -= entry.nbytes
    return entry.nbytes


def new_eviction_order() -> Any:
    """mlx-lm's eviction order: ``push(model, key, cache_type)``, ``remove(model, key)``,
    ``pop() -> (model, key)``, ``len()``.

    ``LRUPromptCache.CacheOrder``: one LRU per segment type ("assistant",
    "user", "system"); ``pop`` takes from the first type's LRU that is not
    shorter than the next one's, else from the last (a nested class of
    ``LRUPromptCache``, not documented API)."""
    from mlx_lm.models.cache import LRUPromptCache

    return LRUPromptCache.CacheOrder()


# ---------------------------------------------------------------- detokenizing


def keep_leading_space(detokenizer: Any) -> None:
    """A text completion continues its prompt: its first space is text, not padding.

    mlx-lm's streaming detokenizers drop a leading space from the first token
    (right for a chat reply, wrong for a completion of "Hello," -> " world").
    The SPM detokenizer has a switch for it (``trim_space``); the byte-level BPE
    one trims in ``_maybe_trim_space`` while its ``text`` is empty, so its text
    is made non-empty with a NUL that its ``offset`` then skips: never emitted.
    """
    if hasattr(detokenizer, "trim_space"):  # SPM
        detokenizer.trim_space = False
    elif hasattr(detokenizer, "_maybe_trim_space") and not detokenizer.text:  # byte-level BPE
        detokenizer.text = "\x00"  # non-empty, so nothing is trimmed ...
        detokenizer.offset = 1  # ... and never emitted


# ----------------------------------------------------------------- prompts


def convert_chat(messages: list[dict[str, Any]], role_mapping: Mapping[str, str] | None) -> str:
    """mlx_lm.server's plain-text chat prompt (models without a chat template)."""
    from mlx_lm.server import convert_chat as mlx_lm_convert_chat

    return mlx_lm_convert_chat(messages, dict(role_mapping or {}) or None)


# ------------------------------------------------------------- distributed


@contextlib.contextmanager
def sharded_load_on_the_default_stream() -> Iterator[None]:
    """Around ``mlx_lm.utils.sharded_load``: on a GPU, its barrier on the default stream.

    ``sharded_load`` ends with ``all_sum(..., stream=mx.cpu)``. MLX's NCCL
    backend cannot run it: the CPU stream's worker thread looks for the
    caller's GPU stream and fails with "There is no Stream(gpu, N) in current
    thread" (what kills mlx_lm.server 0.32.2's NCCL mode at load). For the
    duration of the block, ``mlx_lm.utils`` (only it: the name ``mx`` in that
    module) sees an ``mx`` whose ``distributed.all_sum`` drops ``stream=mx.cpu``;
    everything else is mlx.core itself. On the CPU (ring, MPI) nothing changes.
    Call it from the thread that loads; no other thread should load meanwhile.
    """
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.gpu:
        yield
        return
    with _utils_barrier_off_the_cpu_stream():
        yield


@contextlib.contextmanager
def _utils_barrier_off_the_cpu_stream() -> Iterator[None]:
    import mlx.core as mx
    import mlx_lm.utils

    if mlx_lm.utils.mx is not mx:
        raise RuntimeError("mlx_lm.utils.mx is not mlx.core: see docs/upgrading-mlx-lm.md")
    original = mx.distributed.all_sum

    def all_sum(x, *args, stream=None, **kwargs):
        if stream == mx.cpu:
            stream = None
        return original(x, *args, stream=stream, **kwargs)

    mlx_lm.utils.mx = _Overlay(mx, distributed=_Overlay(mx.distributed, all_sum=all_sum))
    try:
        yield
    finally:
        mlx_lm.utils.mx = mx


class _Overlay:
    """An object's attributes, some of them replaced."""

    def __init__(self, target: Any, **replaced: Any):
        self._target = target
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


# ------------------------------------------------- freed buffers in prefill


def keep_freed_buffers_in_generate() -> bool:
    """Make ``mx.clear_cache()`` a no-op inside ``mlx_lm.generate`` (only there).

    mlx-lm's prompt processing empties MLX's free-buffer cache after every prefill
    chunk and again after a padded batch's last one, so every next chunk allocates
    its buffers anew: about 5 ms a call on an H200 (``bench/clear_cache_cost.py``),
    twice in most prefill steps, whether the chunk has 64 tokens or 2,048. A server
    bounds that cache instead (``runtime.mlx_environment.bound_buffer_cache``): the
    freed buffers are reused up to the bound and released past it. Call it only with
    the cache bounded. Idempotent; True once installed, False (with a warning) where
    mlx-lm's module no longer has the name to overlay.
    """
    if _overlay_generate(clear_cache=_keep_freed_buffers):
        return True
    log.warning("mlx_lm.generate no longer names mlx.core as mx: prefill clears MLX's "
                "buffer cache after every chunk (see docs/upgrading-mlx-lm.md)")
    return False


def _overlay_generate(**replaced: Any) -> bool:
    """Replace these attributes of the name ``mx`` in ``mlx_lm.generate`` (only there),
    beside any replaced before; False where the module no longer names mlx.core so."""
    import importlib

    import mlx.core as mx

    # the module (``mlx_lm.generate`` as an attribute is mlx-lm's generate function)
    generate = importlib.import_module("mlx_lm.generate")
    current = getattr(generate, "mx", None)
    if isinstance(current, _Overlay):
        current.__dict__.update(replaced)
        return True
    if current is not mx:
        return False
    generate.mx = _Overlay(mx, **replaced)
    return True


# ------------------------------------------------- prefill chunks queued


_queued_evals = threading.local()


def queue_evals_in_generate() -> bool:
    """Let ``mlx_lm.generate``'s ``mx.eval`` queue its arrays without waiting for them
    inside ``evals_queued()`` (everywhere else, and outside it, MLX's own ``eval``).

    mlx-lm's prompt step evaluates each prefill chunk's caches and waits for the
    device to finish them; while sequences decode (``runtime.mlx_lm_batches``), the
    engine queues the chunk instead and builds its next step as the device runs it:
    the decode step's own wait for its tokens bounds what is queued, and lazy
    evaluation keeps every result the same. Idempotent; False (the chunk waited for)
    where mlx-lm's module no longer names mlx.core as mx.
    """
    return _overlay_generate(eval=_eval_in_generate)


@contextlib.contextmanager
def evals_queued() -> Iterator[None]:
    """Within: ``mx.eval`` inside ``mlx_lm.generate`` queues (``queue_evals_in_generate``)."""
    before = getattr(_queued_evals, "on", False)
    _queued_evals.on = True
    try:
        yield
    finally:
        _queued_evals.on = before


def _eval_in_generate(*arrays: Any) -> None:
    """``mx.eval`` as ``mlx_lm.generate`` sees it under ``queue_evals_in_generate``."""
    import mlx.core as mx

    if getattr(_queued_evals, "on", False):
        mx.async_eval(*arrays)
    else:
        mx.eval(*arrays)


def _keep_freed_buffers() -> None:
    """``mx.clear_cache`` as ``mlx_lm.generate`` sees it under ``keep_freed_buffers_in_generate``."""


def filter_layers(caches: list, keep: list[int]) -> None:
    """Each layer's ``filter(keep)``, as mlx-lm's batches call it, without waiting for
    the device where the layers' paddings are computed already.

    mlx-lm's ``BatchKVCache.filter`` reads its new left padding back (``tolist``)
    to trim the shared padding: one wait for the device per layer, the first
    behind the step in flight (a decode step, or a decode beside a paced prefill
    chunk), every other for a kernel of its own (28 round trips on Qwen3-0.6B:
    ~20 ms of a 10 ms step on an H200, at every step where a sequence finishes
    or a prompt joins). Here the plain ``BatchKVCache`` layers' paddings are read
    as they are (made on the host as rows join: ``joined_paddings``; and the
    new ones are built on the host), and the kept rows' paddings
    are made on the host: the host builds the next step while the device still
    runs this one. Other cache types filter themselves.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    plain = [c for c in caches if type(c) is BatchKVCache]
    for c in caches:
        if type(c) is not BatchKVCache:
            c.filter(keep)
    if not plain:
        return
    mx.eval([c.left_padding for c in plain])  # no wait where they are computed already
    # Every row kept (a lone prompt's split as it starts decoding): nothing to select,
    # and no copy of the layers (a 30k-token prompt's is GBs on a GPU).
    rows = None if keep == list(range(plain[0].offset.shape[0])) else mx.array(keep)
    runs = row_runs(keep)
    for c in plain:
        padding = c.left_padding.tolist()
        kept = [padding[i] for i in keep]
        shared = min(kept)
        if c.keys is not None and shared > 0:
            # Trimmed before the rows are selected: the selection then copies the kept
            # rows into one contiguous array. Trimmed after it, the keys would be a
            # strided view, and the next step's write of its token (MLX's slice
            # update) would copy the whole batch's KV a second time.
            c.keys = c.keys[..., shared:, :]
            c.values = c.values[..., shared:, :]
        if rows is not None:
            if c.keys is not None:
                c.keys = _rows_copied(mx, c.keys, runs)
                c.values = _rows_copied(mx, c.values, runs)
            c.offset = c.offset[rows]
        if shared > 0:
            c._idx -= shared
        if rows is not None or shared > 0:
            c.left_padding = mx.array([p - shared for p in kept], dtype=c.left_padding.dtype)


def row_runs(rows: list[int]) -> list[tuple[int, int]]:
    """``rows`` as ``(start, stop)`` runs of consecutive indices, in their order."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


def _rows_copied(mx, array, runs: list[tuple[int, int]]):
    """The rows of ``array`` in ``runs``, copied into one contiguous array.

    Slices of consecutive rows, concatenated, not an index array (mlx-lm's
    ``keys[indices]``), whose gather ran at a sixth of a copy's bandwidth: a leave of 16
    rows of 12k tokens (22 GB) on an H100 took 93 ms as a gather and 14-21 ms as runs
    (untrimmed, trimmed); 16 rows of 2k on this repo's CPU 1.9 and 4.8 s against 2.2
    (bench/batch_copies.py). A lone run
    that is already a contiguous slice stays one (no copy); the rows it drops are
    freed at the batch's next copy."""
    parts = [array[start:stop] for start, stop in runs]
    return mx.contiguous(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0))


def layer_paddings(caches: list) -> list[tuple[list[int], int, bool]]:
    """Each plain ``BatchKVCache`` layer's left padding read back, its ``_idx`` and
    whether it holds keys: what ``joined_paddings`` needs of a batch before its
    ``extend``. Paddings made on the host (``filter_layers``, ``joined_paddings``, a
    new layer's) are read at once; see ``joined_paddings``."""
    from mlx_lm.models.cache import BatchKVCache

    return [(c.left_padding.tolist(), c._idx, c.keys is not None)
            for c in caches if type(c) is BatchKVCache]


def joined_paddings(caches: list, mine: list, theirs: list) -> None:
    """After mlx-lm's ``extend`` of a batch's layers (``mine``, ``theirs``: each side's
    ``layer_paddings`` before it), each plain layer's left padding made on the host
    with the values mlx-lm's concatenation has: each side's paddings shifted by what
    it was padded on the left to the longer side's ``_idx``.

    mlx-lm leaves them as a concatenation the device computes, and the next ``filter``
    or ``extract`` (a row leaving) reads them back. On CUDA, MLX copies a device
    array into host memory the first time the host reads it, and with a step in
    flight that took 0.2-0.5 ms a layer on an H100: 6-11 ms of a row's leave step on
    Qwen3-0.6B's 28 layers. Made on the host, as ``filter_layers`` makes the kept
    rows', they are read with no copy, and a generation batch keeps host paddings
    throughout. Where a side had no plain layers (an empty batch takes the other's
    list whole), nothing changes.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    plain = [c for c in caches if type(c) is BatchKVCache]
    if not mine or len(mine) != len(plain) or len(theirs) != len(plain):
        return
    for c, (first, first_idx, first_keys), (second, second_idx, second_keys) in zip(
            plain, mine, theirs, strict=True):
        if first_keys or second_keys:
            longest = max(first_idx, second_idx)
            first = [p + longest - first_idx for p in first]
            second = [p + longest - second_idx for p in second]
        c.left_padding = mx.array(first + second, dtype=c.left_padding.dtype)
