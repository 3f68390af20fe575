"""Where a constrained row's time goes in one engine step, without a server.

A ``BatchGenerator`` built as the engine builds it (``make_batch_generator``, the
``BatchSampler`` with llguidance's backend, compiled decode) decodes ``--rows``
sequences; ``--constrained`` of them carry ``loadgen.BENCH_SCHEMA`` (a grammar that
never finishes). Repetitions alternate free and constrained batches. Per run it
prints the median step (the generator's ``next``) and, for constrained runs, the
median of each phase of the sampler's constraint work: ``async_eval`` (starting the
model's work), ``previous`` (reading the rows' previous tokens: where the step
waits for the device), ``consume`` and ``fill`` (llguidance), ``mask`` (the masks
to the device and the masking graph). Constrained runs fill their masks on
llguidance's thread pool (``pool``) and one by one on the engine thread
(``serial``), alternated too.

    python bench/constrained_step.py --model /tmp/m/qwen3-0.6b --rows 64 --constrained 16
    python bench/constrained_step.py --rows 8 --constrained 2 --steps 60   # a tiny model
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen import RESPONSE_FORMATS  # noqa: E402
from mlx_lm import load  # noqa: E402

import runtime.batch_sampling as batch_sampling  # noqa: E402
import runtime.grammar.matcher as grammar_matcher  # noqa: E402
from runtime.batch_sampling import BatchSampler, make_batch_generator  # noqa: E402
from runtime.compiled_decode import install_compiled_decode  # noqa: E402
from runtime.grammar.backend import GrammarBackend  # noqa: E402
from runtime.grammar.compiler import compile_constraint  # noqa: E402
from runtime.grammar.matcher import grammar_tokenizer  # noqa: E402
from runtime.messages import SamplingParams  # noqa: E402

PHASES = ("async_eval", "previous", "consume", "fill", "mask")


class _Timed:
    """Times the sampler's calls of ``mx.async_eval``, the previous tokens' ``tolist``,
    the constraints' ``consume`` and the backend's ``fill_bitmasks``."""

    def __init__(self):
        self.phases: dict[str, list[float]] = {p: [] for p in PHASES}
        self.apply: list[float] = []
        self.step_phases: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.step_phases[phase] = self.step_phases.get(phase, 0.0) + seconds


def instrument(timed: _Timed) -> None:
    real_mx = batch_sampling.mx

    class TimedMx:
        def __getattr__(self, name):
            return getattr(real_mx, name)

        @staticmethod
        def async_eval(*arrays):
            began = time.perf_counter()
            real_mx.async_eval(*arrays)
            timed.add("async_eval", time.perf_counter() - began)

    batch_sampling.mx = TimedMx()
    apply = BatchSampler._apply_constraints

    def timed_apply(self, x, plan):
        timed.step_phases = {}
        began = time.perf_counter()
        out = apply(self, x, plan)
        total = time.perf_counter() - began
        timed.apply.append(total)
        known = sum(timed.step_phases.values())
        timed.step_phases["mask"] = total - known
        for phase in PHASES:
            timed.phases[phase].append(timed.step_phases.get(phase, 0.0))
        return out

    BatchSampler._apply_constraints = timed_apply
    rows = BatchSampler.sampling_rows

    class TimedInputs:
        def __init__(self, inputs):
            self.inputs = inputs

        def tolist(self):
            began = time.perf_counter()
            out = self.inputs.tolist()
            timed.add("previous", time.perf_counter() - began)
            return out

    def timed_rows(self, uids, inputs):
        return rows(self, uids, None if inputs is None else TimedInputs(inputs))

    BatchSampler.sampling_rows = timed_rows


class TimedBackend(GrammarBackend):
    def __init__(self, tokenizer, timed: _Timed):
        super().__init__(tokenizer)
        self.timed = timed

    def fill_bitmasks(self, rows, bitmask):
        began = time.perf_counter()
        super().fill_bitmasks(rows, bitmask)
        self.timed.add("fill", time.perf_counter() - began)


class TimedConstraint:
    """A ``RowMatcher`` whose ``consume`` is timed (everything else read through)."""

    def __init__(self, matcher, timed: _Timed):
        self.matcher, self.timed = matcher, timed

    def __getattr__(self, name):
        return getattr(self.matcher, name)

    def consume(self, token):
        began = time.perf_counter()
        self.matcher.consume(token)
        self.timed.add("consume", time.perf_counter() - began)


def run(model, tokenizer, backend, timed, rows: int, constrained: int, steps: int,
        prompt_tokens: int) -> float:
    spec = compile_constraint(tokenizer, response_format=RESPONSE_FORMATS["json_schema"])
    sampler = BatchSampler(constraint_backend=backend)
    gen = make_batch_generator(model, sampler=sampler, completion_batch_size=max(rows, 32),
                               prefill_batch_size=rows)
    prompts = [[1 + (i * 7 + j) % 300 for j in range(prompt_tokens)] for i in range(rows)]
    uids = gen.insert(prompts, max_tokens=[steps + 64] * rows)
    for k, uid in enumerate(uids):
        matcher = None
        if k < constrained:
            matcher = TimedConstraint(backend.new_constraint(spec), timed)
        sampler.register(uid, SamplingParams(), matcher)
    times = []
    try:
        while len(times) < steps:
            began = time.perf_counter()
            gen.next()
            times.append(time.perf_counter() - began)
    finally:
        gen.close()
    warm = times[min(10, len(times) // 4):]
    return 1000 * statistics.median(warm)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: build the tiny model)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--constrained", type=int, default=16)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    ns = p.parse_args()
    model_dir = ns.model
    if model_dir is None:
        from runtime.tiny_model import build_tiny_model

        model_dir = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-model-")) / "tiny"))
    model, tokenizer = load(model_dir)
    layers = install_compiled_decode(model)
    timed = _Timed()
    backend = TimedBackend(grammar_tokenizer(tokenizer, model.args.vocab_size), timed)
    instrument(timed)
    print(f"{model_dir}: {layers} compiled layers, {ns.rows} rows, {ns.constrained} constrained",
          flush=True)
    run(model, tokenizer, backend, timed, ns.rows, ns.constrained, 30, ns.prompt_tokens)  # warm-up
    variants = [("free", 0, None), ("pool", ns.constrained, 1),
                ("serial", ns.constrained, 1 << 30)]
    for rep in range(ns.reps):
        for name, constrained, fill_min_rows in variants if rep % 2 == 0 else variants[::-1]:
            for phase in PHASES:
                timed.phases[phase].clear()
            if fill_min_rows is not None:
                grammar_matcher.PARALLEL_FILL_MIN_ROWS = fill_min_rows
            step_ms = run(model, tokenizer, backend, timed, ns.rows, constrained, ns.steps,
                          ns.prompt_tokens)
            line = f"rep {rep} {name:<6} ({constrained:>3} constrained): step p50 {step_ms:.2f} ms"
            if constrained:
                line += "; " + ", ".join(
                    f"{phase} {1000 * statistics.median(timed.phases[phase]):.3f}"
                    for phase in PHASES if timed.phases[phase]
                ) + " ms"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
