"""Engine overhead: the bare ``BatchGenerator`` loop against our ``EngineCore``, step by step.

Owns the measurement of what our engine adds to mlx-lm's step, and of the
whole server against the bare engine at many clients (the engine ceiling).
One process loads the model once per system and drives, alternately,
round by round and level by level, the same closed-loop workload through:

  ceiling   mlx-lm's ``BatchGenerator`` in-process (``engine_ceiling.Engine``);
            a finished sequence's KV cache is dropped
  core      our ``EngineCore`` as ``make_engine_core`` builds it for the server
            (batch sampler and row hooks, prompt cache, admission window,
            counters), the prompt-cache policy's evictions applied between steps,
            each step's ``StepOutputs`` pickled as the engine process sends it
            (``--no-pickle``: not); variants (``CORE_VARIANTS``) turn one part
            off to bisect
  server    optional (``--server``): ``python -m api.cli`` over HTTP at the same
            level (``loadgen.run_level``), its steps from ``/metrics``

The prompts are the load generator's (``loadgen.PromptBuilder``), rendered with
the chat template; the core gets them as the server plans them
(``runtime.prompts.prepare_chat``: segments, segment types). In a round every
system gets the same prompts, each round new ones (the core's prompt cache is
emptied after each run). A finished request's replacement arrives before the
next step, or ``--arrival-delay-ms`` (plus ``--arrival-jitter-ms``) later, as
HTTP clients come back.

Per system and level: tokens/s, steps (prefill steps), ms per step (the mean,
and the median decode-only step), the ms per step outside mlx-lm's ``next()``,
the engine thread's CPU per step, the pickling, TTFT (arrival to first token)
and MLX's peak memory; then medians over the rounds with their ranges.
``--profile DIR`` writes a cProfile of each system's last round
(``DIR/<system>-c<level>.prof``) and logs its top functions.

``--engine-cpu N`` runs every engine on the one CPU ``N``: this process's main
thread while it drives an in-process system, and the main thread of the server's
engine process (the engine loop; in both, CUDA's and MLX's helper threads keep
every CPU), with the server's API process and this process's load generator on
the other CPUs. On a shared host whose cores run at different
speeds (the H200 machine's vCPUs: a fixed Python loop takes 16 or 30 us,
``step_modes.cpu_probe_us``), the engines then share one core's speed, and
alternated rounds share its changes over time; without it the server's engine
process lands on a core of its own. Each in-process step also times that probe
(``probe_us_p50``).

    .venv/bin/python bench/engine_overhead.py --levels 16,32,64 --rounds 3 --requests 128 \
        --systems ceiling,core,core-lazy
    .venv/bin/python bench/engine_overhead.py --levels 4,16 --systems core,core-nohold \
        --arrival-delay-ms 3 --arrival-jitter-ms 20
    .venv/bin/python bench/engine_overhead.py --model M --levels 32,64 --server --profile /tmp/p
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import json
import logging
import os
import pstats
import shlex
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
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
    descendants,
    requests_for,
    run_level,
    sampling_of,
    self_cpu_s,
    setup_logging,
    warm_up,
    workload_from_args,
)

log = logging.getLogger("bench.engine_overhead")

from runtime.engine.host_speed import PROBE_ENV, cpu_probe_us  # noqa: E402


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (``sched_setaffinity`` is per thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


class Timed:
    """Wraps a generator's ``next`` and records how long each call took (and its thread CPU)."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[float] = []
        self.cpu_s = 0.0

    def __call__(self, *args, **kwargs):
        began, began_cpu = time.perf_counter(), time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.calls.append(time.perf_counter() - began)
            self.cpu_s += time.thread_time() - began_cpu


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


class Driven:
    """What the closed loop needs of an in-process system (``Ceiling``, ``Core``).

    ``admit(i)``: request ``i`` of the run arrives; ``has_work``; ``step()`` ->
    (whether it processed prompt tokens, [(request, finished)] per token);
    ``inner``: the generator's ``next()``, timed (None: the step is ``next()``);
    ``extra``: figures of the run besides the common ones.
    """

    inner: Timed | None = None

    def start(self, w: Workload, requests: int, first: int) -> None: ...
    def admit(self, i: int) -> None: ...
    def step(self) -> tuple[bool, list[tuple[int, bool]]]: ...
    def finish(self) -> dict[str, Any]: ...

    has_work: bool


