"""The HTTP edge. ``api:app`` is the ASGI app for ``hypercorn api:app --worker-class trio``.

``app`` is a thin ASGI callable that builds the real Quart-Trio app on its
first call (the lifespan startup), from ``MLX_TRIO_<SETTING>`` environment
variables, after making sure the served model is on this machine
(``runtime.model_fetch``: downloaded on first use); so importing
``api.schemas`` or ``api.server`` has no side effects, and a bad setting or
a model that cannot be had fails the server's start-up loudly. Its logging
set-up prints each of Hypercorn's lines once.
"""

from __future__ import annotations


class _AppFromEnvironment:
    def __init__(self) -> None:
        self._app = None

    def build(self):
        if self._app is None:
            import logging

            from runtime.config import config_from_env
            from runtime.cpu_blas import prepare_server_process

            config = config_from_env()
            logging.basicConfig(
                level=config.log_level.upper(),
                format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            )
            _one_line_per_event()
            # Before the imports below load MLX: its CPU products on OpenBLAS if the engine
            # runs here.
            prepare_server_process(config.cpu_blas, config.engine_mode, distributed=False)
            from api.generation import WATCH_SERVER_DEADLINE
            from api.server import create_app
            from runtime.model_fetch import fetch_served_model

            fetch_served_model(config)  # before serving: a missing model fails the start-up
            self._app = create_app(config)
            # Hypercorn's shutdown shows only as a deadline on the requests' tasks.
            self._app.config[WATCH_SERVER_DEADLINE] = True
        return self._app

    async def __call__(self, scope, receive, send) -> None:
        try:
            app = self.build()
        except (SystemExit, ValueError, RuntimeError) as exc:  # settings, a missing model
            message = f"mlx-trio-server cannot start: {exc}"
            if scope["type"] == "lifespan":
                await receive()  # lifespan.startup
                await send({"type": "lifespan.startup.failed", "message": message})
                return
            raise RuntimeError(message) from None
        await app(scope, receive, send)


def _one_line_per_event() -> None:
    """Hypercorn's CLI gives its error logger a console handler of its own (when it
    first logs, after this runs) and lets it propagate too: each of its lines would
    be printed twice. Our root handlers skip the records of a Hypercorn logger that
    has a handler of its own, so each line is printed once, by that handler."""
    import logging

    def not_printed_yet(record: logging.LogRecord) -> bool:
        return not (
            record.name.startswith("hypercorn.") and logging.getLogger(record.name).handlers
        )

    for handler in logging.getLogger().handlers:
        handler.addFilter(not_printed_yet)


app = _AppFromEnvironment()
