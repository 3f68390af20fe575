"""Engine overhead: the bare ``BatchGenerator`` loop against our ``EngineCore``, step by step.

Owns the measurement behind issue 15's third finding (at 32-64 clients our
engine's steps were 1.3-1.7x the bare engine's on an H200, with the same number
of steps). One process loads the model twice and drives, alternately, round by
round and level by level, the same closed-loop workload through:

  ceiling   mlx-lm's ``BatchGenerator`` in-process (``engine_ceiling.Engine``):
            a finished sequence is replaced in the same step, its KV cache dropped
  core      our ``EngineCore`` as ``make_engine_core`` builds it for the server
            (batch sampler and row hooks, prompt cache, admission window, counters),
            driven in-process like the ceiling; each step's ``StepOutputs`` is
            pickled as the engine process sends it (``--no-pickle``: not)
  server    optional (``--server``): ``python -m api.cli`` over HTTP at the same
            level (``loadgen.run_level``), its steps from ``/metrics``

The prompts are the load generator's (``loadgen.PromptBuilder``), rendered with
the chat template; the core gets them as the server plans them
(``runtime.prompts.prepare_chat``: segments, segment types). Every run at a
level uses prompt indices no earlier run used (no prompt-cache hits).

Per system and level it prints tokens/s, steps, prefill steps, ms per step (the
mean over the run, and the median of the decode steps), and the share of each
step spent in the generator's ``next()`` against our code around it.
``--profile DIR`` writes a cProfile of each system's last round
(``DIR/<system>-c<level>.prof``) and prints its top functions.

    .venv/bin/python bench/engine_overhead.py --medium --levels 16,64 --rounds 3
    .venv/bin/python bench/engine_overhead.py --model M --levels 64 --server --profile /tmp/p
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import pstats
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))

from loadgen import (  # noqa: E402
    PromptBuilder,
    ServerProcess,
    Workload,
    add_workload_args,
    run_level,
    self_cpu_s,
    setup_logging,
    warm_up,
    workload_from_args,
)

log = logging.getLogger("bench.engine_overhead")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def step_summary(
    step_s: list[float], inner_s: list[float], decode_only: list[bool], tokens: int, wall: float
) -> dict[str, Any]:
    """Per-run figures from the per-step wall times (``inner_s``: inside ``next()``)."""
    decode = [s for s, d in zip(step_s, decode_only, strict=True) if d]
    return {
        "tok_s": round(tokens / wall, 1) if wall else None,
        "steps": len(step_s),
        "ms_per_step": round(1000 * sum(step_s) / len(step_s), 3) if step_s else None,
        "decode_step_p50_ms": round(1000 * statistics.median(decode), 3) if decode else None,
        "decode_step_p90_ms": round(1000 * percentile(decode, 90), 3) if decode else None,
        "next_share_pct": round(100 * sum(inner_s) / sum(step_s), 1) if step_s else None,
        "outside_next_ms_per_step": (
            round(1000 * (sum(step_s) - sum(inner_s)) / len(step_s), 3) if step_s else None
        ),
    }


class Timed:
    """Wraps a generator's ``next`` and records how long each call took."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[float] = []

    def __call__(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.calls.append(time.perf_counter() - began)


def reset_memory_figures() -> None:
    import mlx.core as mx

    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()


def memory_figures() -> dict[str, float]:
    """MLX's peak and active memory (MiB) since ``reset_memory_figures``; active at the end."""
    import mlx.core as mx

    mx.synchronize()
    return {
        "peak_mib": round(mx.get_peak_memory() / 2**20, 1),
        "active_mib": round(mx.get_active_memory() / 2**20, 1),
    }


# ------------------------------------------------------------------- ceiling


class Ceiling:
    """mlx-lm's ``BatchGenerator``, driven as ``engine_ceiling.Engine.run`` does, timed per step."""

    name = "ceiling"

    def __init__(self, model_path: str, decode_concurrency: int, prompt_concurrency: int):
        from engine_ceiling import Engine

        self.engine = Engine(model_path, decode_concurrency, prompt_concurrency)

    def prompt_ids(self, w: Workload, index: int) -> list[int]:
        return self.engine.prompt_ids(w, index)

    def run(self, w: Workload, concurrency: int, requests: int, first: int) -> dict[str, Any]:
        from mlx_lm.generate import BatchGenerator

        e = self.engine
        prompts = [self.prompt_ids(w, first + i) for i in range(requests)]
        gen = BatchGenerator(
            e.model,
            completion_batch_size=e.decode_concurrency,
            prefill_batch_size=e.prompt_concurrency,
            stream=e.stream,
        )
        todo = deque(range(requests))
        live: set[int] = set()
        tokens = 0
        step_s: list[float] = []
        decode_only: list[bool] = []

        def submit() -> None:
            i = todo.popleft()
            (uid,) = gen.insert([prompts[i]], max_tokens=[w.max_tokens], stop_sequences=[e.stop])
            live.add(uid)

        for _ in range(min(concurrency, requests)):
            submit()
        reset_memory_figures()
        cpu0, t0 = self_cpu_s(), time.perf_counter()
        while live:
            began = time.perf_counter()
            prompt_responses, responses = gen.next()
            for r in responses:
                tokens += 1
                if r.finish_reason is not None:
                    live.discard(r.uid)
                    if todo:
                        submit()
            step_s.append(time.perf_counter() - began)
            decode_only.append(not prompt_responses)
        wall = time.perf_counter() - t0
        cpu = self_cpu_s() - cpu0
        memory = memory_figures()
        gen.close()
        out = step_summary(step_s, step_s, decode_only, tokens, wall)
        out.update(
            prefill_steps=len(step_s) - sum(decode_only),
            tokens=tokens,
            wall_s=round(wall, 3),
            cpu_ms_per_token=round(1000 * cpu / tokens, 3),
            **memory,
        )
        out["next_share_pct"] = None  # the loop is next() and nothing else
        return out


# ---------------------------------------------------------------------- core


CORE_VARIANTS = {
    "core": "as the server builds it",
    "core-lazy": "prompt-cache entries stored unevaluated (as before the fix of issue 15)",
    "core-nocache": "no prompt-cache entries stored (the ceiling drops them too)",
    "core-nowindow": "--admission-window-ms 0",
}


class Core:
    """Our ``EngineCore``, built as the server builds it, driven in-process (or a variant)."""

    def __init__(
        self,
        model_path: str,
        decode_concurrency: int,
        pickle_outputs: bool,
        variant: str = "core",
        **flags,
    ):
        from runtime.config import ServerConfig
        from runtime.engine.loading import make_engine_core

        self.name = variant
        if variant == "core-nowindow":
            flags["admission_window_ms"] = 0
        self.config = ServerConfig(model=model_path, decode_concurrency=decode_concurrency, **flags)
        self.core = make_engine_core(self.config, model_path)
        entries = self.core.cache_entries
        if variant == "core-nocache":
            entries.insert = lambda *args, **kwargs: None
        elif variant == "core-lazy":
            entries.insert = _lazy(entries.insert)
        self.pickle_outputs = pickle_outputs
        self.builder = PromptBuilder(model_path)
        self.next_request_id = 1

    def submits(self, w: Workload, first: int, requests: int) -> list:
        from runtime.messages import SamplingParams, Submit
        from runtime.prompts import prepare_chat, prepare_text

        tokenizer = self.core.handle.tokenizer
        out = []
        for i in range(requests):
            if w.endpoint == "chat":
                prepared = prepare_chat(
                    tokenizer, self.builder.messages(w, first + i), tools=None, template_args={}
                )
            else:
                prepared = prepare_text(tokenizer, self.builder.text_prompt(w, first + i))
            out.append(
                Submit(
                    request_id=self.next_request_id,
                    prompt=prepared.tokens,
                    segments=prepared.plan.segments,
                    segment_types=prepared.plan.segment_types,
                    sampling=SamplingParams(),
                    max_tokens=w.max_tokens,
                )
            )
            self.next_request_id += 1
        return out

    def run(self, w: Workload, concurrency: int, requests: int, first: int) -> dict[str, Any]:
        from multiprocessing.reduction import ForkingPickler

        from actors.prompt_cache import PromptCacheCore
        from runtime.messages import EvictCache

        core = self.core
        # The PromptCacheActor's decisions (the server's limits), applied between
        # steps as the Scheduler hands them over; its own time is not the engine's.
        policy = PromptCacheCore(
            max_entries=self.config.prompt_cache_size,
            max_bytes=self.config.prompt_cache_bytes,
            min_reuse=self.config.prompt_cache_min_reuse,
        )
        policy.engine_changed(core.handle.model_key)
        todo = deque(self.submits(w, first, requests))
        live = 0
        tokens = 0
        step_s: list[float] = []
        inner = Timed(core._batch.next)
        core._batch.next = inner
        pickle_s = 0.0
        decode_only: list[bool] = []
        for _ in range(min(concurrency, requests)):
            core.handle_command(todo.popleft())
            live += 1
        reset_memory_figures()
        cpu0, t0 = self_cpu_s(), time.perf_counter()
        inner_before = 0
        while live:
            began = time.perf_counter()
            outputs = core.step()
            step_s.append(time.perf_counter() - began)
            decode_only.append(not outputs.progress)
            if len(inner.calls) == inner_before:
                inner.calls.append(0.0)  # a step without a generator call (window closed)
            inner_before = len(inner.calls)
            if self.pickle_outputs:
                p0 = time.perf_counter()
                ForkingPickler.dumps(outputs)
                pickle_s += time.perf_counter() - p0
            outputs, evicted = policy.on_step(outputs)
            if evicted:
                core.handle_command(EvictCache(entry_ids=evicted))
            for event in outputs.tokens:
                tokens += 1
                if event.finish_reason is not None:
                    live -= 1
                    if todo:
                        core.handle_command(todo.popleft())
                        live += 1
            live -= len(outputs.failed) + len(outputs.aborted)
        wall = time.perf_counter() - t0
        cpu = self_cpu_s() - cpu0
        memory = memory_figures()
        core._batch.next = inner.fn
        # Every run starts with an empty prompt cache.
        core.handle_command(EvictCache(entry_ids=tuple(core.cache_entries.held())))
        core.cache_entries.take_events()
        out = step_summary(step_s, inner.calls, decode_only, tokens, wall)
        out.update(
            prefill_steps=len(step_s) - sum(decode_only),
            tokens=tokens,
            wall_s=round(wall, 3),
            cpu_ms_per_token=round(1000 * cpu / tokens, 3),
            pickle_ms_per_step=round(1000 * pickle_s / len(step_s), 3) if step_s else None,
            **memory,
        )
        return out


def _lazy(insert):
    """``CacheEntries.insert`` with ``own_arrays`` off: the entry stays a lazy slice."""
    import runtime.prompt_cache_store as store

    def lazy_insert(*args, **kwargs):
        saved = store.own_arrays
        store.own_arrays = lambda cache: None
        try:
            return insert(*args, **kwargs)
        finally:
            store.own_arrays = saved

    return lazy_insert


# -------------------------------------------------------------------- server


class Server:
    """``python -m api.cli`` over HTTP (the whole server) at the same level."""

    name = "server"

    def __init__(self, model_path: str, decode_concurrency: int, log_dir: Path):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = [
            sys.executable,
            "-m",
            "api.cli",
            "--model",
            model_path,
            "--port",
            str(port),
            "--decode-concurrency",
            str(decode_concurrency),
        ]
        self.proc = ServerProcess(
            "mlx-trio-server", argv, f"http://127.0.0.1:{port}", log_dir / f"server-{port}.log"
        )
        self.proc.start(cwd=str(REPO))
        self.proc.wait_healthy()
        self.builder = PromptBuilder(model_path)

    def warm_up(self, w: Workload) -> None:
        warm_up(self.proc.url, w, self.builder)

    def run(self, w: Workload, concurrency: int, requests: int, first: int) -> dict[str, Any]:
        r = run_level(self.proc.url, w, concurrency, requests, self.builder, self.proc.pid, first)
        tokens = r["completion_tokens"]
        steps = int(r["engine_steps"]) if r.get("engine_steps") is not None else None
        busy = r.get("engine_busy_s")
        return {
            "tok_s": round(tokens / r["wall_s"], 1),
            "steps": steps,
            "prefill_steps": int(r.get("engine_prefill_steps") or 0),
            "ms_per_step": round(1000 * busy / steps, 3) if steps and busy else None,
            "tokens": tokens,
            "wall_s": round(r["wall_s"], 3),
            "errors": r["errors"],
        }

    def close(self) -> None:
        self.proc.stop()


# ----------------------------------------------------------------------- run


def top_functions(path: Path, n: int = 25) -> str:
    import io

    buf = io.StringIO()
    pstats.Stats(str(path), stream=buf).sort_stats("tottime").print_stats(n)
    return buf.getvalue()


def format_row(level: int, system: str, r: dict[str, Any]) -> str:
    def f(key: str, spec: str = ".1f") -> str:
        v = r.get(key)
        return "-" if v is None else format(v, spec)

    return (
        f"{level:>4} {system:<13} {f('tok_s'):>8} {f('steps', 'd'):>6} {f('prefill_steps', 'd'):>5} "
        f"{f('ms_per_step', '.2f'):>8} {f('decode_step_p50_ms', '.2f'):>8} "
        f"{f('outside_next_ms_per_step', '.2f'):>8} {f('pickle_ms_per_step', '.2f'):>7} "
        f"{f('cpu_ms_per_token', '.3f'):>8} {f('peak_mib', '.0f'):>7} {f('active_mib', '.0f'):>7}"
    )


HEADER = (
    f"{'conc':>4} {'system':<13} {'tok/s':>8} {'steps':>6} {'pre':>5} "
    f"{'ms/step':>8} {'dec p50':>8} {'outside':>8} {'pickle':>7} {'cpu/tok':>8} "
    f"{'peakMiB':>7} {'actMiB':>7}"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="bare BatchGenerator vs EngineCore, per step")
    p.add_argument("--model", default=None, help="model dir (default: build one, see --medium)")
    p.add_argument("--medium", action="store_true", help="build hidden 256 / 4 layers")
    p.add_argument(
        "--systems",
        default="ceiling,core",
        help="comma list of ceiling and core variants: "
        + "; ".join(f"{k}: {v}" for k, v in CORE_VARIANTS.items()),
    )
    p.add_argument("--server", action="store_true", help="also the whole server over HTTP")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--decode-concurrency", type=int, default=64)
    p.add_argument("--prompt-concurrency", type=int, default=8)
    p.add_argument("--admission-window-ms", type=float, default=None, help="the core's")
    p.add_argument("--no-pickle", action="store_true", help="do not pickle the core's outputs")
    p.add_argument("--profile", default=None, help="write cProfile stats of the last round here")
    p.add_argument("--json-out", default=None)
    add_workload_args(p)
    p.set_defaults(levels=[16, 64])
    ns = p.parse_args(argv)
    setup_logging()
    w = workload_from_args(ns)

    model = ns.model
    if model is None:
        from runtime.tiny_model import build_tiny_model

        shape = {"hidden_size": 256, "num_layers": 4} if ns.medium else {}
        model = str(build_tiny_model(tempfile.mkdtemp(prefix="bench-model-"), **shape))

    flags = {}
    if ns.admission_window_ms is not None:
        flags["admission_window_ms"] = ns.admission_window_ms
    systems: dict[str, Any] = {}
    for name in ns.systems.split(","):
        if name == "ceiling":
            systems[name] = Ceiling(model, ns.decode_concurrency, ns.prompt_concurrency)
        elif name in CORE_VARIANTS:
            systems[name] = Core(
                model,
                ns.decode_concurrency,
                not ns.no_pickle,
                variant=name,
                prompt_concurrency=ns.prompt_concurrency,
                **flags,
            )
        else:
            raise SystemExit(f"unknown system {name!r}")
    if ns.server:
        systems["server"] = Server(model, ns.decode_concurrency, BENCH / "results" / "logs")
    profile_dir = Path(ns.profile) if ns.profile else None
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict[str, list]] = {}
    first = 0
    try:
        for name, system in systems.items():  # first-call costs off the clock
            warm = Workload(prompt_tokens=w.prompt_tokens, max_tokens=4, seed=w.seed + 1000)
            if name == "server":
                system.warm_up(w)
            else:
                system.run(warm, 2, 2, 10_000_000)
        sys.stdout.write(HEADER + "\n")
        for level in ns.levels:
            requests = ns.requests or max(8, 2 * level)
            for rnd in range(ns.rounds):
                order = list(systems) if rnd % 2 == 0 else list(reversed(systems))
                for name in order:
                    profiler = None
                    if profile_dir and rnd == ns.rounds - 1 and name != "server":
                        profiler = cProfile.Profile()
                        profiler.enable()
                    r = systems[name].run(w, level, requests, first)
                    if profiler is not None:
                        profiler.disable()
                        path = profile_dir / f"{name}-c{level}.prof"
                        profiler.dump_stats(str(path))
                        log.info("%s\n%s", path, top_functions(path))
                    results.setdefault(str(level), {}).setdefault(name, []).append(r)
                    sys.stdout.write(format_row(level, name, r) + "\n")
                    sys.stdout.flush()
                first += requests  # every system sees the same prompts in a round
    finally:
        if "server" in systems:
            systems["server"].close()
    if ns.json_out:
        meta = {"model": model, "workload": w.__dict__, "levels": ns.levels, "rounds": ns.rounds}
        Path(ns.json_out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
