"""Distributed serving benchmark: 2 ranks (tensor / pipeline) against one GPU and mlx_lm.server.

    python bench/distributed.py --model LLAMA_DIR [--pipeline-model QWEN2_DIR] \
        [--backend nccl] [--only tp,pp,single,single-pp,ref] [--levels 1,8,32,64] \
        [--max-tokens 128] [--prompt-tokens 120] [--out DIR]

Each configuration is started, checked for health, asked a few greedy
questions (the answers are compared with the single-process server's), run
through ``loadgen``'s closed-loop levels, and stopped:

* ``tp``: ``mlx.launch --backend B -n 2 -- mlx-trio-server --model LLAMA`` (tensor parallel)
* ``pp``: the same with ``--pipeline`` on PIPELINE_MODEL (mlx-lm 0.32's llama
  cannot be pipelined; a qwen2 of the same shape can)
* ``single``: mlx-trio-server on one GPU (``CUDA_VISIBLE_DEVICES=0``), LLAMA
* ``single-pp``: the same on PIPELINE_MODEL (greedy reference for ``pp``; no load)
* ``ref``: ``mlx_lm.server`` on one GPU, LLAMA

Every server gets ``--decode-concurrency 64``. Writes ``OUT/distributed.json``
(per configuration: command, load time, greedy answers, per-level figures) and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen import (  # noqa: E402
    PromptBuilder,
    ServerProcess,
    add_workload_args,
    format_summary,
    parse_levels,
    run_level,
    setup_logging,
    summarize,
    warm_up,
    workload_from_args,
)

log = logging.getLogger("bench.distributed")

GREEDY_PROMPTS = [
    "hello there",
    "what is the weather in Paris",
    "tell me about cats and dogs",
    "the time in Rome, please",
]


def launcher(backend: str) -> list[str]:
    return [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()",
            "--backend", backend, "-n", "2", "--env", "NCCL_NVLS_ENABLE=0", "--"]


def ours(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "api.cli", "--model", model, "--port", str(port),
            "--decode-concurrency", "64", "--log-level", "WARNING", *extra]


def configurations(ns) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (argv, extra environment)."""
    port = ns.port
    one_gpu = {"CUDA_VISIBLE_DEVICES": str(ns.gpu)}
    pp_model = ns.pipeline_model or ns.model
    backend = ["--distributed-backend", ns.backend]
    return {
        "tp": (launcher(ns.backend) + ours(ns.model, port, *backend), {}),
        "pp": (launcher(ns.backend) + ours(pp_model, port, *backend, "--pipeline"), {}),
        "single": (ours(ns.model, port), one_gpu),
        "single-pp": (ours(pp_model, port), one_gpu),
        "ref": ([sys.executable, "-m", "mlx_lm.server", "--model", ns.model, "--port", str(port),
                 "--decode-concurrency", "64"], one_gpu),
    }


