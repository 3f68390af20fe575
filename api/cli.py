"""The ``mlx-trio-server`` command: mlx_lm.server's flags, Hypercorn in-process.

The flags are made from ``ServerConfig``'s field metadata
(``runtime.config.SETTINGS``): mlx_lm.server's names and defaults plus ours,
each with its help, text format (``--prompt-cache-bytes 4GB``,
``--chat-template-args '{...}'``, ``--allowed-origins a,b``) and allowed
values; booleans are ``store_true`` flags. No default is restated here: a
flag not given is left out, and the field's default applies. The values are
structured into ``ServerConfig`` by ``config_from_mapping``, as the
environment's are. ``--markdown`` prints the settings table of
docs/configuration.md (made from the same metadata) and exits.

``main`` serves the app with Hypercorn's trio worker in this process, its
log lines through this process's one logging set-up (one line per event).
SIGINT/SIGTERM trigger a graceful shutdown: the app stops admitting, then the
runtime is cancelled.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import trio

from runtime.config import SETTINGS, ConfigError, ServerConfig, config_from_mapping
from runtime.settings import BOOLEAN, Setting, TextFormat

TABLE_BEGIN = "<!-- settings table: made by `python -m api.cli --markdown`; do not edit -->"
TABLE_END = "<!-- end of the settings table -->"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-trio-server",
        description="OpenAI-compatible server for MLX models, on trio.",
        argument_default=argparse.SUPPRESS,  # a flag not given: the field's default
    )
    for s in SETTINGS:
        parser.add_argument(s.flag, dest=s.name, **_argument(s))
    parser.add_argument(
        "--markdown",
        action=_PrintSettingsTable,
        nargs=0,
        help="print the settings table of docs/configuration.md and exit",
    )
    return parser


def _argument(s: Setting) -> dict[str, Any]:
    details = [] if s.format is BOOLEAN else [f"default: {s.show_default()}"]
    if s.bounds_text():
        details.append(s.bounds_text())
    help_text = s.help + (f" ({'; '.join(details)})" if details else "")
    help_text = help_text.replace("%", "%%")
    if s.format is BOOLEAN:
        if s.default is not False:
            raise TypeError(f"{s.flag}: a store_true flag needs the default False")
        return {"action": "store_true", "help": help_text}
    out: dict[str, Any] = {"type": _argparse_type(s.format), "help": help_text}
    if s.repeatable:
        out["action"] = "extend"  # --api-key a --api-key b,c: (a, b, c)
    if s.choices is not None:
        out["choices"] = s.choices
    return out


def _argparse_type(text_format: TextFormat) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return text_format(text)

    parse.__name__ = text_format.kind  # argparse: "invalid integer value: 'x'"
    return parse


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    return config_from_mapping(vars(build_parser().parse_args(argv)))


# ---------------------------------------------------- docs/configuration.md


def settings_table() -> str:
    """The settings table of docs/configuration.md, between its markers."""
    rows = [
        TABLE_BEGIN,
        "| Field | Flag | Variable | Value | Default | Meaning |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        value = s.format.kind
        if s.choices is not None:
            value = ", ".join(f"`{c}`" for c in s.choices)
            value = f"one of {value}" + (" or none" if s.default is None else "")
        elif s.bounds_text():
            value = f"{value}, {s.bounds_text()}"
        default = s.default_text or f"`{s.show_default()}`"
        meaning = s.help[0].upper() + s.help[1:] + "."
        if s.notes:
            meaning += " " + s.notes
        if s.ours:
            meaning += " Ours."
        cells = [f"`{s.name}`", f"`{s.flag}`", f"`{s.env}`", value, default, meaning]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    rows.append(TABLE_END)
    return "\n".join(rows) + "\n"


class _PrintSettingsTable(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(settings_table())
        parser.exit()


# ------------------------------------------------------------------ serving


async def _serve(app, config) -> None:
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve

    hyper = HypercornConfig()
    hyper.bind = [f"{config.host}:{config.port}"]
    hyper.backlog = 1024
    hyper.graceful_timeout = 10
    hyper.startup_timeout = 600
    # One line per event: Hypercorn logs through our handlers (given a Logger, it adds
    # none of its own), and the access log is ours (api.observability: mlx_trio.access).
    hyper.accesslog = None
    hyper.errorlog = logging.getLogger("hypercorn.error")

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