def closed_loop(
    system: Driven,
    w: Workload,
    concurrency: int,
    requests: int,
    first: int,
    delay: float,
    jitter: float = 0.0,
    trace: list[str] | None = None,
    first_wave: float = 0.0,
) -> dict[str, Any]:
    """``concurrency`` requests in flight; a finished one's replacement arrives ``delay``
    seconds later (0: before the next step, as ``engine_ceiling.py`` does), plus up to
    ``jitter`` seconds (uniform, the same draws for every system). The first
    ``concurrency`` arrive at once, or (``first_wave``) spread uniformly over that many
    seconds, as a server receives a burst of HTTP requests one after another."""
    import random

    rng = random.Random(first)
    system.start(w, requests, first)
    arrivals: list[tuple[float, int]] = []  # (due, request), in order
    arrived: dict[int, float] = {}
    first_token: dict[int, float] = {}
    todo = deque(range(requests))
    opening = time.perf_counter()
    spread = sorted(rng.uniform(0.0, first_wave) for _ in range(min(concurrency, requests)))
    for offset in spread:
        # all at once (0.0: already due), or spread from now on
        arrivals.append((opening + offset if first_wave else 0.0, todo.popleft()))
    tokens = 0
    step_s: list[float] = []
    decode_only: list[bool] = []
    probes: list[float] = []
    thread = 0.0
    reset_memory_figures()
    cpu0, t0 = self_cpu_s(), time.perf_counter()
    while arrivals or system.has_work:
        now = time.perf_counter()
        while arrivals and arrivals[0][0] <= now:
            i = arrivals.pop(0)[1]
            arrived[i] = now
            system.admit(i)
            if trace is not None:
                trace.append(f"C {time.time():.4f} Submit {i}\n")
        if not system.has_work:
            time.sleep(max(0.0, arrivals[0][0] - time.perf_counter()))
            continue
        began, began_thread = time.perf_counter(), time.thread_time()
        began_epoch = time.time()
        prefill, events = system.step()
        ended = time.perf_counter()
        if trace is not None:
            done = sum(1 for _, finished in events if finished)
            inner = getattr(system, "inner", None)  # the generator's next(), timed
            next_ms = f"{1000 * inner.calls[-1]:.2f}" if inner and inner.calls else "-"
            trace.append(
                f"S {began_epoch:.4f} {began_epoch + ended - began:.4f} {len(events)} {done} "
                f"{int(prefill)} - {next_ms}\n"
            )
        thread += time.thread_time() - began_thread
        probes.append(cpu_probe_us())  # this core's speed now (outside the step's timing)
        step_s.append(ended - began)
        decode_only.append(not prefill)
        for i, finished in events:
            tokens += 1
            first_token.setdefault(i, ended)
            if finished and todo:
                due = ended + delay + rng.uniform(0.0, jitter)
                bisect.insort(arrivals, (due, todo.popleft()))
    wall = time.perf_counter() - t0
    cpu = self_cpu_s() - cpu0
    memory = memory_figures()
    ttft = [first_token[i] - arrived[i] for i in first_token]
    decode = [s for s, d in zip(step_s, decode_only, strict=True) if d]
    inner = system.inner.calls if system.inner is not None else None
    out = {
        "tok_s": round(tokens / wall, 1) if wall else None,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "steps": len(step_s),
        "prefill_steps": len(step_s) - len(decode),
        "ms_per_step": _ms(sum(step_s) / len(step_s)) if step_s else None,
        "decode_step_p50_ms": _ms(statistics.median(decode)) if decode else None,
        "decode_step_p90_ms": _ms(percentile(decode, 90)),
        # Outside the generator's next(): our engine's own work in each step.
        "outside_next_ms_per_step": (
            _ms((sum(step_s) - sum(inner)) / len(step_s)) if inner and step_s else None
        ),
        # The same in engine-thread CPU (on a busy CPU the wall time counts waits too).
        "outside_next_cpu_ms_per_step": (
            _ms((thread - system.inner.cpu_s) / len(step_s)) if inner and step_s else None
        ),
        "thread_ms_per_step": _ms(thread / len(step_s)) if step_s else None,
        "cpu_ms_per_token": round(1000 * cpu / tokens, 3) if tokens else None,
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "probe_us_p50": round(statistics.median(probes), 1) if probes else None,
        **memory,
    }
    out.update(system.finish())
    return out


