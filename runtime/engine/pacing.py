"""How many prompt tokens a step prefills while other sequences decode.

mlx-lm's ``BatchGenerator`` runs, in one ``next()``, a decode step for the
sequences that are generating and then one prefill chunk of up to
``prefill_step_size`` tokens for each prompt being processed (right-padded to
the longest). With a long prompt arriving while others stream, every such
step holds their next token back for the whole chunk: 2,048 tokens of an 8B
model's prefill are many decode steps long. As vLLM's token budget and
Sarathi-Serve do, ``PrefillPacer`` sizes the chunk so that a step's prefill
takes about ``factor`` times a decode step: the decoding sequences' time
between tokens stays within about ``1 + factor`` of a decode step during any
prefill, and the prompt is still prefilled as fast as that allows. With
fewer sequences decoding than prompts prefilling (nothing decoding, or the
first of a wave of new prompts already past its prefill), chunks are mlx-lm's
full ``prefill_step_size``: holding many prompts back to smooth few streams
costs more waiting than it saves.

It learns both times from the steps it sees: the median wall time of the last
steps that only decode (the streams' gaps are judged against their median), and a
prefill's cost as a fixed part per step plus a part per (padded)
prompt token, less the step's decode part (a line through the recent steps,
fitted by medians: the time per token grows with the context, and single steps
run several times long). The fixed part matters: a chunk is what the budget
leaves after it, and where the fixed part alone fills the budget (a long context
on a GPU: 20 ms at the start of a 30k-token prompt and 80-98 ms at its end, for
64 tokens of the Qwen3-0.6B shape on an H200 beside a 9.5 ms decode step of 16
rows) chunks stay at the floor, the shortest stall there is; a larger ``factor``
buys a faster prefill with longer gaps. While the steps seen so far all had one
size (the line cannot be told from a proportion), the next chunk takes half that
size, which gives the fit its second point without a longer stall (twice the
floor at the floor, where most of a step's cost is its fixed part, unless the
floor's steps alone outgrow the budget: then no larger chunk fits). With
``ladder``, a paced chunk is the floor times a power of two (64, 128, 256, ...):
where a step's decode and its chunk share one compiled pass
(``runtime.mixed_step``), each new length is a new trace, and a short prompt
that joins a long one is covered by the next multiple of the floor, which the
long one's chunk then is. A segment's odd tokens (beyond a multiple of the
floor) go in its last step: taken first, they would leave every later chunk's
keys at a length that is no multiple of 64, and the attention's matrix products
at such lengths made an H200's paced steps at 10k-20k tokens of context 2-2.5x
as long. Sans-IO: ``observe`` after each step, ``chunk`` before the next; the
generator is read and set through ``runtime.mlx_lm_prefill``.

However cheap the line says tokens are, a paced step takes at most
``PACED_STEP_TOKENS`` prompt tokens, its prompts' chunks together (Sarathi-Serve's
token budget): on a GPU a small model's paced step costs about the same from 64 to 256
tokens, the line sees no slope, and each doubling past that met a cost the line did
not foresee (a new shape, attention off its fast path), the streams' longest gaps.

A prompt whose whole prefill is short (at most ``SHORT_PROMPT`` tokens not
cached: a coding agent's next turn, a chat message) goes in one step: its
first token matters more than the one longer gap it costs the others, and it
is not held behind a long prompt's paced chunks.

A lone prompt's full chunk is cut to end on the grid of full chunks where its
prefix is off it (``aligned_chunk``, with ``PacedSteps``' ``lone`` reader): a
prompt that was paced for a while, or one after a cached prefix or a segment's end,
would otherwise meet every later full chunk at a new shape. On CUDA a full chunk
whose prefix is a whole number of chunks goes to cuDNN under the causal mask, its
graph built once for every prompt (``runtime.mlx_environment``); off the grid it
goes to the grouped products, which cost 5-7x as much at 20k-30k tokens of context
(an H100's steps of a cold 32k prompt after a paced start: 240 ms against 37).

With ``floor_slack`` (``--prefill-floor-slack``), where the floor's steps alone
outgrow the budget, the chunk is chosen by what each size on the ladder has
cost lately instead: the longest whose steps took at most that many times the
floor's. At 8k-30k of context on an H200 a 64-token step cost what a 128-token
one did, so keeping to the floor lengthened the prefill for no shorter gaps;
on a CPU a 128-token step costs 1.3-1.6 times a 64-token one.
"""

