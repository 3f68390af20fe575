"""Where a paced prefill step's time goes, against a decode-only step's, in-process.

Drives the engine core as the server builds it (``make_engine_core``): ``--streams``
short prompts decode for ``--decode-steps`` steps (``decode_only_steps``), then a prompt
of ``--long-tokens`` arrives and every step until its prefill ends is timed
(``paced_steps``), after one unmeasured round of both. Per step it keeps the wall
time, the engine thread's CPU time and the prompt tokens the step prefilled; it
prints both phases' step times by percentile and, for the paced steps, by chunk.

Run under ``py-spy record --native --idle -f raw`` (``bench/device.sh paced-profile``), the
two phases are told apart by their Python function, and ``--summarize RAW`` prints
each phase's milliseconds a step by where the samples fell: MLX's CUDA graph work,
allocation, cuBLASLt, cuDNN, waiting for the device, the rest of MLX, Python; and by
the innermost Python frame. The difference between the phases is what a step that
carries a prefill chunk pays beyond a decode step.

    py-spy record --native --idle -r 100 -f raw -o prof.raw -- \\
        python bench/paced_step_profile.py --model DIR --long-tokens 30000 --json-out steps.json
    python bench/paced_step_profile.py --summarize prof.raw --steps steps.json

Without a profiler, ``--variants`` runs each named variant in a fresh process (MLX
reads its environment once), alternated round by round, and prints every run's
report: the step's wall time against the engine thread's CPU time says whether a
paced step waits (for the device, for a synchronisation) or builds its graph the
whole time (MLX's own waits block; ``blocking`` makes CUDA's other waits block too).
Variants (``VARIANTS``): MLX's CUDA graph settings (the server's ``--cuda-graphs``, and
one graph a step), CUDA's waits blocking, and the server's ``--cuda-memory-pool keep``
and ``--prefill-chunk-parts``.

    python bench/paced_step_profile.py --model DIR --long-tokens 16000 \
        --variants default,no-graphs,ops-only --rounds 2 --json-out variants.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("decode_only_steps", "paced_steps")
# The innermost native frame's category, first match wins (substrings of the symbol).
NATIVE_KINDS = (
    ("wait for the device", ("cuEventSynchronize", "cuStreamSynchronize", "cuCtxSynchronize",
                             "EventSynchronize", "StreamSynchronize", "sched_yield",
                             "condition_variable", "futex", "pthread_cond")),
    ("CUDA graphs", ("CommandEncoder", "add_graph_node", "add_kernel_node", "cuGraph",
                     "GraphExec", "GraphAdd", "cuLaunch")),
    ("allocation", ("cuMemAlloc", "cuMemFree", "malloc", "free", "Allocator", "allocator")),
    ("cuBLASLt", ("cublas",)),
    ("cuDNN / NVRTC", ("cudnn", "nvrtc")),
    ("MLX other", ("mlx::", "mlx_", "nanobind", "nb_func")),
)


# name: (environment, ServerConfig fields)
VARIANTS = {
    "default": ({}, {}),
    "no-graphs": ({}, {"cuda_graphs": "off"}),  # kernels launched one by one
    "one-graph": ({"MLX_MAX_OPS_PER_BUFFER": "100000", "MLX_MAX_MB_PER_BUFFER": "100000"}, {}),
    "ops-only": ({}, {"cuda_graphs": "ops"}),  # a CUDA graph ends by ops, not MB
    "parts-1": ({}, {"prefill_chunk_parts": 1}),  # a paced chunk's layers in one step
    "parts-4": ({}, {"prefill_chunk_parts": 4}),
    # CUDA's default memory pool keeps what it reserved (release threshold: all of it), so
    # that an allocation after a synchronisation maps no memory anew.
    "pool-kept": ({}, {"cuda_memory_pool": "keep"}),
    # The CUDA driver's own waits block too (MLX's do already): a step's CPU time is then
    # its host work.
    "blocking": ({"PACED_PROFILE_BLOCKING_WAITS": "1"}, {}),
    # The same, every chunk of one size (no pacer): what each size costs at every depth.
    **{f"blocking-{size}": ({"PACED_PROFILE_BLOCKING_WAITS": "1"},
                            {"decode_stall_factor": 0, "prefill_step_size": size})
       for size in (64, 128, 256)},
}


def blocking_cuda_waits() -> bool:
    """Make the CUDA driver's waits block the thread rather than spin (the primary
    contexts' CU_CTX_SCHED_BLOCKING_SYNC, set before MLX starts them; MLX's own waits
    block already), so that a step's thread CPU time leaves every wait out; whether
    every device took it."""
    from runtime.cuda_pool import cuda_devices

    found = cuda_devices()
    if found is None:
        return False
    driver, devices = found
    # The header's name for it since CUDA 11 (the first version refuses an active context).
    set_flags = getattr(driver, "cuDevicePrimaryCtxSetFlags_v2", None) or \
        driver.cuDevicePrimaryCtxSetFlags
    return not any(set_flags(device, 4) for device in devices)  # CU_CTX_SCHED_BLOCKING_SYNC


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def run(ns: argparse.Namespace) -> dict:
    # Before MLX starts a CUDA context.
    blocking = bool(os.environ.get("PACED_PROFILE_BLOCKING_WAITS")) and blocking_cuda_waits()
    from in_process import RandomPrompts

    from runtime.config import ServerConfig
    from runtime.engine.loading import make_engine_core
    from runtime.messages import Abort

    settings = json.loads(ns.config or "{}")
    core = make_engine_core(ServerConfig(model=ns.model, decode_concurrency=64, **settings),
                            ns.model)

    submit = RandomPrompts(core).submit

    def timed_step() -> tuple[float, float, Any]:
        began, cpu = time.perf_counter(), time.thread_time()
        out = core.step()
        return 1000 * (time.perf_counter() - began), 1000 * (time.thread_time() - cpu), out

    def decode_only_steps(count: int) -> list[list[float]]:
        return [list(timed_step()[:2]) for _ in range(count)]

    def paced_steps(long_id: int) -> list[list[float]]:
        steps, done = [], 0
        while done < ns.long_tokens:
            wall, cpu, out = timed_step()
            progress = [pp.done for pp in out.progress if pp.request_id == long_id]
            if progress or done:
                new = progress[-1] if progress else done
                steps.append([wall, cpu, new - done])
                done = new
        return steps

    def one_round() -> dict:
        for i in range(ns.streams):
            submit(100 + i, 100_000)
        for _ in range(20):  # the streams' prefill and first steps
            core.step()
        decode = decode_only_steps(ns.decode_steps)
        paced = paced_steps(submit(ns.long_tokens, 2))
        for request_id in list(core.active_request_ids):
            core.handle_command(Abort(request_id=request_id))
        while core.has_work:
            core.step()
        return {"decode_only": decode, "paced": paced, "blocking_waits": blocking}

    def warm_up() -> None:  # every shape met once; its samples are left out of the summary
        one_round()

    warm_up()
    return one_round()


def report(result: dict) -> str:
    decode, paced = result["decode_only"], result["paced"]
    out = ["CUDA's waits block the thread"] if result.get("blocking_waits") else []
    for name, steps in (("decode only", decode), ("paced", paced)):
        walls, cpus = [s[0] for s in steps], [s[1] for s in steps]
        out.append(f"{name:12s} {len(steps):4d} steps  wall p50 {percentile(walls, .5):6.1f} "
                   f"p90 {percentile(walls, .9):6.1f} p99 {percentile(walls, .99):6.1f} ms  "
                   f"thread CPU p50 {percentile(cpus, .5):6.1f} p90 {percentile(cpus, .9):6.1f}"
                   f"  total {sum(walls) / 1000:.2f} s, CPU {sum(cpus) / 1000:.2f} s")
    by_chunk = collections.defaultdict(list)
    for wall, cpu, tokens in paced:
        by_chunk[tokens].append((wall, cpu))
    for tokens in sorted(by_chunk):
        steps = by_chunk[tokens]
        out.append(f"  chunk {tokens:5d}: {len(steps):4d} steps, p50 "
                   f"{statistics.median(s[0] for s in steps):6.1f} ms, thread CPU "
                   f"{statistics.median(s[1] for s in steps):6.1f}")
    out += by_depth(paced)
    return "\n".join(out)


DEPTH_BUCKET = 4096  # tokens of the long prompt already prefilled, per line of ``by_depth``


def by_depth(paced: list) -> list[str]:
    """The paced steps' median wall and thread CPU time by how deep into the long prompt
    each began (``DEPTH_BUCKET`` tokens a line), with their median chunk: whether a
    step's cost follows the context its chunk attends to."""
    buckets, done = collections.defaultdict(list), 0
    for wall, cpu, tokens in paced:
        buckets[done // DEPTH_BUCKET].append((wall, cpu, tokens))
        done += tokens
    out = ["  by depth (tokens prefilled before the step):"]
    for bucket in sorted(buckets):
        steps = buckets[bucket]
        chunks = [s[2] for s in steps if s[2]]
        out.append(f"  {bucket * DEPTH_BUCKET:6d}+: {len(steps):4d} steps, p50 "
                   f"{statistics.median(s[0] for s in steps):6.1f} ms, thread CPU "
                   f"{statistics.median(s[1] for s in steps):6.1f}, chunk p50 "
                   f"{statistics.median(chunks) if chunks else 0:5.0f}")
    return out


def run_variants(ns: argparse.Namespace) -> dict:
    """Each of ``ns.variants`` in a fresh process, ``ns.rounds`` times, alternated;
    {variant: [each round's result]}."""
    import os
    import subprocess
    import tempfile

    names = ns.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    results: dict[str, list] = {name: [] for name in names}
    for round_ in range(ns.rounds):
        for name in names:
            env, settings = VARIANTS[name]
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                command = [sys.executable, __file__, "--model", ns.model,
                           "--streams", str(ns.streams), "--long-tokens", str(ns.long_tokens),
                           "--decode-steps", str(ns.decode_steps), "--cpu-blas", ns.cpu_blas,
                           "--config", json.dumps(settings), "--json-out", out.name]
                done = subprocess.run(command, env={**os.environ, **env}, text=True,
                                      capture_output=True)
                print(f"== round {round_} {name}", flush=True)
                if done.returncode:
                    print(done.stderr[-2000:], flush=True)
                    continue
                result = json.loads(Path(out.name).read_text())["result"]
            print(report(result), flush=True)
            results[name].append(result)
    return results


def native_kind(frame: str) -> str | None:
    for kind, needles in NATIVE_KINDS:
        if any(n in frame for n in needles):
            return kind
    return None


def summarize(raw: str, steps_file: str | None, top: int, warm_up: bool = False) -> str:
    """Each phase's samples by category, by innermost Python frame and by native symbol
    anywhere below it: as ms a step where ``steps_file`` gives the measured round's step
    counts, else (or for the warm-up round's samples) as shares of the phase's samples."""
    rate, steps = 100.0, {}
    if steps_file and not warm_up:
        data = json.loads(Path(steps_file).read_text())
        rate = data.get("rate", rate)
        steps = {"decode_only_steps": len(data["result"]["decode_only"]),
                 "paced_steps": len(data["result"]["paced"])}
    kinds = {p: collections.Counter() for p in PHASES}
    python = {p: collections.Counter() for p in PHASES}
    native = {p: collections.Counter() for p in PHASES}
    for line in open(raw):
        stack, _, count = line.rstrip().rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        names = [f.partition(" (")[0].rpartition(".")[2] for f in frames]
        phase = next((p for p in PHASES if p in names), None)
        if phase is None or ("warm_up" in names) != warm_up:
            continue
        n = int(count)
        last_python = max((i for i, f in enumerate(frames) if ".py:" in f), default=-1)
        python[phase][frames[last_python] if last_python >= 0 else "?"] += n
        below = frames[last_python + 1:]  # native frames under the innermost Python one
        kind = next((k for f in reversed(below) for k in [native_kind(f)] if k), None)
        kinds[phase][kind or ("Python" if not below else "other native")] += n
        symbols = {f.partition(" (")[0] for f in below if not f.startswith("0x")}
        for symbol in symbols:
            native[phase][symbol] += n
    unit = "ms a step" if steps else "% of the phase's samples"
    out = [f"{raw}: {'warm-up' if warm_up else 'measured'} round, {unit}"]
    for phase in PHASES:
        total = sum(kinds[phase].values())
        if steps:
            scale = 1000.0 / rate / max(1, steps[phase])
            head = f"{phase} ({steps[phase]} steps, {total} samples)"
        else:
            scale = 100.0 / max(1, total)
            head = f"{phase} ({total} samples)"
        out.append(head)
        out += [f"  {scale * n:7.2f}  {k}" for k, n in kinds[phase].most_common()]
        out.append("  by innermost Python frame:")
        out += [f"  {scale * n:7.2f}  {f}" for f, n in python[phase].most_common(top)]
        out.append("  by native symbol anywhere below it:")
        out += [f"  {scale * n:7.2f}  {f[:120]}" for f, n in native[phase].most_common(top)]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=30000)
    p.add_argument("--decode-steps", type=int, default=300)
    p.add_argument("--rate", type=float, default=100.0,
                   help="py-spy's samples a second (kept with --json-out for --summarize)")
    p.add_argument("--cpu-blas", default="openblas", choices=("openblas", "reference"),
                   help="on a Linux CPU, MLX's matrix products as the server's engine runs them")
    p.add_argument("--json-out")
    p.add_argument("--summarize", metavar="RAW", help="summarize a py-spy raw profile instead")
    p.add_argument("--steps", metavar="JSON", help="with --summarize: this run's --json-out")
    p.add_argument("--warm-up", action="store_true",
                   help="with --summarize: the warm-up round's samples (shares)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--config", help="JSON: more ServerConfig fields for the engine core")
    p.add_argument("--variants", help=f"comma-separated, each in a fresh process: {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=2, help="with --variants: rounds alternated")
    ns = p.parse_args()
    if ns.summarize:
        print(summarize(ns.summarize, ns.steps, ns.top, ns.warm_up))
        return 0
    if not ns.model:
        p.error("--model is required")

    from runtime.cpu_blas import load_into_this_process

    if ns.variants:
        results = run_variants(ns)
        if ns.json_out:
            Path(ns.json_out).write_text(json.dumps({"args": vars(ns), "variants": results}))
        return 0
    load_into_this_process(ns.cpu_blas)  # before MLX is imported
    result = run(ns)
    print(report(result), flush=True)
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps({"args": vars(ns), "rate": ns.rate,
                                                 "result": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