# ------------------------------------------------------------------- ceiling


class Ceiling(Driven):
    """mlx-lm's ``BatchGenerator``, as ``engine_ceiling.Engine.run`` drives it.

    A finished sequence's KV cache (which mlx-lm extracts for every finished
    sequence) is dropped. Greedy rows use the generator's own sampler; sampled
    workloads (``--temperature``, ``--mixed-sampling``) give requests with the
    same parameters one shared mlx-lm sampler (``engine_ceiling.Engine.samplers``:
    mlx-lm samples them in one call, its best case)."""

    name = "ceiling"

    def __init__(self, model_path: str, decode_concurrency: int, prompt_concurrency: int):
        from engine_ceiling import Engine

        self.engine = Engine(model_path, decode_concurrency, prompt_concurrency)

    def start(self, w: Workload, requests: int, first: int) -> None:
        from mlx_lm.generate import BatchGenerator

        e = self.engine
        self.max_tokens = w.max_tokens
        self.prompts = [e.prompt_ids(w, first + i) for i in range(requests)]
        self.samplers = e.samplers(w, first, requests)
        self.gen = BatchGenerator(
            e.model,
            completion_batch_size=e.decode_concurrency,
            prefill_batch_size=e.prompt_concurrency,
            stream=e.stream,
        )
        self.inner = Timed(self.gen.next)
        self.by_uid: dict[int, int] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.by_uid)

    def admit(self, i: int) -> None:
        sampler = self.samplers[i]
        (uid,) = self.gen.insert(
            [self.prompts[i]],
            max_tokens=[self.max_tokens],
            samplers=None if sampler is None else [sampler],
            stop_sequences=[self.engine.stop],
        )
        self.by_uid[uid] = i

    def step(self) -> tuple[bool, list[tuple[int, bool]]]:
        prompt_responses, responses = self.inner()
        events = []
        for r in responses:
            finished = r.finish_reason is not None
            events.append((self.by_uid.pop(r.uid) if finished else self.by_uid[r.uid], finished))
        return bool(prompt_responses), events

    def finish(self) -> dict[str, Any]:
        self.gen.close()
        self.gen = None
        return {}


# ---------------------------------------------------------------------- core

CORE_VARIANTS = {
    "core": "as the server builds it",
    "core-lazy": "prompt-cache entries stored as mlx-lm hands them over (unevaluated slices "
    "that keep the batch's arrays alive)",
    "core-each": "each prompt-cache entry's copy started as it is stored (one evaluation "
    "per entry instead of one per step)",
    "core-nocache": "no prompt-cache entries stored (the ceiling drops them too)",
    "core-nowindow": "--admission-window-ms 0",
    "core-nohold": "the window without the first-token hold",
    "core-g0": "--prefill-group-tokens 0 (mlx-lm's prefill groups)",
    "core-storeall": "every prompt-cache entry stored, also those the count limit evicts at "
    "once (instead of passed over)",
}


