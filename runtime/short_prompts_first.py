"""Short prompts go ahead of a long prefill: the long prompt's batch steps aside.

Owns ``ShortFirstGenerator`` (mlx-lm's ``BatchGenerator`` whose prompt batch can
be set aside whole and brought back) and ``ShortPromptsFirst``, the rule the
engine core applies around each step (``before`` it, ``admit`` after the
prefill group is sized). Receives and emits nothing; it reads and sets the
generator's private prefill state, as ``runtime.mlx_lm_prefill`` does
(``runtime.mlx_lm_batches.check_internals`` checks those attributes).

Why: mlx-lm prefills one prompt batch in lockstep. A prompt that joins members
deep into their prompts is padded to their depth (its keys, and its row's
attention, 30k long beside a 30k prompt), its KV merged into a batch of two
(a copy of the long prompt's whole cache, and another when it leaves), and
the long prompt, no longer alone, loses the paths a lone prompt takes (the
causal mask, its reserved room, its padded tail: ``runtime.mlx_lm_batches``,
``runtime.mixed_step``). On an H200, beside 16 streams, a short request that
joined a 30k prefill took three steps of 38-103 ms and left the long prompt two
or three more of 47-85 ms, among paced steps of 16-36 (docs/performance.md).

How: when a short prompt (at most ``short`` tokens to prefill: a chat message,
an agent's next turn after its cached history) waits while the prompt batch
holds only longer prompts, none of them done, and either they have more than
``short`` tokens left or joining would pad the short prompt or them by more
than that (their depths apart), the batch and its members' progress are put
aside (``step_aside``: a swap of two attributes, no copy of any KV) and an
empty batch like it takes their place. The short prompts, moved
to the head of the waiting queue, are prefilled alone, as any lone prompt
would be; only they join it, and only in its first step. Once they have left
for decoding, the long batch comes back (``step_back``) as it was, and runs at
least one step before it steps aside again, so a stream of short requests
slows a long prompt to a third of its steps at worst, never stops it. A long
prompt loses two steps to each short one: the step that prefills it, and the
step where it takes its first token.

Every uid stays visible through the generator's own interface while its batch
is aside: ``extract_cache``, ``remove`` and ``prompt_cache_nbytes`` see it.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable
from typing import Any

from mlx_lm.generate import BatchGenerator

# The per-row lists of a PromptProcessingBatch, emptied in the batch that takes
# the place of one set aside.
_ROW_LISTS = ("uids", "tokens", "samplers", "logits_processors", "max_tokens", "stop_sequences")


class ShortFirstGenerator(BatchGenerator):
    """A ``BatchGenerator`` whose prompt batch can step aside for another
    (see the module's docstring)."""

    _aside: tuple[Any, list] | None = None  # (the batch set aside, its members' progress)

    @property
    def stepped_aside(self) -> bool:
        return self._aside is not None

    def step_aside(self) -> None:
        """Put the prompt batch and its members' progress aside; an empty batch of the
        same kind (its model, sampler and hooks) takes its place."""
        if self._aside is not None:
            raise RuntimeError("a prompt batch is aside already")
        lasting = self._prompt_batch
        empty = copy.copy(lasting)
        for name in _ROW_LISTS:
            setattr(empty, name, [])
        empty.prompt_cache = []
        self._aside = (lasting, self._currently_processing)
        self._prompt_batch, self._currently_processing = empty, []

    def step_back(self) -> None:
        """Bring the batch set aside back; the prompt batch in its place must be empty."""
        if self._aside is None:
            return
        if len(self._prompt_batch):
            raise RuntimeError("the prompt batch in place still holds prompts")
        self._prompt_batch, self._currently_processing = self._aside
        self._aside = None

    def _aside_rows(self, uids) -> list[int]:
        if self._aside is None:
            return []
        wanted = set(uids)
        return [i for i, uid in enumerate(self._aside[0].uids) if uid in wanted]

    def extract_cache(self, uids):
        results = super().extract_cache(uids)
        for i in self._aside_rows(uids):
            batch = self._aside[0]
            results[batch.uids[i]] = (batch.extract_cache(i), batch.tokens[i])
        return results

    def remove(self, uids, return_prompt_caches=False):
        caches = self.extract_cache(uids) if return_prompt_caches else {}
        rows = self._aside_rows(uids)
        if rows:
            batch, processing = self._aside
            keep = [i for i in range(len(batch.uids)) if i not in rows]
            if keep:
                batch.filter(keep)
                self._aside = (batch, [processing[i] for i in keep])
            else:  # nothing left to come back
                self._aside = None
        super().remove(uids)
        return caches

    @property
    def prompt_cache_nbytes(self):
        total = super().prompt_cache_nbytes
        if self._aside is not None:
            total += sum(c.nbytes for c in self._aside[0].prompt_cache)
        return total


def _to_prefill(segments) -> int:
    """A prompt's tokens still to prefill (its last token, the first decode step's
    input, not counted)."""
    return sum(len(s) for s in segments) - 1


def _cached(sequence) -> int:
    """A waiting sequence's cached prefix (its caches' offset)."""
    caches = sequence[3]
    return int(getattr(caches[0], "offset", 0)) if caches else 0


class ShortPromptsFirst:
    """When a ``ShortFirstGenerator``'s prompt batch steps aside and comes back
    (``short``: the most tokens to prefill that make a prompt short)."""

    def __init__(self, short: int):
        self.short = short
        self._first_aside_step = False  # the step that set the batch aside is coming
        self._just_back = False  # the batch came back before this step: it runs it
        self.stepped_aside = 0  # how many times a batch stepped aside (tests, the log)

    def before(self, generator: Any) -> bool:
        """Before a step (and its group sizing): bring the batch set aside back once
        the short prompts have left, or set it aside for the short ones waiting.
        Returns whether the step runs with a batch aside (the short prompts' step)."""
        if not isinstance(generator, ShortFirstGenerator):
            return False
        in_flight = getattr(generator, "chunk_in_flight", None)  # runtime.mixed_step
        if not generator.stepped_aside and in_flight is not None and in_flight():
            return False  # the step carries a chunk's later layers; the short ones next
        if generator.stepped_aside:
            self._first_aside_step = False
            if not generator._prompt_batch.uids:
                generator.step_back()
                self._just_back = True
            return generator.stepped_aside
        self._just_back = False  # the step it came back in was its own
        if not self._short_ones_wait(generator):
            return False
        waiting = generator._unprocessed_sequences
        shorts = [s for s in waiting if _to_prefill(s[1]) <= self.short]
        generator._unprocessed_sequences = deque(
            shorts + [s for s in waiting if _to_prefill(s[1]) > self.short])
        generator.step_aside()
        self._first_aside_step = True
        self.stepped_aside += 1
        return True

    def admit(self, generator: Any) -> None:
        """After the step's group is sized: while a batch is aside, only short prompts
        join the one in its place, and only in the step that set it aside; in the step
        it comes back, none joins it (a short one waiting steps aside the next)."""
        if not isinstance(generator, ShortFirstGenerator):
            return
        if not generator.stepped_aside and not self._just_back:
            return
        joining = 0
        if self._first_aside_step and generator.stepped_aside:
            for sequence in generator._unprocessed_sequences:
                if _to_prefill(sequence[1]) > self.short:
                    break
                joining += 1
        members = len(generator._prompt_batch)
        generator.prefill_batch_size = min(generator.prefill_batch_size, members + joining)

    def sizing(self, prefill_group: Callable[[Any], Any] | None) -> Callable[[Any], None]:
        """The engine's group sizing: ``prefill_group(generator)`` (None: mlx-lm's
        ``prefill_batch_size``), then ``admit``."""
        fixed: dict[str, int] = {}

        def size(generator: Any) -> None:
            if prefill_group is not None:
                prefill_group(generator)
            else:  # mlx-lm's own size, which ``admit`` may have lowered for a step
                base = fixed.setdefault("base", generator.prefill_batch_size)
                generator.prefill_batch_size = base
            self.admit(generator)

        return size

    def _short_ones_wait(self, generator: Any) -> bool:
        members = generator._currently_processing
        if not members or len(generator._generation_batch) >= generator.completion_batch_size:
            return False
        # Every member a long prompt still prefilling (``[segments left, done, total]``):
        # a short member is done after this step, and the waiting ones join the next
        # group; a done member leaves for decoding in this step.
        if any(m[2] - 1 <= self.short or _to_prefill(m[0]) <= 0 for m in members):
            return False
        shorts = [s for s in generator._unprocessed_sequences if _to_prefill(s[1]) <= self.short]
        if not shorts:
            return False
        # Members about to finish, and short prompts that would join them at about their
        # depth (followers of a system prompt their leader just stored): joining pads
        # nothing much (mlx-lm pads the shallower rows, either side, to the deepest),
        # and setting the batch aside would only hold its first token back.
        layers = generator._prompt_batch.prompt_cache
        depth = int(getattr(layers[0], "_idx", 0) or 0) if layers else 0
        return any(_to_prefill(m[0]) > self.short for m in members) or any(
            abs(depth - _cached(s)) > self.short for s in shorts)
