"""The ``mlx-trio-server`` command: mlx_lm.server's flags, Hypercorn in-process.

The flags are made from ``ServerConfig``'s field metadata
(``runtime.config.SETTINGS``): mlx_lm.server's names and defaults plus ours,
listed under their groups (``runtime.settings.GROUPS``: argparse argument
groups, as vLLM's ``--help`` has them), each with its help, text format (``--prompt-cache-bytes 4GB``,
``--chat-template-args '{...}'``, ``--allowed-origins a,b``) and allowed
values; booleans are ``store_true`` flags. No default is restated here: a
flag not given is left out, and the field's default applies. The values are
structured into ``ServerConfig`` by ``config_from_mapping``, as the
environment's are. ``--markdown`` prints the settings tables of
docs/configuration.md (made from the same metadata, one per group) and exits.

``main`` first makes sure the served model is on this machine
(``runtime.model_fetch``: downloaded on first use, or a plain message and
exit status 1 when it cannot be had), then serves the app with Hypercorn's
trio worker in this process, its log lines through this process's one
logging set-up (one line per event). A shutdown begins on SIGINT or SIGTERM,
when the served model fails to load at start (exit status 1), or, for a rank
of a distributed launch, when the launcher that started it is gone (exit
status 1): Hypercorn stops accepting, and ``Runtime.drain`` refuses new
requests and, ``--shutdown-grace`` seconds later, ends every open one
properly, before Hypercorn's graceful timeout (2 s longer) would cut them.
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
from runtime.config_checks import unsupported
from runtime.distributed import ParentWatch
from runtime.model_fetch import ModelUnavailable, fetch_served_model
from runtime.settings import BOOLEAN, GROUPS, Setting, TextFormat

TABLE_BEGIN = "<!-- settings table: made by `python -m api.cli --markdown`; do not edit -->"
TABLE_END = "<!-- end of the settings table -->"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-trio-server",
        usage="%(prog)s [options]",  # not all the flags: they follow, by group
        description="OpenAI-compatible server for MLX models, on trio.",
        epilog="This command reads no environment variables; under `hypercorn api:app "
        "--worker-class trio` the same settings are MLX_TRIO_<NAME> variables "
        "(MLX_TRIO_MAX_TOKENS=256). See docs/configuration.md.",
        argument_default=argparse.SUPPRESS,  # a flag not given: the field's default
    )
    parser.add_argument(
        "--markdown",
        action=_PrintSettingsTable,
        nargs=0,
        help="print the settings tables of docs/configuration.md and exit",
    )
    # Argument groups, as vLLM's --help has them: each setting under its group's
    # title and description, the groups in GROUPS' order.
    groups = {g: parser.add_argument_group(g.title, g.description) for g in GROUPS}
    for s in SETTINGS:
        groups[s.group].add_argument(s.flag, dest=s.name, **_argument(s))
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
    """The settings tables of docs/configuration.md, between its markers: a heading,
    its description and a table for each group, in ``--help``'s order."""
    rows = [TABLE_BEGIN]
    for group in GROUPS:
        rows += [
            f"### {group.title}",
            "",
            group.description[0].upper() + group.description[1:] + ".",
            "",
            "| Field | Flag | Variable | Value | Default | Meaning |",
            "|---|---|---|---|---|---|",
        ]
        rows += [_table_row(s) for s in SETTINGS if s.group is group]
        rows.append("")
    rows[-1] = TABLE_END
    return "\n".join(rows) + "\n"


def _table_row(s: Setting) -> str:
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
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


class _PrintSettingsTable(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(settings_table())
        parser.exit()


# ------------------------------------------------------------------ serving


DRAIN_MARGIN = 2.0  # seconds between the runtime ending open requests and Hypercorn cutting them
WATCH_SECONDS = 0.5  # how often the start-up failure and a rank's launcher are looked at


async def _serve(app, config, parent: ParentWatch | None = None) -> int:
    """Serve until a shutdown; returns the exit status."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve

    hyper = HypercornConfig()
    hyper.bind = [f"{config.host}:{config.port}"]
    hyper.backlog = 1024
    hyper.graceful_timeout = config.shutdown_grace + DRAIN_MARGIN
    hyper.startup_timeout = 600
    # One line per event: Hypercorn logs through our handlers (given a Logger, it adds
    # none of its own), and the access log is ours (api.observability: mlx_trio.access).
    hyper.accesslog = None
    hyper.errorlog = logging.getLogger("hypercorn.error")
    runtime = app.extensions["runtime"]
    status = [0]

    async def shutdown_trigger() -> None:
        reason, status[0] = await _shutdown_reason(runtime, parent)
        logger = logging.getLogger(__name__)
        (logger.error if status[0] else logger.info)("%s: shutting down", reason)
        runtime.drain(config.shutdown_grace)

    await serve(app, hyper, shutdown_trigger=shutdown_trigger)
    return status[0]


async def _shutdown_reason(runtime, parent: ParentWatch | None) -> tuple[str, int]:
    """Wait for a reason to stop: (what happened, exit status)."""
    found: list[tuple[str, int]] = []
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    found.append((f"received {signal.Signals(signum).name}", 0))
                    break
            nursery.cancel_scope.cancel()

        async def on_failure() -> None:
            while not found:
                await trio.sleep(WATCH_SECONDS)
                failure = runtime.startup_failure
                if failure is not None:
                    found.append((f"the model could not be loaded ({failure})", 1))
                elif parent is not None and parent.gone():
                    found.append((f"the launcher (pid {parent.pid}) is gone", 1))
            nursery.cancel_scope.cancel()

        nursery.start_soon(on_signal)
        nursery.start_soon(on_failure)
    return found[0]


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        sys.exit(f"mlx-trio-server: {exc}")
    from runtime.cpu_blas import prepare_server_process
    from runtime.distributed import is_follower, launched_rank

    rank = launched_rank()
    prefix = f"[rank {rank}] " if rank is not None else ""
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
    )
    # Before anything here imports MLX: its CPU products on OpenBLAS if the engine runs here.
    prepare_server_process(config.cpu_blas, config.engine_mode, distributed=rank is not None)
    # The launcher is our parent now; if it dies first, we are re-parented.
    parent = ParentWatch() if rank is not None else None
    problems = unsupported(config)
    if problems:
        sys.exit("mlx-trio-server: " + "; ".join(problems))
    try:
        fetch_served_model(config)
    except ModelUnavailable as exc:
        logging.getLogger(__name__).error("%s", exc)
        sys.exit(1)
    if is_follower():
        # Ranks other than 0 serve no HTTP: they step the engine in lockstep with rank 0.
        from runtime.engine.loop import run_follower

        _exit_distributed(run_follower(config, parent))
    from api.server import create_app

    app = create_app(config)
    status = trio.run(_serve, app, config, parent)
    if rank is not None:
        _exit_distributed(status)
    if status:
        sys.exit(status)


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