class Core(Driven):
    """Our ``EngineCore``, built as the server builds it, driven in-process (or a variant).

    Each step's ``StepOutputs`` is pickled as the engine process sends it (timed
    apart from the step), and the prompt-cache policy's decisions are applied
    between steps (``actors.prompt_cache.PromptCachePolicy``, the server's limits),
    as the Scheduler hands them over."""

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
        elif variant == "core-g0":
            flags["prefill_group_tokens"] = 0
        self.config = ServerConfig(model=model_path, decode_concurrency=decode_concurrency, **flags)
        self.core = make_engine_core(self.config, model_path)
        entries = self.core.cache_entries
        if variant == "core-nocache":
            entries.insert = lambda *args, **kwargs: None
        elif variant == "core-lazy":
            entries._store = _lazy(entries)
        elif variant == "core-each":
            entries._store = _each(entries)
        elif variant == "core-storeall":  # every entry stored, the count limit's too
            entries.max_entries = None
        elif variant == "core-nohold":
            self.core._awaiting_first = _NeverAwaiting()
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
            temperature, top_p = sampling_of(w, first + i)
            out.append(
                Submit(
                    request_id=self.next_request_id,
                    prompt=prepared.tokens,
                    segments=prepared.plan.segments,
                    segment_types=prepared.plan.segment_types,
                    sampling=SamplingParams(temperature=temperature, top_p=top_p),
                    max_tokens=w.max_tokens,
                )
            )
            self.next_request_id += 1
        return out

    def start(self, w: Workload, requests: int, first: int) -> None:
        from actors.prompt_cache import PromptCachePolicy

        self.todo = self.submits(w, first, requests)
        self.index = {sub.request_id: i for i, sub in enumerate(self.todo)}
        self.policy = PromptCachePolicy(
            max_entries=self.config.prompt_cache_size,
            max_bytes=self.config.prompt_cache_bytes,
            min_reuse=self.config.prompt_cache_min_reuse,
        )
        self.policy.engine_changed(self.core.handle.info.model_key)
        self.inner = Timed(self.core._batch.next)
        self.core._batch.next = self.inner
        self.pickle_s = 0.0
        self.steps = 0

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def admit(self, i: int) -> None:
        self.core.handle_command(self.todo[i])

    def step(self) -> tuple[bool, list[tuple[int, bool]]]:
        from multiprocessing.reduction import ForkingPickler

        from runtime.messages import EvictCache

        calls = len(self.inner.calls)
        outputs = self.core.step()
        if len(self.inner.calls) == calls:
            self.inner.calls.append(0.0)  # no generator call (the window held everything)
        self.steps += 1
        if self.pickle_outputs:
            began = time.perf_counter()
            ForkingPickler.dumps(outputs)
            self.pickle_s += time.perf_counter() - began
        outputs, evicted = self.policy.on_step(outputs)
        if evicted:
            self.core.handle_command(EvictCache(entry_ids=evicted))
        if outputs.failed or outputs.aborted:
            raise RuntimeError(f"requests failed: {outputs.failed or outputs.aborted}")
        events = [(self.index[e.request_id], e.finish_reason is not None) for e in outputs.tokens]
        return bool(outputs.progress), events

    def finish(self) -> dict[str, Any]:
        from runtime.messages import EvictCache

        core = self.core
        core._batch.next = self.inner.fn
        # Every run starts with an empty prompt cache.
        core.handle_command(EvictCache(entry_ids=tuple(core.cache_entries.held())))
        core.cache_entries.take_events()
        return {"pickle_ms_per_step": _ms(self.pickle_s / self.steps) if self.steps else None}


class _NeverAwaiting(set):
    """``EngineCore._awaiting_first`` that stays empty: no first-token hold."""

    def add(self, item) -> None:
        pass


def _lazy(entries):
    """``CacheEntries._store`` that leaves the entry a lazy slice (no copy is ever started)."""
    store = entries._store

    def lazy_store(*args, **kwargs):
        store(*args, **kwargs)
        entries._unowned.clear()

    return lazy_store


def _each(entries):
    """``CacheEntries._store`` that starts each entry's copy at once (one evaluation per entry)."""
    store = entries._store

    def store_and_settle(*args, **kwargs):
        store(*args, **kwargs)
        entries.settle()

    return store_and_settle


# -------------------------------------------------------------------- server


def _per_token(cpu_s: float | None, tokens: int) -> float | None:
    return round(1000 * cpu_s / tokens, 3) if cpu_s is not None and tokens else None


