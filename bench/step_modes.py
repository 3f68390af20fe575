"""One sequence through a bare mlx-lm ``BatchGenerator``: the step time, rep by rep.

Owns the measurement of the bimodal step: at batch 1 the decode
step is bimodal (about 6 or 10 ms on the Llama-3-8B shape) for every driver.
Each rep inserts one prompt (the load generator's, ``--prompt-tokens``) and
decodes ``--max-tokens`` greedily; the step time is the wall time between two
``next()`` calls that return a token. Per rep it prints the median and the
10th / 90th percentiles, and the share of the step spent in Python building
the graph (thread CPU time) against waiting for the GPU.

``--variants`` runs each named variant in a fresh process (environment
variables are read once by MLX), alternating variants rep by rep so that a
mode flip cannot pass for a difference between variants:

  default      as installed
  no-graphs    MLX_USE_CUDA_GRAPHS=0 (kernels launched one by one)
  one-graph    MLX_MAX_OPS_PER_BUFFER=100000 MLX_MAX_MB_PER_BUFFER=100000
               (a whole step in one CUDA graph)
  gc-off       Python's cyclic garbage collector disabled during the loop

  python bench/step_modes.py --model M --variants default,one-graph --reps 5
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.engine.host_speed import cpu_probe_us  # noqa: E402

VARIANT_ENV = {
    "default": {},
    "no-graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
    "one-graph": {"MLX_MAX_OPS_PER_BUFFER": "100000", "MLX_MAX_MB_PER_BUFFER": "100000"},
    "gc-off": {"STEP_MODES_GC_OFF": "1"},
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_rep(gen, prompt: list[int], max_tokens: int, stop) -> dict:
    (uid,) = gen.insert([prompt], max_tokens=[max_tokens], stop_sequences=[stop])
    steps, cpu, probes = [], [], []
    last_wall = last_cpu = None
    done = False
    while not done:
        _, responses = gen.next()
        probes.append(cpu_probe_us())
        now, now_cpu = time.perf_counter(), time.thread_time()
        for r in responses:
            if r.uid != uid:
                continue
            if last_wall is not None:
                steps.append(now - last_wall)
                cpu.append(now_cpu - last_cpu)
            last_wall, last_cpu = now, now_cpu
            done = r.finish_reason is not None
    ms = [s * 1000 for s in steps]
    return {
        "tokens": len(steps) + 1,
        "p10_ms": percentile(ms, 0.1),
        "p50_ms": statistics.median(ms),
        "p90_ms": percentile(ms, 0.9),
        "cpu_share": sum(cpu) / sum(steps) if steps else 0.0,
        "probe_us_p50": statistics.median(probes),
        "steps_ms": [round(x, 3) for x in ms],
        # one per next() call, so a step's probe is the one just before its end
        "probes_us": [round(x, 2) for x in probes],
    }


def run_worker(ns) -> int:
    """In a fresh process: load, warm up, then ``--reps`` reps (one JSON line each)."""
    import mlx.core as mx
    from loadgen import PromptBuilder, Workload
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator, make_stop_sequences

    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        model, tokenizer = load(ns.model)
    stop = make_stop_sequences(tokenizer)
    builder = PromptBuilder(ns.model)
    w = Workload(prompt_tokens=ns.prompt_tokens, max_tokens=ns.max_tokens, endpoint="chat",
                 system_prompt_tokens=0, seed=0)
    gen = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=8, stream=stream)

    def prompt(i: int) -> list[int]:
        return list(tokenizer.apply_chat_template(
            builder.messages(w, i), add_generation_prompt=True, tokenize=True))

    one_rep(gen, prompt(10_000), 16, stop)  # warm-up: kernels compile on first use
    if os.environ.get("STEP_MODES_GC_OFF"):
        gc.collect()
        gc.disable()
    for rep in range(ns.reps):
        result = one_rep(gen, prompt(rep), ns.max_tokens, stop)
        sys.stdout.write(json.dumps({"rep": rep, **result}) + "\n")
        sys.stdout.flush()
        if ns.pause:
            time.sleep(ns.pause)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--variants", default="default")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="fresh processes per variant")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=136)
    p.add_argument("--pause", type=float, default=0.0, help="seconds between reps")
    p.add_argument("--json-out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        return run_worker(ns)
    results: dict[str, list[dict]] = {}
    variants = ns.variants.split(",")
    for round_ in range(ns.rounds):
        for name in variants:
            env = {**os.environ, **VARIANT_ENV[name]}
            cmd = [sys.executable, __file__, "--worker", "--model", ns.model, "--reps", str(ns.reps),
                   "--max-tokens", str(ns.max_tokens), "--prompt-tokens", str(ns.prompt_tokens),
                   "--pause", str(ns.pause)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            reps = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode != 0:
                sys.stderr.write(out.stderr[-2000:])
            for r in reps:
                r["round"] = round_
            results.setdefault(name, []).extend(reps)
            line = " ".join(f"{r['p50_ms']:.2f}" for r in reps)
            cpu = " ".join(f"{r['cpu_share']:.2f}" for r in reps)
            probe = " ".join(f"{r['probe_us_p50']:.1f}" for r in reps)
            print(f"round {round_} {name:10s} p50 ms/step: {line}   cpu share: {cpu}   "
                  f"probe us: {probe}", flush=True)
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
