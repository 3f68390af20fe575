"""Engine ceiling: the benchmark workload through mlx-lm's ``BatchGenerator`` in-process.

Owns the upper bound a server can reach: no HTTP, no detokenizing, no JSON. The
prompts are the load generator's (``loadgen.PromptBuilder``, same seed, same word
list) turned into tokens with the model's own tokenizer and chat template, as
both servers do; ``max_tokens``, the greedy sampler (temperature 0), the EOS stop
sequences and the batch sizes (``completion_batch_size`` = decode concurrency,
``prefill_batch_size`` = prompt concurrency) match the servers' defaults.

A closed loop keeps ``concurrency`` sequences in flight: each finished sequence
is replaced by the next request at once, until ``requests`` are done. Measured:
output tokens/s (every generated token, EOS included, as the servers' usage
counts), TTFT (insert to first token), inter-token gaps, end-to-end latency and
CPU seconds per token (``resource.getrusage``, the whole process, measured loop
only; model load and a short warm-up are excluded).

``python bench/engine_ceiling.py --model M --levels 1,4`` prints one line per
level; ``--json-out`` writes raw runs that ``loadgen.summarize`` pools.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import (  # noqa: E402
    PromptBuilder,
    Workload,
    add_workload_args,
    format_summary,
    requests_for,
    self_cpu_s,
    setup_logging,
    summarize,
    workload_from_args,
)

log = logging.getLogger("bench.engine")


class Engine:
    """A loaded model and a ``BatchGenerator`` factory with the servers' settings."""

    def __init__(self, model_path: str, decode_concurrency: int = 64, prompt_concurrency: int = 8):
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import make_stop_sequences

        self.stream = mx.new_stream(mx.default_device())
        with mx.stream(self.stream):
            self.model, self.tokenizer = load(model_path)
        self.stop = make_stop_sequences(self.tokenizer)
        self.decode_concurrency = decode_concurrency
        self.prompt_concurrency = prompt_concurrency
        self.builder = PromptBuilder(model_path)

    def prompt_ids(self, w: Workload, index: int) -> list[int]:
        if w.endpoint == "chat":
            ids = self.tokenizer.apply_chat_template(
                self.builder.messages(w, index), add_generation_prompt=True, tokenize=True
            )
            return list(ids)
        return list(self.tokenizer.encode(self.builder.text_prompt(w, index)))

    def run(
        self,
        w: Workload,
        concurrency: int,
        requests: int,
        first_index: int = 0,
        arrival_delay_steps: int = 0,
    ) -> dict[str, Any]:
        """``arrival_delay_steps``: a finished sequence's replacement arrives that many
        steps later (0: in the same step, the ideal; HTTP clients take a step or two)."""
        from mlx_lm.generate import BatchGenerator

        prompts = [self.prompt_ids(w, first_index + i) for i in range(requests)]
        gen = BatchGenerator(
            self.model,
            completion_batch_size=self.decode_concurrency,
            prefill_batch_size=self.prompt_concurrency,
            stream=self.stream,
        )
        todo = deque(range(requests))
        live: dict[int, dict[str, Any]] = {}
        ttft, itl, e2e, tpot = [], [], [], []
        tokens = 0

        samplers = self.samplers(w, first_index, requests)

        def submit() -> None:
            i = todo.popleft()
            (uid,) = gen.insert(
                [prompts[i]],
                max_tokens=[w.max_tokens],
                stop_sequences=[self.stop],
                samplers=[samplers[i]],
            )
            live[uid] = {"start": time.perf_counter(), "times": []}

        cpu0 = self_cpu_s()
        t0 = time.perf_counter()
        for _ in range(min(concurrency, requests)):
            submit()
        steps = prefill_steps = 0
        arrivals: deque[int] = deque()  # the step at which each pending replacement arrives
        while live or arrivals:
            while arrivals and arrivals[0] <= steps:
                arrivals.popleft()
                submit()
            prompt_responses, responses = gen.next()
            steps += 1
            prefill_steps += bool(prompt_responses)
            now = time.perf_counter()
            for r in responses:
                seq = live[r.uid]
                seq["times"].append(now)
                if r.finish_reason is None:
                    continue
                del live[r.uid]
                times = seq["times"]
                tokens += len(times)
                ttft.append(times[0] - seq["start"])
                itl.extend(b - a for a, b in zip(times, times[1:], strict=False))
                e2e.append(now - seq["start"])
                if len(times) > 1:
                    tpot.append((times[-1] - times[0]) / (len(times) - 1))
                if todo and len(arrivals) < len(todo):
                    if arrival_delay_steps:
                        arrivals.append(steps + arrival_delay_steps)
                    else:
                        submit()
        wall = time.perf_counter() - t0
        cpu = self_cpu_s() - cpu0
        gen.close()
        return {
            "requests": requests,
            "completion_tokens": tokens,
            "content_chunks": tokens,
            "wall_s": wall,
            "errors": {},
            "ttft_s": ttft,
            "itl_s": itl,
            "e2e_s": e2e,
            "tpot_s": tpot,
            "prompt_tokens": [len(p) for p in prompts],
            "cpu_s": cpu,
            "engine_busy_s": wall,  # the engine steps all the time here
            "engine_steps": steps,
            "engine_prefill_steps": prefill_steps,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }

    @staticmethod
    def samplers(w: Workload, first_index: int, requests: int) -> list:
        """Per request, mlx-lm's sampler for its parameters; requests with the same
        parameters share one object, so mlx-lm samples them in one call (its best case:
        the ceiling for sampled workloads). Greedy: ``None`` (the batch's own)."""
        from loadgen import sampling_of
        from mlx_lm.sample_utils import make_sampler

        shared: dict[tuple[float, float], object] = {}
        out = []
        for i in range(requests):
            params = sampling_of(w, first_index + i)
            if params[0] == 0:
                out.append(None)
                continue
            if params not in shared:
                shared[params] = make_sampler(params[0], top_p=params[1])
            out.append(shared[params])
        return out

    def warm_up(self, w: Workload) -> None:
        warm = Workload(
            prompt_tokens=w.prompt_tokens,
            max_tokens=4,
            endpoint=w.endpoint,
            system_prompt_tokens=w.system_prompt_tokens,
            seed=w.seed + 1000,
            temperature=w.temperature,
            top_p=w.top_p,
            mixed_sampling=w.mixed_sampling,
        )
        self.run(warm, 2, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="mlx-lm BatchGenerator ceiling, no HTTP.")
    p.add_argument("--model", required=True)
    p.add_argument("--decode-concurrency", type=int, default=64)
    p.add_argument("--prompt-concurrency", type=int, default=8)
    p.add_argument("--json-out", default=None, help="write the raw runs here")
    add_workload_args(p)
    p.add_argument("--first-index", type=int, default=0, help="of the workload's requests")
    p.add_argument(
        "--arrival-delay-steps",
        type=int,
        default=0,
        help="a finished request's replacement arrives this many steps later (default 0)",
    )
    ns = p.parse_args(argv)
    setup_logging()
    w = workload_from_args(ns)
    engine = Engine(ns.model, ns.decode_concurrency, ns.prompt_concurrency)
    engine.warm_up(w)
    raw = {}
    first_index = ns.first_index
    for level in ns.levels:
        n = requests_for(ns, level)
        run = engine.run(w, level, n, first_index, ns.arrival_delay_steps)
        first_index += n
        raw[level] = run
        if not ns.json_out:
            sys.stdout.write(format_summary(level, summarize([run])) + "\n")
            sys.stdout.flush()
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps({str(k): v for k, v in raw.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