class Server:
    """``python -m api.cli`` over HTTP (the whole server) at the same level."""

    def __init__(
        self,
        model_path: str,
        decode_concurrency: int,
        log_dir: Path,
        engine_cpu: int | None = None,
        other_cpus: set[int] | None = None,
        *,
        name: str = "server",
        repo: Path = REPO,
        extra_args: Sequence[str] = (),
    ):
        import socket

        self.name = name

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
            *extra_args,
        ]
        self.proc = ServerProcess(
            name, argv, f"http://127.0.0.1:{port}", log_dir / f"server-{port}.log"
        )
        # each engine step's host-speed probe (runtime.engine.host_speed), read per run
        self.probe_prefix = str(log_dir / f"probe-{port}")
        self.proc.start(cwd=str(repo), env={PROBE_ENV: self.probe_prefix})
        try:
            self._ready(model_path, engine_cpu, other_cpus)
        except BaseException:
            self.proc.stop()
            raise

    def _ready(self, model_path: str, engine_cpu: int | None, other_cpus: set[int] | None) -> None:
        self.proc.wait_healthy()
        self.builder = PromptBuilder(model_path)
        if engine_cpu is not None:
            api = self.proc.pid
            engines = [
                c
                for c in descendants(api)
                if b"runtime.engine.process" in Path(f"/proc/{c}/cmdline").read_bytes()
            ]
            if not engines:
                raise RuntimeError("--engine-cpu: the server has no engine process")
            pin_process(api, other_cpus)
            for pid in engines:
                # Its main thread only (the engine loop's), as an in-process system pins only
                # the thread that drives it: CUDA's and MLX's helper threads keep their CPUs in
                # both (with them on the engine's CPU too, the server's 32-row decode steps
                # took 14 % longer than the ceiling's on the H200; main thread only, 5 %).
                os.sched_setaffinity(pid, {engine_cpu})

    def warm_up(self, w: Workload) -> None:
        warm_up(self.proc.url, w, self.builder)

    def _logged_between(self, suffix: str, at: int, began: float, ended: float) -> list[list[str]]:
        """The engine process's log lines (``PREFIX<suffix>.PID``, split) whose field ``at``,
        an epoch time, lies between ``began`` and ``ended``, in time order."""
        prefix = Path(self.probe_prefix)
        rows = [
            line.split()
            for path in prefix.parent.glob(prefix.name + suffix + ".*")
            for line in path.read_text().splitlines()
        ]
        kept = (r for r in rows if began <= float(r[at]) <= ended)
        return sorted(kept, key=lambda r: float(r[at]))

    def probes_between(self, began: float, ended: float) -> list[float]:
        """The engine process's probes of the steps between two epoch times."""
        return [float(probe) for _, probe in self._logged_between("", 0, began, ended)]

    def steps_between(self, began: float, ended: float) -> list[str]:
        """The engine process's step and command lines (``ProbeLog.trace_steps``) in a run."""
        return [" ".join(r) + "\n" for r in self._logged_between("-steps", 1, began, ended)]

    def run(self, w: Workload, concurrency: int, requests: int, first: int) -> dict[str, Any]:
        began = time.time()
        r = run_level(self.proc.url, w, concurrency, requests, self.builder, self.proc.pid, first)
        ended = time.time()
        time.sleep(0.7)  # the engine writes its probes every half second
        probes = self.probes_between(began, ended)
        self.last_steps = self.steps_between(began, ended)
        # The API's record of each request (``api.observability.RequestTrace``) and the
        # load generator's, joined by the x-request-id it sends (``loadgen-INDEX``).
        self.last_steps += [" ".join(r) + "\n" for r in self._logged_between("-api", 2, began, ended)]
        self.last_steps += [
            "L loadgen-{} {}\n".format(
                index, " ".join("-" if t is None else f"{t:.4f}" for t in (sent, first, end))
            )
            for index, sent, first, end in r.get("request_epochs", ())
        ]
        tokens = r["completion_tokens"]
        steps = int(r["engine_steps"]) if r.get("engine_steps") is not None else None
        busy = r.get("engine_busy_s")
        return {
            "tok_s": round(tokens / r["wall_s"], 1),
            "tokens": tokens,
            "wall_s": round(r["wall_s"], 3),
            "steps": steps,
            "prefill_steps": int(r.get("engine_prefill_steps") or 0),
            "ms_per_step": _ms(busy / steps) if steps and busy else None,
            "cpu_ms_per_token": _per_token(r.get("cpu_s") or None, tokens),
            # Where the server's CPU goes (JSON only): the API process, the rest of the
            # tree (the engine process), and the load generator's own.
            "api_cpu_ms_per_token": _per_token(r.get("root_cpu_s"), tokens),
            "engine_process_cpu_ms_per_token": _per_token(
                r["cpu_s"] - r["root_cpu_s"] if r.get("cpu_s") and r.get("root_cpu_s") else None,
                tokens,
            ),
            "client_cpu_ms_per_token": _per_token(r.get("client_cpu_s"), tokens),
            "ttft_p50_ms": _ms(percentile(r["ttft_s"], 50)),
            "ttft_p99_ms": _ms(percentile(r["ttft_s"], 99)),
            "errors": r["errors"],
            "probe_us_p50": round(statistics.median(probes), 1) if probes else None,
            "probes": len(probes),
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
        f"{f('outside_next_ms_per_step', '.2f'):>8} {f('outside_next_cpu_ms_per_step', '.2f'):>7} "
        f"{f('pickle_ms_per_step', '.2f'):>7} "
        f"{f('thread_ms_per_step', '.2f'):>7} {f('cpu_ms_per_token', '.3f'):>8} "
        f"{f('ttft_p50_ms', '.1f'):>7} {f('ttft_p99_ms', '.1f'):>7} "
        f"{f('peak_mib', '.0f'):>7} {f('active_mib', '.0f'):>7}"
    )