def greedy_answers(url: str, max_tokens: int) -> list[list[int]]:
    """Token ids of greedy chat answers (via logprobs: exact, whatever the detokenizer does)."""
    out = []
    for prompt in GREEDY_PROMPTS:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": "default_model", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True,
        })
        r.raise_for_status()
        choice = r.json()["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        # Random-weight shaped models decode most ids as "!": keep the sampled
        # token's logprob too, which tells different tokens apart.
        out.append({"text": choice["message"].get("content") or "",
                    "tokens": [t.get("token") for t in content],
                    "logprobs": [round(t.get("logprob", 0.0), 4) for t in content]})
    return out


def agreement(a: list[dict], b: list[dict]) -> dict:
    """How far two sets of greedy answers agree: identical answers, common prefix in tokens."""
    same = sum(x["text"] == y["text"] for x, y in zip(a, b, strict=True))
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = 0
        pairs = zip(x["tokens"], y["tokens"], x.get("logprobs", []), y.get("logprobs", []),
                    strict=False)
        for s, t, ls, lt in pairs:
            # bf16 sums in another order move a logprob a little, a different token a lot
            if s != t or abs(ls - lt) > 0.1:
                break
            n += 1
        prefixes.append(n)
    return {"identical_text": same, "of": len(a), "common_prefix_tokens": prefixes}


def run_configuration(name, argv, env, ns, workload, builder, out_dir) -> dict:
    url = f"http://127.0.0.1:{ns.port}"
    server = ServerProcess(name, argv, url, out_dir / f"{name}.log")
    server.start(cwd=str(Path(__file__).resolve().parents[1]), env=env)
    result: dict = {"command": argv, "env": env}
    try:
        result["load_s"] = round(server.wait_healthy(timeout=900), 1)
        result["health"] = httpx.get(url + "/health", timeout=10).json()
        if name in ("tp", "pp") and "distributed" not in result["health"]:
            raise RuntimeError(f"{url} is not a distributed server: {result['health']}")
        result["greedy"] = greedy_answers(url, ns.greedy_tokens)
        if name in ns.no_load:
            return result
        warm_up(url, workload, builder)
        levels, first = {}, 0
        for level in ns.levels:
            n = ns.requests or max(ns.min_requests, level * ns.requests_per_client)
            s = summarize([run_level(url, workload, level, n, builder, server.pid, first)])
            first += n
            levels[level] = s
            log.info("%s %s", name, format_summary(level, s))
        result["levels"] = levels
    except Exception as exc:
        log.exception("%s failed", name)
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["log_tail"] = server.log_tail(40)
    finally:
        server.stop()
        # The launcher does not always take its ranks down with it.
        subprocess.run(
            ["pkill", "-9", "-f", f"(api.cli|mlx_lm.server).*--port {ns.port}"], check=False
        )
        time.sleep(3)  # ports and GPU memory released
    return result


def table(results: dict, levels: list[int]) -> str:
    names = [n for n in results if "levels" in results[n]]
    head = "| c | " + " | ".join(f"{n} tok/s" for n in names) + " | " + " | ".join(
        f"{n} TTFT p50 ms" for n in names) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(names))]
    for c in levels:
        row = [f"{results[n]['levels'][c]['tok_s']:.0f}" for n in names]
        row += [f"{results[n]['levels'][c]['ttft_p50_ms'] or 0:.0f}" for n in names]
        lines.append(f"| {c} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--pipeline-model", default=None)
    p.add_argument("--backend", default="nccl")
    p.add_argument("--only", default="tp,pp,single,single-pp,ref")
    p.add_argument("--no-load", default="single-pp", help="configurations only asked greedily")
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--gpu", type=int, default=0, help="the GPU of the one-GPU configurations")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("bench/results/distributed"))
    add_workload_args(p)
    p.set_defaults(levels=parse_levels("1,8,32,64"), max_tokens=128, prompt_tokens=120)
    ns = p.parse_args(argv)
    ns.no_load = set(filter(None, ns.no_load.split(",")))
    setup_logging()
    ns.out.mkdir(parents=True, exist_ok=True)
    workload = workload_from_args(ns)
    builder = PromptBuilder(ns.model)
    configs = configurations(ns)
    results: dict = {}
    path = ns.out / "distributed.json"
    for name in ns.only.split(","):
        argv_, env = configs[name]
        results[name] = run_configuration(name, argv_, env, ns, workload, builder, ns.out)
        path.write_text(json.dumps(results, indent=2) + "\n")  # keep what is done
    for dist, single in (("tp", "single"), ("pp", "single-pp")):
        if "greedy" in results.get(dist, {}) and "greedy" in results.get(single, {}):
            results[dist]["greedy_vs_one_gpu"] = agreement(
                results[dist]["greedy"], results[single]["greedy"])
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results, ns.levels))
    for dist in ("tp", "pp"):
        if "greedy_vs_one_gpu" in results.get(dist, {}):
            print(dist, "greedy vs one GPU:", results[dist]["greedy_vs_one_gpu"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
