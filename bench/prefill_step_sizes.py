"""A lone prompt's prefill time by prefill step size, in-process, on MLX's default device.

Each repetition prefills one fresh prompt of ``--tokens`` tokens in chunks of each
step size in turn (alternated, so that a change in the machine's speed falls on all
of them), through the model's own KV cache and causal mask as mlx-lm's prefill runs
it: every chunk but the last evaluates only the cache, the last one also its logits.
Prints the median seconds per step size and writes them with every repetition
(``--json-out``). This is what ``--prefill-step-size``'s default by device rests on:

    python bench/prefill_step_sizes.py --model DIR --tokens 3120 --steps 256,512,1024,2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def prefill_seconds(mx, model, tokens, step: int) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    n = tokens.shape[1]
    began = time.perf_counter()
    for start in range(0, n - 1, step):
        model(tokens[:, start:min(start + step, n - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    mx.eval(model(tokens[:, n - 1:], cache=cache))
    return time.perf_counter() - began


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=3120, help="the prompt's length")
    p.add_argument("--steps", default="256,512,1024,2048", help="step sizes, comma list")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(ns.model)
    steps = [int(s) for s in ns.steps.split(",")]
    vocab = tokenizer.vocab_size
    tokens = mx.array([[(7 * i) % (vocab - 10) + 5 for i in range(ns.tokens)]])
    prefill_seconds(mx, model, tokens[:, :256], 128)  # the kernels' first use
    times: dict[int, list[float]] = {step: [] for step in steps}
    for _ in range(ns.reps):
        for step in steps:
            times[step].append(prefill_seconds(mx, model, tokens, step))
    result = {
        "device": str(mx.default_device()),
        "model": ns.model,
        "tokens": ns.tokens,
        "median_s": {step: round(statistics.median(t), 3) for step, t in times.items()},
        "reps_s": {step: [round(x, 3) for x in t] for step, t in times.items()},
    }
    for step, median in result["median_s"].items():
        print(f"step {step:>5}: {median:.3f} s  ({ns.tokens} tokens, {ns.reps} reps)")
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