HEADER = (
    f"{'conc':>4} {'system':<13} {'tok/s':>8} {'steps':>6} {'pre':>5} "
    f"{'ms/step':>8} {'dec p50':>8} {'outside':>8} {'out cpu':>7} {'pickle':>7} {'thr/st':>7} "
    f"{'cpu/tok':>8} "
    f"{'ttft50':>7} {'ttft99':>7} {'peakMiB':>7} {'actMiB':>7}"
)
LEGEND = """\
tok/s: output tokens per second; steps, pre: engine steps, of which prefill;
ms/step: mean step; dec p50: median decode-only step; outside: ms per step in our
engine outside mlx-lm's next() (out cpu: the engine thread's CPU ms of it);
pickle: ms per step to pickle StepOutputs (the
engine process's send); thr/st: engine thread CPU ms per step; cpu/tok: process
CPU ms per token; ttft50/99: ms from arrival to first token; peak/actMiB: MLX
memory, peak during the run and active at its end (the server: tok/s, steps,
ms/step from /metrics, TTFT and CPU at the client; its JSON splits the CPU per
token into the API process, the engine process and the load generator)."""


def summary(results: dict[str, dict[str, list]]) -> str:
    keys = (
        "tok_s",
        "ms_per_step",
        "decode_step_p50_ms",
        "outside_next_ms_per_step",
        "outside_next_cpu_ms_per_step",
        "thread_ms_per_step",
        "ttft_p50_ms",
        "peak_mib",
        "probe_us_p50",
    )
    lines = ["medians over rounds (min-max): " + ", ".join(keys)]
    for level, by_system in results.items():
        for name, runs in by_system.items():
            cells = []
            for key in keys:
                values = [r[key] for r in runs if r.get(key) is not None]
                if not values:
                    cells.append("-")
                    continue
                cells.append(
                    f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
                )
            lines.append(f"{level:>4} {name:<13} " + " | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="bare BatchGenerator vs EngineCore, per step")
    p.add_argument("--model", default=None, help="model dir (default: build one, see --medium)")
    p.add_argument("--medium", action="store_true", help="build hidden 256 / 4 layers")
    p.add_argument(
        "--systems",
        default="ceiling,core",
        help="comma list of ceiling and core variants (empty: the servers alone): "
        + "; ".join(f"{k}: {v}" for k, v in CORE_VARIANTS.items()),
    )
    p.add_argument("--server", action="store_true", help="also the whole server over HTTP")
    p.add_argument(
        "--server-variant",
        action="append",
        default=[],
        metavar="NAME[@DIR][:ARGS]",
        help="also a server named NAME, run from the source tree DIR (default: this one) "
        "with the extra command-line ARGS (e.g. 'w10:--admission-window-ms 10', "
        "'before@/tmp/before'); repeatable",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--decode-concurrency", type=int, default=64)
    p.add_argument("--prompt-concurrency", type=int, default=8)
    p.add_argument("--admission-window-ms", type=float, default=None, help="the core's")
    p.add_argument(
        "--arrival-jitter-ms",
        type=float,
        default=0.0,
        help="in-process systems: plus a uniform random delay up to this (the same draws for "
        "every system)",
    )
    p.add_argument(
        "--arrival-delay-ms",
        type=float,
        default=0.0,
        help="in-process systems: a finished request's replacement arrives this much later "
        "(0: before the next step; an HTTP client comes back after a few ms)",
    )
    p.add_argument(
        "--first-wave-ms",
        type=float,
        default=0.0,
        help="in-process systems: the first requests arrive spread uniformly over this many "
        "ms (0: all before the first step), as a burst reaches a server over HTTP",
    )
    p.add_argument("--no-pickle", action="store_true", help="do not pickle the core's outputs")
    p.add_argument("--profile", default=None, help="write cProfile stats of the last round here")
    p.add_argument("--json-out", default=None)
    p.add_argument(
        "--trace",
        default=None,
        help="write each run's steps and arrivals here (<system>-c<level>-r<round>.txt: "
        "'S began ended tokens finished prefill -' per step, 'C epoch Submit request' per "
        "arrival; a server's from its engine process)",
    )
    p.add_argument(
        "--engine-cpu",
        type=int,
        default=None,
        help="run every engine (in-process and the server's engine process) on this CPU, "
        "the rest on the others",
    )
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
    for name in filter(None, ns.systems.split(",")):  # "": the servers alone
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
    others = None
    if ns.engine_cpu is not None:
        others = os.sched_getaffinity(0) - {ns.engine_cpu}
        if ns.engine_cpu not in os.sched_getaffinity(0) or not others:
            raise SystemExit(f"--engine-cpu {ns.engine_cpu}: not one of several allowed CPUs")
    profile_dir = Path(ns.profile) if ns.profile else None
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
    trace_dir = Path(ns.trace) if ns.trace else None
    if trace_dir:
        trace_dir.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict[str, list]] = {}
    first = 0
    try:  # a server started before a failure is stopped below
        if ns.server:
            systems["server"] = Server(
                model, ns.decode_concurrency, BENCH / "results" / "logs", ns.engine_cpu, others
            )
        for spec in ns.server_variant:
            name, _, args = spec.partition(":")
            name, _, tree = name.partition("@")
            systems[name] = Server(
                model,
                ns.decode_concurrency,
                BENCH / "results" / "logs",
                ns.engine_cpu,
                others,
                name=name,
                repo=Path(tree) if tree else REPO,
                extra_args=shlex.split(args),
            )
        for system in systems.values():  # first-call costs off the clock
            warm = Workload(prompt_tokens=w.prompt_tokens, max_tokens=4, seed=w.seed + 1000)
            if isinstance(system, Server):
                system.warm_up(w)
            else:
                closed_loop(system, warm, 2, 2, 10_000_000, 0.0)
        sys.stdout.write(LEGEND + "\n\n" + HEADER + "\n")
        for level in ns.levels:
            requests = requests_for(ns, level)
            for rnd in range(ns.rounds):
                order = list(systems) if rnd % 2 == 0 else list(reversed(systems))
                for name in order:
                    if others is not None:  # the engine's CPU for an in-process engine only
                        os.sched_setaffinity(
                            0, others if isinstance(systems[name], Server) else {ns.engine_cpu}
                        )
                    profiler = None
                    if profile_dir and rnd == ns.rounds - 1 and not isinstance(
                        systems[name], Server
                    ):
                        profiler = cProfile.Profile()
                        profiler.enable()
                    trace: list[str] | None = [] if trace_dir else None
                    if isinstance(systems[name], Server):
                        r = systems[name].run(w, level, requests, first)
                        trace = systems[name].last_steps if trace_dir else None
                    else:
                        delay = ns.arrival_delay_ms / 1000
                        jitter = ns.arrival_jitter_ms / 1000
                        r = closed_loop(
                            systems[name], w, level, requests, first, delay, jitter, trace,
                            ns.first_wave_ms / 1000,
                        )
                    if trace_dir and trace is not None:
                        (trace_dir / f"{name}-c{level}-r{rnd}.txt").write_text("".join(trace))
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
        for system in systems.values():
            if isinstance(system, Server):
                system.close()
    sys.stdout.write("\n" + summary(results) + "\n")
    if ns.json_out:
        meta = {
            "model": model,
            "workload": w.__dict__,
            "levels": ns.levels,
            "rounds": ns.rounds,
            "arrival_delay_ms": ns.arrival_delay_ms,
            "arrival_jitter_ms": ns.arrival_jitter_ms,
            "first_wave_ms": ns.first_wave_ms,
            "engine_cpu": ns.engine_cpu,
            "argv": sys.argv,
        }
        Path(ns.json_out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
