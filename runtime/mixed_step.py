"""One forward pass for a step's decoding rows and its prefill chunk.

Owns ``MixedStepModel``, which ``install_mixed_steps`` puts in place of the model
in a ``BatchGenerator``'s two lasting batches (its prompt batch and its
generation batch), and ``ChunkInFlight``, a chunk whose layers are spread over
steps. It receives the batches' model calls and emits nothing: it returns their
logits. The generator's step order that goes with it (a chunk first where no
decode ran ahead, a step that only carries a chunk's later layers) is
``runtime.engine_generator.ChunkGoesFirst``.

Why: mlx-lm's ``BatchGenerator`` runs a step as two forward passes, the decoding
rows' and then the prompt batch's chunk, and at a small batch each pass is
bound by the host building and launching its several hundred operations. On an
H200 a step of 16 decoding rows and a 64-token chunk took 33-42 ms with no
prefill attention at all, against 13 ms for the decode alone
(docs/performance.md, "what a paced prefill step costs"): the streams wait
2.5-3x their usual gap between tokens while a long prompt is prefilled, before
any attention is counted. vLLM and Sarathi-Serve run both in one pass.

How: when the prompt batch calls the model on a chunk (``prompt``, after the
step's decode), this runs one pass over the chunk together with the generation
batch's *next* decode step: its inputs (the tokens just sampled) are known by
then. Each decoder layer's norm, projections and MLP run once over all the
tokens (``runtime.compiled_decode``'s mixed pair: two compiled functions per
layer, the decoding rows and the chunk concatenated); RoPE, the KV-cache update
and the attention run per part on its own cache. The decoding rows' logits are
kept (``pending``) and returned when the generation batch's next ``_step`` calls
the model for exactly those inputs: the next step's decode costs no pass of its
own. Where a step begins with no such logits waiting (a prefill's first step, and
every step after it until a prompt leaves for decoding), ``ChunkGoesFirst`` runs the
step's prompt part before its decode, and the chunk's pass decodes for *this* step
instead. Nothing else reads the batch between the two, except removals (an abort):
``rows_kept`` keeps the pending logits' rows in step, and a row extracted
meanwhile drops the token its cache already holds (``trim_pending``).

With ``chunk_parts`` above 1 (``--prefill-chunk-parts``), a lone prompt's chunk
may spread its layers over that many steps: its pass runs the first part of the
layers and keeps the chunk's hidden state (``ChunkInFlight``), and the next steps
only decode, each decode pass carrying the next part (``_next_part``). At a long
context on a GPU a paced step's prefill part costs about the same whatever the
chunk's length, so a shorter chunk cannot shorten it below the floor's; a part of
the layers does: without CUDA graphs a step costs about the kernels it launches,
so half the layers cost about half (under CUDA graphs much of it is paid per step:
docs/performance.md). Whatever
reads or changes the prompt batch's caches before the chunk is whole runs its
rest on its own first (``settle``); so the chunk that ends its segment, whose KV
is stored right after its step, is not spread (``runtime.engine_generator``).

Taken only where the pieces are known: mlx-lm's llama (no sliding-window layers)
/ qwen2 / qwen3 / qwen3_moe models in one process, every layer on the compiled
decode path, every cache layer a plain ``BatchKVCache``, and a chunk whose length
is on the pacer's ladder (``on_ladder``: 64 times a power of two, so that the
compiled functions meet few shapes), or a lone prompt's chunk that fewer than 64
tokens pad onto it (``tail_padding``: its segment's odd-sized last chunk, which as
a second pass was the slowest step of a long prefill). Anything else runs as mlx-lm
runs it. A
mixed trace that fails turns mixing off for good, with a warning, before any
cache is touched.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

from runtime.cuda_attention import chunk_attention
from runtime.cuda_decode_attention import decode_attention
from runtime.decode_lanes import decoding_batch

log = logging.getLogger(__name__)

CHUNK_PASSES = ("shared", "separate")
LADDER_FLOOR = 64  # the shortest chunk a mixed pass takes; the pacer's floor


def on_ladder(length: int, floor: int = LADDER_FLOOR) -> bool:
    """Whether ``length`` is ``floor`` times a power of two."""
    if length < floor or length % floor:
        return False
    steps = length // floor
    return steps & (steps - 1) == 0


def paced_chunk_lengths(paced_step_tokens: int, prefill_step_size: int) -> list[int]:
    """The ladder's lengths a paced chunk beside decoding rows can take: from the floor up
    to ``paced_step_tokens`` (0: no bound of its own), and no longer than a full chunk of
    ``prefill_step_size`` tokens."""
    bound = min(paced_step_tokens or prefill_step_size, prefill_step_size)
    lengths, length = [], LADDER_FLOOR
    while length <= bound:
        lengths.append(length)
        length *= 2
    return lengths


def trace_paced_shapes(model: Any, decode_concurrency: int, paced_step_tokens: int,
                       prefill_step_size: int) -> int:
    """At load, the mixed pass traced and run once for every batch size up to
    ``decode_concurrency`` beside each paced chunk length (``paced_chunk_lengths``,
    ``runtime.compiled_decode.trace_mixed_shapes``): a row joining the streams beside a
    paced prefill would otherwise meet a new shape mid-stream. Logs and returns the
    number of runs."""
    from runtime.compiled_decode import trace_mixed_shapes

    started = time.perf_counter()
    lengths = paced_chunk_lengths(paced_step_tokens, prefill_step_size)
    traces = trace_mixed_shapes(model, range(1, decode_concurrency + 1), lengths)
    log.info("a step's decode and a paced chunk of %s tokens traced for batch sizes 1-%d "
             "(%d traces, %.2f s)", "/".join(map(str, lengths)), decode_concurrency, traces,
             time.perf_counter() - started)
    return traces


def tail_padding(inputs: Any, cache: list) -> int:
    """Tokens that pad a lone prompt's chunk off the ladder (its segment's last, odd-sized
    one) up to the ladder's next length, so that it shares a pass too; 0 where the chunk is
    on the ladder, of several prompts, would take ``LADDER_FLOOR`` tokens of padding or
    more (computing them would cost more than the second pass saved: a 700-token agent
    turn would take 324), or its cache has no room for the padding's keys without growing
    (``runtime.mlx_lm_batches`` reserves a lone prompt's room; a grow would copy the
    whole cache). The padding's keys are written past the cache's end and taken back
    after the pass (``_idx``, ``offset``); the chunk's own queries never see them
    (causal), and the next tokens overwrite them."""
    return 0 if inputs.ndim != 2 else chunk_tail_padding(*inputs.shape, cache)


def chunk_tail_padding(rows: int, tokens: int, cache: list) -> int:
    """``tail_padding`` of a chunk of ``rows`` prompts of ``tokens`` each."""
    from mlx_lm.models.cache import BatchKVCache

    if rows != 1 or on_ladder(tokens):
        return 0
    length = LADDER_FLOOR
    while length < tokens:
        length *= 2
    if length - tokens >= LADDER_FLOOR:
        return 0
    for layer in cache:
        if (type(layer) is not BatchKVCache or layer.keys is None
                or layer._idx + length > layer.keys.shape[2]):
            return 0
    return length - tokens


class ChunkInFlight(NamedTuple):
    """A prefill chunk whose first layers have run and whose others wait for the
    next step's pass: its tokens (prompts, length, padding included), the prompt
    batch's cache layers, its hidden state (tokens, width), the first layer still to
    run, the padding tokens each layer takes back after its part (``tail_padding``)
    and the size a layer that has no room yet grows by (the lone prompt's whole room,
    ``runtime.mlx_lm_batches``' ``_room_reserved``; None: every layer has room)."""

    tokens: Any
    cache: list
    hidden: Any
    layer: int
    padding: int = 0
    room: int | None = None

    def run_part(self, stop: int, run: Any) -> Any:
        """``run()`` for the layers from ``layer`` to ``stop``: those without room grow by
        the prompt's room, and take the padding's keys back after it."""
        part = self.cache[self.layer:stop]
        if self.room is not None:
            for c in part:
                c.step = self.room
        try:
            return run()
        finally:
            for c in part:
                if self.room is not None:
                    del c.step
                if self.padding:  # the padding's keys: past _idx, unread
                    c._idx -= self.padding
                    c.offset = c.offset - self.padding


def _mixable_model(model: Any) -> bool:
    from mlx_lm.models import llama, qwen2, qwen3, qwen3_moe

    if type(model) not in (llama.Model, qwen2.Model, qwen3.Model, qwen3_moe.Model):
        return False
    inner = model.model
    if getattr(inner, "swa_idx", None) is not None or getattr(inner, "pipeline_size", 1) != 1:
        return False
    layers = list(inner.layers)
    return bool(layers) and all(
        getattr(layer, "_compiled_decode", None) is not None for layer in layers
    )


class MixedStepModel:
    """The model as a ``BatchGenerator``'s batches call it, with a step's decode and
    its prefill chunk run as one pass where it can (see the module's docstring).

    ``generator``: the ``BatchGenerator`` whose ``_prompt_batch`` and generation batch
    (each of its decode lanes, ``runtime.decode_lanes``) call this; a chunk shares its
    pass with the first lane. Every other attribute is the model's."""

    def __init__(self, model: Any, generator: Any, chunk_parts: int = 1):
        self.model = model
        self._generator = generator
        self.enabled = _mixable_model(model)
        self._pending: tuple[Any, Any] | None = None  # (the decode inputs, their logits)
        self._traced: set[tuple] = set()
        self.mixed_passes = 0  # how many steps shared one pass (for tests and the log)
        # A chunk's layers spread over this many steps (``ChunkInFlight``); set by
        # ``ChunkGoesFirst`` for the one call that may start such a chunk.
        self.chunk_parts = max(1, chunk_parts)
        self.may_split = False
        self._in_flight: ChunkInFlight | None = None

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.model, name)

    @property
    def pending(self) -> bool:
        """Whether the generation batch's next decode step has run already."""
        return self._pending is not None

    @property
    def in_flight(self) -> ChunkInFlight | None:
        return self._in_flight

    @property
    def chunk_in_flight(self) -> int:
        """Prompt tokens of a chunk whose later layers are still to run (0: none)."""
        return 0 if self._in_flight is None else self._in_flight.tokens.size

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        generation = decoding_batch(self._generator)
        if self._pending is not None and cache is generation.prompt_cache:
            tokens, logits = self._pending
            if generation._current_tokens is not tokens:
                raise RuntimeError("a mixed step's decode inputs changed before its step")
            self._pending = None
            return logits
        if self._in_flight is not None and cache is generation.prompt_cache and not kwargs:
            return self._next_part(generation)
        self.settle()  # any other call reads caches that a chunk in flight must have filled
        if (
            self.enabled
            and not kwargs
            and self._pending is None
            and cache is self._generator._prompt_batch.prompt_cache
        ):
            padding = tail_padding(inputs, cache)
            if self._mixable(inputs, generation, padding):
                self._share_pass(generation, inputs, cache, padding)
                return None  # a prompt chunk's output is not used
        return self.model(inputs, cache=cache, **kwargs)

    def _share_pass(self, generation: Any, inputs: Any, cache: list, padding: int) -> None:
        """Prefill ``inputs`` into the prompt batch's ``cache`` in one pass with the
        generation batch's next decode step, whose logits wait in ``_pending``;
        ``padding`` tokens (``tail_padding``) pad the chunk for the pass and are taken
        back from the cache after it. Where the chunk may spread over steps, the pass
        runs its first part of the layers and leaves the rest in flight."""
        chunk = inputs
        if padding:
            import mlx.core as mx

            chunk = mx.concatenate([inputs, mx.zeros((1, padding), inputs.dtype)], axis=1)
        flight = ChunkInFlight(chunk, cache, None, 0, padding, cache[0].__dict__.get("step"))
        stop = self._first_part_end(flight)
        # Inside the prompt batch's call the room is reserved already.
        logits, hidden = flight._replace(room=None).run_part(
            stop or len(cache), lambda: self._forward(generation, cache, chunk, stop=stop))
        if hidden is not None:
            self._in_flight = flight._replace(hidden=hidden, layer=stop)
        self._pending = (generation._next_tokens, logits)
        self.mixed_passes += 1

    def _first_part_end(self, flight: ChunkInFlight) -> int | None:
        """The layer a chunk's first part stops before, where its layers are spread over
        steps (None: all in this pass): a lone prompt's chunk, in a step that
        ``ChunkGoesFirst`` allowed it, whose every layer has room for its keys or grows
        by the prompt's whole room (a layer that grew by mlx-lm's step outside the
        prompt batch's call would copy the whole cache every few chunks)."""
        layers = len(flight.cache)
        part = -(-layers // self.chunk_parts)
        if self.chunk_parts < 2 or not self.may_split or flight.tokens.shape[0] != 1 \
                or part >= layers:
            return None
        if flight.room is None:
            length = flight.tokens.shape[1]
            for layer in flight.cache:
                if layer.keys is None or layer._idx + length > layer.keys.shape[2]:
                    return None
        return part

    def _next_part(self, generation: Any) -> Any:
        """The generation batch's decode step, in one pass with the next part of the
        chunk in flight; its logits."""
        import mlx.core as mx

        flight = self._in_flight
        layers = len(flight.cache)
        stop = min(layers, flight.layer + -(-layers // self.chunk_parts))
        logits, hidden = flight.run_part(stop, lambda: self._forward(
            generation, flight.cache, flight.tokens, start=flight.layer, stop=stop,
            hidden=flight.hidden))
        # The part's keys and values, as mlx-lm's ``prompt`` evaluates a chunk's.
        mx.async_eval([c.state for c in flight.cache[flight.layer:stop]])
        self._in_flight = None if hidden is None else flight._replace(hidden=hidden, layer=stop)
        self.mixed_passes += 1
        return logits

    def settle(self) -> None:
        """Run the rest of a chunk in flight on its own, so that every layer of the
        prompt batch holds it: before anything reads or changes that batch's caches
        between steps (an abort, an extraction), or where no decode step comes to carry
        it."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        import mlx.core as mx
        from mlx_lm.models.base import create_attention_mask

        def rest():
            x = flight.hidden.reshape(*flight.tokens.shape, -1)
            mask = create_attention_mask(x, flight.cache[flight.layer])
            for layer, cache in zip(self.model.model.layers[flight.layer:],
                                    flight.cache[flight.layer:], strict=True):
                x = layer(x, mask, cache=cache)

        flight.run_part(len(flight.cache), rest)
        mx.eval([c.state for c in flight.cache])

    def rows_kept(self, batch: Any, keep: list[int], next_tokens: Any) -> None:
        """``batch`` kept ``keep`` of its rows (``filter``), its next inputs now
        ``next_tokens``: where it is the generation batch, the pending logits follow."""
        if self._pending is None or batch is not decoding_batch(self._generator):
            return
        if not keep:
            self._pending = None
            return
        import mlx.core as mx

        self._pending = (next_tokens, self._pending[1][mx.array(keep)])

    def trim_pending(self, batch: Any, caches: list) -> list:
        """A row's cache extracted from ``batch`` (``extract_cache``) as of its tokens:
        from the generation batch, without the token a pending decode step has
        already written."""
        if self._pending is not None and batch is decoding_batch(self._generator):
            import mlx.core as mx

            for layer in caches:  # KVCache: every layer of a mixing batch is a BatchKVCache
                layer.offset -= 1
                layer.keys = mx.contiguous(layer.keys[..., : layer.offset, :])
                layer.values = mx.contiguous(layer.values[..., : layer.offset, :])
        return caches

    # ------------------------------------------------------------------ the pass

    def _mixable(self, inputs: Any, generation: Any, padding: int = 0) -> bool:
        from mlx_lm.models.cache import BatchKVCache

        if inputs.ndim != 2 or not on_ladder(inputs.shape[1] + padding):
            return False
        if not generation.uids or generation._next_tokens is None:
            return False
        caches = list(generation.prompt_cache) + list(self._generator._prompt_batch.prompt_cache)
        if not all(type(c) is BatchKVCache for c in caches):
            return False
        layers = self.model.model.layers
        if any(layer._compiled_decode.broken for layer in layers):
            return False
        return self._trace(len(generation.uids), (inputs.shape[0], inputs.shape[1] + padding))

    def _trace(self, rows: int, chunk_shape: tuple) -> bool:
        """Trace the layers' mixed pair for this shape before any cache is touched;
        a failure turns mixing off."""
        import mlx.core as mx

        key = (rows, *chunk_shape)
        if key in self._traced:
            return True
        try:
            for layer in _layouts(self.model.model.layers):
                pair, weights = layer._compiled_decode, layer._compiled_weights
                width = layer.input_layernorm.weight
                tokens = rows + chunk_shape[0] * chunk_shape[1]
                x = mx.zeros((tokens, width.shape[0]), dtype=width.dtype)
                offsets = (mx.zeros((rows,), dtype=mx.int32),
                           mx.zeros((chunk_shape[0],), dtype=mx.int32))
                parts = pair.mixed_before_cache(x, *offsets, *weights)
                pair.mixed_after_attention(x, parts[0], parts[3], *weights)
        except Exception as exc:
            log.warning("one pass for a step's decode and prefill chunk failed to trace "
                        "(%s: %s); they run as two passes from now on", type(exc).__name__, exc)
            self.enabled = False
            return False
        self._traced.add(key)
        return True

    def _forward(self, generation: Any, chunk_cache: list, chunk_tokens: Any, *,
                 start: int = 0, stop: int | None = None, hidden: Any = None
                 ) -> tuple[Any, Any]:
        """The decoding rows' logits (rows, 1, vocabulary) for ``generation``'s next
        inputs, with the prefill chunk ``chunk_tokens`` run through its layers
        ``start`` to ``stop`` (all: None) into ``chunk_cache`` in the same pass; from a
        later layer than the first, its ``hidden`` state is the previous part's output.
        Returns the logits and the chunk's hidden state after ``stop`` (None once its
        last layer has run)."""
        import mlx.core as mx
        from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

        model = self.model
        inner = model.model
        layers = inner.layers
        stop = len(layers) if stop is None else stop
        decode_cache = generation.prompt_cache
        rows = len(generation.uids)
        # Every token of the pass in one array (the decoding rows', then the chunk's):
        # the layers' shared pieces take and give it so, with no copy between layers.
        # Outside the chunk's layers the decoding rows run alone, as a decode step does.
        if start == 0:
            x = inner.embed_tokens(mx.concatenate([generation._next_tokens,
                                                   chunk_tokens.reshape(-1)]))
        else:
            x = inner.embed_tokens(generation._next_tokens)[:, None]
        decode_mask = create_attention_mask(x[:rows, None] if start == 0 else x,
                                            decode_cache[0])
        last = len(layers) - 1
        rest = None  # the chunk's state after this part, where layers are left
        for i, (layer, ours, theirs) in enumerate(
                zip(layers, decode_cache, chunk_cache, strict=True)):
            if not start <= i < stop:
                x = layer(x, decode_mask, cache=ours)
                continue
            if i == start:
                if start:
                    x = mx.concatenate([x.reshape(rows, -1), hidden])
                chunk_mask = create_attention_mask(chunk_tokens[..., None], theirs)
                # On CUDA, the chunk's keys read in place from its cache and one mask
                # for its layers (runtime.cuda_attention.ChunkAttention); else the
                # installed attention.
                aligned = chunk_attention(mx, theirs, length=chunk_tokens.shape[1],
                                          heads=layer.self_attn.n_heads, dtype=x.dtype)
            pair, weights = layer._compiled_decode, layer._compiled_weights
            scale = layer.self_attn.scale
            dq, dk, dv, cq, ck, cv = pair.mixed_before_cache(
                x, ours.offset, theirs.offset, *weights
            )
            dk, dv = ours.update_and_fetch(dk, dv)
            decode_attended = decode_attention(mx, dq, ours, scale=scale, mask=decode_mask)
            if decode_attended is None:
                decode_attended = scaled_dot_product_attention(
                    dq, dk, dv, cache=ours, scale=scale, mask=decode_mask
                )
            ck, cv = theirs.update_and_fetch(ck, cv)
            if i == last:  # the chunk's keys and values are all its pass is for
                x = pair.after_attention(x[:rows].reshape(rows, 1, -1), decode_attended,
                                         *weights)
                break
            chunk_attended = aligned(cq, theirs, scale=scale) if aligned else None
            if chunk_attended is None:
                chunk_attended = scaled_dot_product_attention(
                    cq, ck, cv, cache=theirs, scale=scale, mask=chunk_mask
                )
            x = pair.mixed_after_attention(x, decode_attended, chunk_attended, *weights)
            if i == stop - 1:  # the chunk's part ends: its state waits for the next one
                rest, x = x[rows:], x[:rows].reshape(rows, 1, -1)
        out = inner.norm(x)
        logits = (inner.embed_tokens.as_linear(out) if model.args.tie_word_embeddings
                  else model.lm_head(out))
        # Computed with the chunk (``prompt`` waits for its caches next): left lazy,
        # it would hold the last layer's cache buffers until the next step, and the
        # next chunk's cache update would copy them instead of writing in place.
        mx.async_eval(logits, *(() if rest is None else (rest,)))
        return logits, rest


def _layouts(layers: list) -> list:
    """One layer per compiled pair."""
    seen: dict[int, Any] = {}
    for layer in layers:
        seen.setdefault(id(layer._compiled_decode), layer)
    return list(seen.values())


def install_mixed_steps(generator: Any, chunk_parts: int = 1) -> bool:
    """Put a ``MixedStepModel`` in ``generator``'s prompt and generation batches (a new,
    empty generator, its row hooks installed), a paced chunk's layers spread over
    ``chunk_parts`` steps where it may. Returns whether its model can mix."""
    mixer = MixedStepModel(generator.model, generator, chunk_parts)
    generator._prompt_batch.model = mixer
    generator._generation_batch.model = mixer
    return mixer.enabled
