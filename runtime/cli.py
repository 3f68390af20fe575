"""The ``mlx-trio-server`` command: mlx_lm.server's flags, Hypercorn in-process.

Parses the same flags with the same names and defaults as ``mlx_lm.server``
(plus a few of ours), structures them into ``ServerConfig`` through the same
cattrs converter as the environment variables, and serves the app with
Hypercorn's trio worker in this process. SIGINT/SIGTERM trigger a graceful
shutdown: the app stops admitting, then the runtime is cancelled.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import trio

from runtime.config import DEFAULT_QUANTIZED_KV_START, LOG_LEVELS, ConfigError, config_from_mapping


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx-trio-server", description="OpenAI-compatible server for MLX models, on trio."
    )
    p.add_argument("--model", type=str, help="Path or Hugging Face repo of the MLX model")
    p.add_argument("--adapter-path", type=str, help="Optional path to trained adapter weights")
    p.add_argument("--host", type=str, default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--allowed-origins", type=lambda x: x.split(","), default="*")
    p.add_argument("--draft-model", type=str, default=None)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", type=str, default="INFO", choices=list(LOG_LEVELS))
    p.add_argument("--chat-template", type=str, default="")
    p.add_argument("--use-default-chat-template", action="store_true")
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--chat-template-args", type=json.loads, default="{}")
    p.add_argument("--decode-concurrency", type=int, default=32)
    p.add_argument("--prompt-concurrency", type=int, default=8)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--prompt-cache-size", type=int, default=10)
    p.add_argument("--prompt-cache-bytes", type=str, default=None)
    p.add_argument("--kv-bits", type=int, default=None)
    p.add_argument("--kv-group-size", type=int, default=64)
    p.add_argument("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START)
    p.add_argument("--pipeline", action="store_true")
    # ours
    p.add_argument("--max-queued-requests", type=int, default=256)
    p.add_argument("--max-request-bytes", type=int, default=8 * 2**20)
    p.add_argument("--request-timeout", type=float, default=None)
    p.add_argument("--kv-cache-budget-bytes", type=str, default=None)
    p.add_argument("--tokenizer-threads", type=int, default=2)
    p.add_argument(
        "--distributed-backend",
        type=str,
        default="any",
        help="mx.distributed backend when started by mlx.launch (any, ring, jaccl, nccl, mpi)",
    )
    p.add_argument(
        "--distributed-timeout",
        type=float,
        default=60.0,
        help="seconds without an engine step or heartbeat before rank 0 reports the group lost",
    )
    p.add_argument(
        "--engine-mode",
        choices=["process", "thread"],
        default="process",
        help="run the engine in a child process (default) or on a thread of the server process",
    )
    p.add_argument(
        "--admission-window-ms",
        type=float,
        default=30.0,
        help="while at least --prompt-concurrency sequences decode, hold a new request up to "
        "this long (or until --prompt-concurrency wait) so that arrivals join the batch "
        "together (0: admit at once)",
    )
    p.add_argument(
        "--prompt-cache-min-reuse",
        type=int,
        default=64,
        help="reuse a cached prompt prefix only if it covers at least this many tokens "
        "(a chat template's few opening tokens are not worth copying an entry for; 0: any)",
    )
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        default=0.0,
        help="send a streaming response's chunks at most this often, merging the tokens "
        "in between (fewer HTTP chunks, less CPU per token; 0: every engine step)",
    )
    return p


def parse_config(argv: list[str] | None = None):
    args = vars(build_parser().parse_args(argv))
    if isinstance(args["chat_template_args"], str):
        args["chat_template_args"] = json.loads(args["chat_template_args"])
    if isinstance(args["allowed_origins"], str):
        args["allowed_origins"] = args["allowed_origins"].split(",")
    return config_from_mapping(args)


async def _serve(app, config) -> None:
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve

    hyper = HypercornConfig()
    hyper.bind = [f"{config.host}:{config.port}"]
    hyper.backlog = 1024
    hyper.graceful_timeout = 10
    hyper.startup_timeout = 600
    hyper.accesslog = None

    async def shutdown_trigger() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                logging.getLogger(__name__).info(
                    "received %s: shutting down", signal.Signals(signum).name
                )
                return

    await serve(app, hyper, shutdown_trigger=shutdown_trigger)


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        sys.exit(f"mlx-trio-server: {exc}")
    from runtime.distributed import is_follower, launched_rank

    rank = launched_rank()
    prefix = f"[rank {rank}] " if rank is not None else ""
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
    )
    problems = config.unsupported()
    if problems:
        sys.exit("mlx-trio-server: " + "; ".join(problems))
    if is_follower():
        # Ranks other than 0 serve no HTTP: they step the engine in lockstep with rank 0.
        from runtime.engine.loop import run_follower

        _exit_distributed(run_follower(config))
    from api.server import create_app

    app = create_app(config)
    trio.run(_serve, app, config)
    if rank is not None:
        _exit_distributed(0)


def _exit_distributed(code: int) -> None:
    """Leave without running C++ static destructors: mx.distributed's ring group
    aborts the process ("terminate called without an active exception") when it
    is destroyed at interpreter exit after being used from a non-main thread."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