from __future__ import annotations

import collections
import logging
import statistics

log = logging.getLogger(__name__)

# --decode-stall-factor's and --prefill-chunk-parts' defaults, on CUDA and elsewhere
# (their notes give the figures): on an H100 without CUDA graphs, 1.5 left 16 streams'
# slowest gaps beside a 30k-token prefill at 3.9-4.4x their usual one, 1.0 at 3.0-3.4x,
# and two parts cut them by a quarter; on the CPU parts only spread the arithmetic.
STALL_FACTOR_CUDA, STALL_FACTOR = 1.0, 1.5
CHUNK_PARTS_CUDA, CHUNK_PARTS = 2, 1


def pacing_defaults(on_cuda: bool) -> dict[str, float | int]:
    """Those defaults by ``ServerConfig`` field, for the settings left unset."""
    stall, parts = (STALL_FACTOR_CUDA, CHUNK_PARTS_CUDA) if on_cuda else (STALL_FACTOR, CHUNK_PARTS)
    return {"decode_stall_factor": stall, "prefill_chunk_parts": parts}


# Smallest chunk per prompt: below it a prefill step's fixed costs dominate.
MIN_CHUNK = 64
# Decode-only steps whose median is a decode step's time: on a GPU the step moves
# between two speeds (an H200's 16-row step between about 8 and 12 ms), and a running
# mean that ended on the slower one set the budget 40 % above the median step that
# the streams' time between tokens is measured against.
DECODE_STEPS = 32
# Prefill steps the fitted line goes through (the newest; the time per token
# grows with the context, so old steps say little).
FIT_STEPS = 16
# Two steps' sizes must differ by this share of the larger for their slope to count.
FIT_SPREAD = 0.2
# Prefill steps between a probe of a longer chunk that cost more than the slack allows
# and the next probe: where a longer chunk costs nearly twice (a CPU: a 2-layer model at
# 6k of context, 41-50 ms against the floor's 25-33) each probe is the slowest step of
# its stretch.
PROBE_PAUSE = 8 * FIT_STEPS
# Prefill steps after which a size's recent cost is forgotten: the context has grown
# meanwhile (a CPU's step at 128 tokens went from 31 to 49 ms over 2k tokens of a 6k
# prompt), or a new prompt started.
SIZE_MEMORY = 2 * FIT_STEPS
# Steps of one size whose median is its recent cost (``RecentSizeCosts``).
SIZE_STEPS = 4
# The most prompt tokens a paced step takes, its prompts' chunks together (the module's
# docstring says why; the figures are --paced-step-tokens' notes).
PACED_STEP_TOKENS = 256
# A prompt with at most this many tokens to prefill in all is prefilled in one step:
# a coding agent's next turn (its last reply and a user turn or tool result, 300-800
# tokens) costs the others one longer gap instead of a dozen floor-sized steps.
SHORT_PROMPT = 1024


class PrefillCostFit:
    """A prefill step's seconds as ``fixed + per_token * tokens``, through the last
    ``FIT_STEPS`` prefill steps: the median of the slopes between pairs of steps of
    different sizes (Theil-Sen), and the median intercept under it. Medians, because a
    step's time has outliers that a least-squares line follows: a step that meets a
    new attention shape costs several times its neighbours."""

    def __init__(self, steps: int = FIT_STEPS):
        self._points: collections.deque[tuple[int, float]] = collections.deque(maxlen=steps)

    def add(self, tokens: int, seconds: float) -> None:
        self._points.append((tokens, seconds))

    def median_seconds(self) -> float:
        """The median prefill seconds of the steps the line goes through (0: none)."""
        return statistics.median(seconds for _, seconds in self._points) if self._points else 0.0

    def largest(self) -> int:
        """The most prompt tokens among the steps the line goes through (0: none)."""
        return max((tokens for tokens, _ in self._points), default=0)

    def line(self) -> tuple[float, float, bool] | None:
        """(fixed seconds, seconds per token, whether the steps' sizes differ enough to
        tell the two apart); None before any step. Without that spread, all the cost
        is put on the tokens."""
        points = self._points
        if not points:
            return None
        slopes = [
            (s2 - s1) / (t2 - t1)
            for i, (t1, s1) in enumerate(points)
            for t2, s2 in list(points)[i + 1 :]
            if abs(t2 - t1) >= FIT_SPREAD * max(t1, t2)
        ]
        if slopes:
            slope = statistics.median(slopes)
            if slope > 0:
                fixed = statistics.median(s - slope * t for t, s in points)
                if fixed >= 0:
                    return fixed, slope, True
                return 0.0, statistics.median(s / t for t, s in points), True
        return 0.0, statistics.median(s / t for t, s in points), False


