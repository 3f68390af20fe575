"""What operators and tools read: ``GET /health``, ``GET /metrics``, ``GET /openapi.json``.

``/health`` is 200 only while the engine can take requests (503 with the
reason otherwise); ``/metrics`` is the Prometheus exposition of the runtime's
metrics (``actors.metrics``: prometheus-client, the runtime's own registry); ``/openapi.json`` is built from the request and response types
(``api.openapi``), on first use.
"""

from __future__ import annotations

from quart import Blueprint, Response, request

from actors.system import Runtime
from api.http import json_response


def operations_blueprint(rt: Runtime) -> Blueprint:
    routes = Blueprint("operations", __name__)

    @routes.get("/health")
    async def health():
        status, body = rt.health()
        return json_response(body, status=status)

    @routes.get("/metrics")
    async def metrics():
        body, content_type = rt.metrics.render(request.headers.get("Accept", ""))
        return Response(body, content_type=content_type)

    @routes.get("/openapi.json")
    async def openapi():
        from api.openapi import openapi_document

        return json_response(openapi_document())

    return routes
