"""The HTTP edge. ``api:app`` is the ASGI app for ``hypercorn api:app --worker-class trio``.

``app`` is a thin ASGI callable that builds the real Quart-Trio app on its
first call (the lifespan startup), from ``MLX_TRIO_<SETTING>`` environment
variables; so importing ``api.schemas`` or ``api.server`` has no side effects,
and a bad setting fails the server's start-up loudly.
"""

from __future__ import annotations


class _AppFromEnvironment:
    def __init__(self) -> None:
        self._app = None

    def build(self):
        if self._app is None:
            import logging

            from api.server import create_app
            from runtime.config import config_from_env

            config = config_from_env()
            logging.basicConfig(
                level=config.log_level.upper(),
                format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            )
            self._app = create_app(config)
        return self._app

    async def __call__(self, scope, receive, send) -> None:
        try:
            app = self.build()
        except (SystemExit, ValueError) as exc:  # ConfigError, unsupported settings
            message = f"mlx-trio-server cannot start: {exc}"
            if scope["type"] == "lifespan":
                await receive()  # lifespan.startup
                await send({"type": "lifespan.startup.failed", "message": message})
                return
            raise RuntimeError(message) from None
        await app(scope, receive, send)


app = _AppFromEnvironment()
