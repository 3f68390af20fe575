"""The engine's ``BatchGenerator``: mlx-lm's, with the behaviours the server adds
to its steps.

Owns ``EngineBatchGenerator``, which ``runtime.batch_sampling.make_batch_generator``
builds: a prompt batch that steps aside for short prompts
(``runtime.short_prompts_first``) and steps whose prefill chunk goes before their
decode where that saves a forward pass (``ChunkGoesFirst``), or that only decode,
carrying the later layers of the last step's chunk (``runtime.mixed_step``'s
``ChunkInFlight``). Receives and emits what mlx-lm's generator does.
"""

from __future__ import annotations

import time

from runtime.batch_layers import room_made
from runtime.decode_lanes import decoding_batch
from runtime.mixed_step import MixedStepModel, chunk_tail_padding, on_ladder
from runtime.mlx_lm_prefill import coming_prefill, coming_split, joiners, lone_prompt
from runtime.short_prompts_first import ShortFirstGenerator
from runtime.vacant_rows import vacant_count


class ChunkGoesFirst:
    """A ``BatchGenerator`` mixin: a step that begins with no decode step computed ahead
    runs its prompt part first, so that its chunk shares its pass with *this* step's
    decode, which then runs no pass of its own.

    mlx-lm's step decodes, then prefills a chunk, which shares its pass with the next
    step's decode (``MixedStepModel``). So a prompt's first chunk came in a step that
    also ran a decode pass of its own, and the step after its last chunk ran none:
    the first step of every prefill beside streams was its longest (on the CPU, with
    sixteen rows beside a 6k prompt, 1.3-1.9x the steps after it), and its excess
    was a whole decode pass. Taken first, the chunk's pass is the step's only one;
    every step until the prompt leaves for decoding then begins with nothing ahead
    and takes its chunk first, and the step after the last chunk runs its decode as
    any decode step does (beside the new row's first, as before).

    Only in a step that moves no prompt into decoding (``coming_split``): a row that
    joined the generation batch before its decode would change the inputs the
    chunk's pass decoded for; and only for a chunk that will share its pass (on the
    ladder, or padded onto it). A chunk of its own pass keeps mlx-lm's order, its
    decode first: taken first, such chunks (agents' later turns) left four agent
    sessions on the CPU 0.87x the tokens/s of mlx-lm's order.

    A lone prompt's chunk taken first may spread its layers over steps
    (``runtime.mixed_step.ChunkInFlight``, ``--prefill-chunk-parts``): the steps
    after it only decode, their pass carrying its next parts (``_decode_carrying``),
    and nothing joins, leaves or prefills meanwhile."""

    def _next(self):
        mixer = self._prompt_batch.model
        if isinstance(mixer, MixedStepModel) and mixer.chunk_in_flight:
            return [], self._decode_carrying(mixer)
        if not self._chunk_goes_first():
            return super()._next()
        generation = self._generation_batch
        generation.next = list  # mlx-lm's step runs its prompt part only
        mixer.may_split = mixer.chunk_parts > 1 and self._chunk_may_split()
        try:
            prompt_responses, _ = super()._next()
        finally:
            del generation.next
            mixer.may_split = False
        return prompt_responses, self._decode()  # reads the logits of the chunk's pass

    def chunk_in_flight(self) -> int:
        """Prompt tokens of a chunk whose later layers the next step runs (0: none):
        that step only decodes, its pass carrying them."""
        mixer = self._prompt_batch.model
        return mixer.chunk_in_flight if isinstance(mixer, MixedStepModel) else 0

    def _decode(self) -> list:
        began = time.perf_counter()
        generation_responses = self._generation_batch.next()
        self._counters.decode_time += time.perf_counter() - began
        self._counters.generation_tokens += len(generation_responses)
        return generation_responses

    def _decode_carrying(self, mixer: MixedStepModel) -> list:
        """A step that decodes only, its pass carrying the next part of the chunk in
        flight; where no pass took it (nothing left to decode in the first lane), the
        chunk's rest runs on its own."""
        carried = mixer.in_flight
        responses = self._decode() if len(self._generation_batch) else []
        if mixer.in_flight is carried:
            mixer.settle()
        return responses

    def _chunk_may_split(self) -> bool:
        """Whether this step's chunk may spread its layers over steps: a lone prompt's
        (one already in the batch, or one joining an empty one: its first chunk then
        spreads the allocation of its room too), its batch in place, and not the chunk
        that ends its segment. At a segment's end the engine stores the prompt's KV
        right after the step (or the prompt leaves for decoding), which runs a chunk's
        rest on its own first (``MixedStepModel.settle``): a second pass, uncompiled,
        in the same step, where one shared pass of the whole chunk costs less."""
        if getattr(self, "stepped_aside", False):
            return False
        if len(self._currently_processing) + len(joiners(self)) != 1:
            return False
        lone = lone_prompt(self)
        # The last segment's last token is the first decode step's input, not prefilled.
        return lone is None or coming_prefill(self).tokens < lone.segment - 1

    def _chunk_goes_first(self) -> bool:
        mixer = self._prompt_batch.model
        if not isinstance(mixer, MixedStepModel) or not mixer.enabled or mixer.pending:
            return False
        generation = decoding_batch(self)
        if not generation.uids or generation._next_tokens is None:
            return False
        if coming_split(self):
            return False
        coming = coming_prefill(self)
        if not coming.prompts:  # none, or the decoding rows fill the batch
            return False
        tokens = coming.tokens // coming.prompts  # mlx-lm pads a chunk's rows to its longest
        if on_ladder(tokens):
            return True
        # A lone member's odd-sized chunk, padded where its cache has room (not a prompt
        # that joins in this step: its cache is made in the step).
        return not joiners(self) and chunk_tail_padding(
            coming.prompts, tokens, self._prompt_batch.prompt_cache) > 0


class EngineBatchGenerator(ChunkGoesFirst, ShortFirstGenerator):
    """mlx-lm's ``BatchGenerator`` with short prompts first and chunks first."""

    def _next(self):
        # A large decoding batch grows before the step's pass, a layer at a time, not
        # in it (runtime.batch_layers).
        generation = self._generation_batch
        for lane in getattr(generation, "lanes", (generation,)):
            room_made(lane.prompt_cache, 1)
        return super()._next()

    @property
    def completion_batch_size(self) -> int:
        """The most rows that decode together, vacant rows (``runtime.vacant_rows``) not
        counted: they wait for a joining row, and must not hold its prompt back."""
        return self._completion_batch_size + vacant_count(
            getattr(self, "_generation_batch", None))

    @completion_batch_size.setter
    def completion_batch_size(self, rows: int) -> None:
        self._completion_batch_size = rows