class PrefillPacer:
    """Running estimates of a decode step's time and a prefill step's (fixed part and
    per prompt token), and the chunk they allow.

    ``factor``: a step's prefill may take this many decode steps' time (0: off,
    every chunk is ``full_chunk``). ``full_chunk``: the configured
    ``--prefill-step-size``. ``ladder``: paced chunks only of ``min_chunk`` times a
    power of two. ``floor_slack`` (on the ladder; 0: off): where the floor's steps
    alone outgrow the budget, every paced step is a long gap whatever its chunk, and
    a chunk may cost up to this many times the floor's step (``_slack_chunk``).
    ``step_tokens``: the most prompt tokens of a paced step (None: as the budget
    allows)."""

    def __init__(self, factor: float, full_chunk: int, min_chunk: int = MIN_CHUNK,
                 ladder: bool = False, floor_slack: float = 0.0,
                 step_tokens: int | None = PACED_STEP_TOKENS):
        self.factor = factor
        self.step_tokens = step_tokens
        self.ladder = ladder
        self.floor_slack = floor_slack if ladder else 0.0
        self.full_chunk = full_chunk
        self.min_chunk = min(min_chunk, full_chunk)
        self.decode_seconds: float | None = None  # a step that only decodes
        self._decode_steps: collections.deque[float] = collections.deque(maxlen=DECODE_STEPS)
        self.token_seconds: float | None = None  # one padded prompt token of a prefill
        self.fixed_seconds = 0.0  # a prefill step's cost whatever its size
        self._fit = PrefillCostFit()
        self._spread = False  # whether the fit has seen steps of different sizes
        self._lone_size: int | None = None  # the one size seen, while there is only one
        self._sizes = RecentSizeCosts()
        self._probe_pause = 0  # prefill steps before a chunk of _too_long may be probed again
        self._probe: tuple[int, float] | None = None  # its prompt tokens, the slack's seconds
        self._too_long = 0  # prompt tokens of the probe that cost more, while paused

    def observe(self, seconds: float, *, decoding: int, prefill_tokens: int) -> None:
        """One step took ``seconds`` with ``decoding`` sequences generating and
        ``prefill_tokens`` prompt tokens processed (padding counted)."""
        if decoding and not prefill_tokens:
            self._decode_steps.append(seconds)
            self.decode_seconds = statistics.median(self._decode_steps)
            return
        if not prefill_tokens:
            return
        decode_part = (self.decode_seconds or 0.0) if decoding else 0.0
        if seconds <= decode_part:
            return
        prefill = seconds - decode_part
        self._fit.add(prefill_tokens, prefill)
        if self.floor_slack:
            self._observe_size(prefill_tokens, prefill)
        self.fixed_seconds, self.token_seconds, self._spread = self._fit.line()
        self._lone_size = None if self._spread else prefill_tokens

    def chunk(self, *, decoding: int, prompts: int, short: int = 0,
              most: int | None = None) -> int:
        """Prompt tokens per prompt in the coming step, with ``decoding`` sequences
        generating and ``prompts`` prompts prefilling; ``short``: the longest next
        segment of the prompts whose whole prefill is at most ``SHORT_PROMPT``
        tokens (0: none), which the chunk then covers; ``most``: a paced chunk's
        bound beyond the budget (None: none), kept to the floor at least."""
        if (
            not self.factor
            or not prompts
            or decoding < prompts
            or self.decode_seconds is None
            or not self.token_seconds
        ):
            return self.full_chunk
        budget = self.factor * self.decode_seconds
        floor = self._sizes.seconds(self.min_chunk * prompts) if self.floor_slack else None
        slack = floor is not None and floor > budget
        if slack:  # every step is a long gap: the sizes' recent costs, not the line
            paced = self._slack_chunk(floor, prompts)
        else:
            tokens = (budget - self.fixed_seconds) / self.token_seconds
            paced = min(self.full_chunk, max(self.min_chunk, int(tokens / prompts)))
            # Where the line has seen only steps whose fixed part hides their tokens'
            # cost (its slope near zero), it would allow any chunk: grow by doubling
            # instead, so that a longer chunk's real cost enters the line before a far
            # longer one runs.
            paced = min(paced, max(self.min_chunk, 2 * self._fit.largest() // prompts))
        if most is not None:
            paced = min(paced, max(self.min_chunk, most))
        bound = self._step_bound(prompts)
        paced = min(paced, bound)
        if self.ladder:
            paced = _ladder_step(paced, self.min_chunk)
        lone = None if slack else self._lone_size
        if lone is not None and abs(paced * prompts - lone) < FIT_SPREAD * max(lone, 1):
            # Only this size seen: a step of half of it gives the line its second point.
            # Not twice it: that step would be the longest stall of the prefill (on an
            # H200 a 512-token probe among 256-token steps took 41-96 ms against 20-35).
            # At the floor, twice it, if the floor's steps fit the budget: there the
            # fixed part is most of a step, so twice the tokens may cost little more, and
            # without a second point (all of a step's cost put on its tokens) the chunk
            # would stay at the floor for good. Where the floor alone outgrows the budget
            # (a long context), no larger chunk fits, and such a probe was the slowest
            # step every FIT_STEPS steps (a 2-layer model at 6k of context on a CPU:
            # 41-50 ms against the floor's 25-33); with ``floor_slack`` the sizes'
            # recent costs choose there instead.
            if paced // 2 >= self.min_chunk:
                paced //= 2
            elif self._fit.median_seconds() <= budget:
                paced = min(2 * paced, bound)
        if short and self.ladder:
            # A short prompt beside a long one: the long one's chunk stays a multiple of
            # the floor (its keys a multiple of 64 long), the short one's padded to it.
            short = -(-short // self.min_chunk) * self.min_chunk
        return min(self.full_chunk, max(paced, short))

    def _step_bound(self, prompts: int) -> int:
        """The longest paced chunk per prompt that ``step_tokens`` allows (on the ladder,
        where chunks are; the floor at least)."""
        if self.step_tokens is None:
            return self.full_chunk
        bound = max(self.min_chunk, self.step_tokens // prompts)
        return _ladder_step(bound, self.min_chunk) if self.ladder else bound

    def _observe_size(self, tokens: int, prefill: float) -> None:
        """A prefill step's time for its size, and whether a probe of it cost more than
        the slack allowed."""
        self._probe_pause = max(0, self._probe_pause - 1)
        if self._probe is not None and self._probe[0] == tokens:
            if prefill > self._probe[1]:  # a longer chunk costs more than the slack
                self._probe_pause = PROBE_PAUSE
                self._too_long = tokens
            self._probe = None
        self._sizes.add(tokens, prefill)

    def _slack_chunk(self, floor: float, prompts: int) -> int:
        """The chunk per prompt where the floor's recent steps (``floor`` seconds) alone
        outgrow the budget: the longest on the ladder whose recent steps took at most
        ``floor_slack`` times the floor's, or the next one up not seen lately (a probe)
        unless the last doubling's growth, repeated, would cost more than that. For
        PROBE_PAUSE steps after a probe that cost more, nothing as long as it."""
        size, seconds, shorter = self.min_chunk, floor, floor
        while 2 * size <= self.full_chunk:
            if self._probe_pause and 2 * size * prompts >= self._too_long:
                break
            longer = self._sizes.seconds(2 * size * prompts)
            if longer is None:  # not seen lately: a probe, unless its cost grows on
                if seconds * seconds / shorter <= self.floor_slack * floor:
                    size *= 2
                    self._probe = (size * prompts, self.floor_slack * floor)
                break
            if longer > self.floor_slack * floor:
                break
            size, seconds, shorter = 2 * size, longer, seconds
        return size


class RecentSizeCosts:
    """Each prefill size's recent cost: the median of its steps among the last
    ``SIZE_MEMORY`` prefill steps (at most ``SIZE_STEPS`` of them), since a size's cost
    grows with the context."""

    def __init__(self, sizes: int = 32):
        self._steps = 0
        self._sizes = sizes
        self._by_size: dict[int, collections.deque[tuple[int, float]]] = {}

    def add(self, tokens: int, seconds: float) -> None:
        self._steps += 1
        times = self._by_size.pop(tokens, None) or collections.deque(maxlen=SIZE_STEPS)
        times.append((self._steps, seconds))
        self._by_size[tokens] = times  # the newest last
        if len(self._by_size) > self._sizes:
            del self._by_size[next(iter(self._by_size))]

    def seconds(self, tokens: int) -> float | None:
        """The recent median for steps of ``tokens`` prompt tokens (None: none lately)."""
        recent = [seconds for step, seconds in self._by_size.get(tokens, ())
                  if self._steps - step < SIZE_MEMORY]
        return statistics.median(recent) if recent else None


def _ladder_step(tokens: int, floor: int) -> int:
    """The largest ``floor`` times a power of two within ``tokens`` (``floor`` at least):
    a paced chunk takes few lengths, so that a compiled pass meets few shapes
    (``runtime.mixed_step``)."""
    size = floor
    while 2 * size <= tokens:
        size *= 2
    return size


def passes_cost_steps(mx) -> bool:
    """Whether a step's cost is more its passes' than its tokens' (a GPU's, not the
    CPU's): the pacer then cuts a segment's last paced chunk (``ladder_tail``)."""
    return mx.default_device().type == mx.gpu


def ladder_tail(chunk: int, segment: int, floor: int = MIN_CHUNK) -> int:
    """A lone prompt's paced ``chunk`` with ``segment`` tokens left of its segment. Where
    the chunk would take them all and they are a length no shared pass takes (off the
    ladder, and ``floor`` tokens or more short of its next length, so that padding them
    onto it would cost more than the second pass saves: ``runtime.mixed_step.tail_padding``),
    the longest ladder length below them, which leaves a rest that pads onto the ladder;
    else ``chunk``. The segment's end then takes one step more, each of them one pass:
    on an H100 a 30k prompt's last step (189 tokens, its own pass after the decode's)
    took 46 ms beside 16 streams whose steps took 15-24 ms. (On the CPU a step costs
    its tokens, not its passes: 128 tokens and then 55 took 134 and 82 ms where 183 in
    two passes took 128, so the engine cuts only on a GPU.)"""
    if segment > chunk or segment <= floor:
        return chunk
    length = floor
    while length < segment:
        length *= 2
    if length == segment or length - segment < floor:
        return chunk
    return length // 2


def aligned_chunk(chunk: int, full: int, *, prefix: int, segment: int) -> int:
    """A lone prompt's ``chunk`` after ``prefix`` keys with ``segment`` tokens left of its
    segment: a full chunk cut to end at the next multiple of ``full`` where the prefix is
    off that grid and more than a full chunk is left (a shorter segment goes in one step
    either way); any other chunk as it is."""
    off = prefix % full
    if chunk != full or not off or segment <= full:
        return chunk
    return full - off


class PacedSteps:
    """The engine core's hook around each ``BatchGenerator.next()``: sets the chunk
    before it (``before``, with the prefill group's sizing in between) and times it
    (``after``). ``coming`` reads what the step will do:
    ``runtime.mlx_lm_prefill.coming_prefill``. ``chunk_limit(rows=, prefix=)``: the
    most tokens a paced chunk of that many prompts after that many keys should have
    (``runtime.cuda_attention.in_place_chunk_limit``; None from it or unset: no
    bound), since its cost jumps past it and the pacer's line, fitted on shorter
    chunks, would not foresee that. ``lone``: the reader of a lone prompt's prefix
    (``runtime.mlx_lm_prefill.lone_prompt``) whose full chunks are kept on the grid
    (``aligned_chunk``; None: chunks as they come). ``tail``: the same reader, for a
    lone prompt's last paced chunk of a segment (``ladder_tail``, on the pacer's ladder
    only; None: as it comes)."""

    def __init__(self, pacer: PrefillPacer, coming, chunk_limit=None, lone=None,
                 tail=None) -> None:
        self.pacer = pacer
        self._coming = coming
        self._chunk_limit = chunk_limit
        self._lone = lone
        self._tail = tail if pacer.ladder else None
        self._decoding = 0
        self._tokens = 0
        self._in_flight = None  # the generator's reader of a chunk whose layers go on
        self._part_seconds = 0.0  # the slowest step so far of such a chunk

    def before(self, generator, size_group=None) -> None:
        """Size the coming step's prefill chunk (``size_group(generator)``: the group's
        sizing, which reads the chunk, runs in between). Pacing is an optimisation: if
        reading the generator fails (an mlx-lm that changed), it turns itself off with
        a log line and the step runs with full chunks."""
        if not self.pacer.factor:
            generator.prefill_step_size = self.pacer.full_chunk  # a cut to the grid ends
            if size_group is not None:
                size_group(generator)
            self._on_grid(generator)
            return
        try:
            self._size(generator, size_group)
        except Exception:
            log.exception("prefill pacing failed; full prefill chunks from now on")
            self.pacer.factor = 0
            self._lone = self._tail = None
            generator.prefill_step_size = self.pacer.full_chunk
            self._decoding = self._tokens = 0

    def _on_grid(self, generator) -> bool:
        """A lone prompt's full chunk cut to the grid (``aligned_chunk``); whether it was."""
        lone = None if self._lone is None else self._lone(generator)
        if lone is None:
            return False
        chunk = aligned_chunk(generator.prefill_step_size, self.pacer.full_chunk,
                              prefix=lone.prefix, segment=lone.segment)
        cut = chunk < generator.prefill_step_size
        generator.prefill_step_size = chunk
        return cut

    def _size(self, generator, size_group) -> None:
        self._in_flight = in_flight = getattr(generator, "chunk_in_flight", None)
        if in_flight is not None and in_flight():  # runtime.mixed_step
            # The step decodes, carrying the later layers of the last step's chunk: a
            # step of that chunk, as the pacer's line counts it.
            self._decoding, self._tokens = len(generator._generation_batch), in_flight()
            return
        coming = self._coming(generator, SHORT_PROMPT)
        generator.prefill_step_size = self._chunk(coming)
        if size_group is not None:
            size_group(generator)
        coming = self._coming(generator, SHORT_PROMPT)
        tokens = coming.tokens
        narrower = self._chunk(coming)
        if narrower < generator.prefill_step_size:  # more joined than first counted
            generator.prefill_step_size = narrower
            tokens = self._coming(generator, SHORT_PROMPT).tokens
        if self._on_grid(generator) or self._cut_tail(generator, coming):
            tokens = self._coming(generator, SHORT_PROMPT).tokens
        self._decoding, self._tokens = coming.decoding, tokens

    def _cut_tail(self, generator, coming) -> bool:
        """A lone prompt's paced chunk cut back at its segment's end (``ladder_tail``);
        whether it was. Not a short prompt's (it goes in one step) nor a full chunk."""
        if self._tail is None or coming.short or not coming.decoding \
                or generator.prefill_step_size >= self.pacer.full_chunk:
            return False
        lone = self._tail(generator)
        if lone is None:
            return False
        chunk = ladder_tail(generator.prefill_step_size, lone.segment, self.pacer.min_chunk)
        cut = chunk < generator.prefill_step_size
        generator.prefill_step_size = chunk
        return cut

    def _chunk(self, coming) -> int:
        limit = self._chunk_limit
        most = None if limit is None or not coming.prompts else limit(
            rows=coming.prompts, prefix=coming.depth)
        return self.pacer.chunk(decoding=coming.decoding, prompts=coming.prompts,
                                short=coming.short, most=most)

    def after(self, seconds: float) -> None:
        if self._in_flight is not None and self._in_flight():
            # The chunk's layers go on in the next step: the pacer sees the chunk once,
            # as its slowest step, since that is the longest gap it makes.
            self._part_seconds = max(self._part_seconds, seconds)
            return
        seconds, self._part_seconds = max(seconds, self._part_seconds), 0.0
        self.pacer.observe(seconds, decoding=self._decoding, prefill_tokens=self._tokens)
