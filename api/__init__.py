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
        await self.build()(scope, receive, send)


app = _AppFromEnvironment()
