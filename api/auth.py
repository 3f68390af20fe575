"""API keys: who may call the API.

``ApiKeys`` holds the keys of ``--api-key`` / ``MLX_TRIO_API_KEY`` and of
``--api-key-file`` (one per line; blank lines and ``#`` comments skipped).
With none configured, nothing is checked. ``register_auth(app, keys,
config)`` adds a ``before_request`` hook that, when keys are set, checks every
request's ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` header
before its body is read: a missing or wrong key raises ``Unauthorized``, which
the app's error handlers answer like any error (a 401 in the OpenAI shape,
``code: "invalid_api_key"``, or Anthropic's ``authentication_error`` on
``/v1/messages`` and below); every 401 carries ``WWW-Authenticate: Bearer``.

Open without a key: ``/health``, the chat page (``/`` and ``/assets/...``:
the page sends the key it is given), CORS preflights (``OPTIONS``), and
``/metrics`` unless ``--metrics-require-key``. Routes are matched by their
rule, not the raw path; an unknown path needs a key too (a 401, not a 404,
tells a stranger nothing about what exists).

The comparison is constant-time: every presented key is compared with
``hmac.compare_digest`` against every configured key, with no early exit.

Who made a request (``request_owner``): the key it was accepted with, as an
opaque owner string (``owner_of``: a SHA-256 of the key, never the key), or
``ANONYMOUS`` when no keys are configured. The Responses API stores each
response under it (``api.agents.responses_store``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from quart import Response, g, request

from runtime.config import ServerConfig, flag
from runtime.errors import ServerError

OPEN_RULES = frozenset({"/health", "/", "/assets/<path:name>"})
METRICS_RULE = "/metrics"
ANONYMOUS = "anonymous"  # the owner of every request when no keys are configured
OWNER_HASH_PREFIX = b"mlx-trio-server owner\0"  # the hash is of this and the key


def owner_of(key: str | None) -> str:
    """The owner of what a request with ``key`` stores: ``sha256:<hex>``, never the key
    itself (with none, ``ANONYMOUS``)."""
    if key is None:
        return ANONYMOUS
    return "sha256:" + hashlib.sha256(OWNER_HASH_PREFIX + key.encode()).hexdigest()


def request_owner() -> str:
    """The owner of the current request: its accepted key's (``owner_of``), or ``ANONYMOUS``."""
    return g.get("api_key_owner", ANONYMOUS)


class Unauthorized(ServerError):
    status = 401
    type = "invalid_request_error"


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()):
        self._keys = tuple(dict.fromkeys(k.encode() for k in keys if k))

    @classmethod
    def from_config(cls, config: ServerConfig) -> ApiKeys:
        """The configured keys; ``SystemExit`` naming the file if it cannot be read."""
        keys = list(config.api_key)
        if config.api_key_file:
            try:
                with open(config.api_key_file, encoding="utf-8") as file:
                    lines = file.read().splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise SystemExit(
                    f"mlx-trio-server: {flag('api_key_file')} {config.api_key_file}: {exc}"
                ) from None
            keys += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        return cls(keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def accepts(self, presented: Iterable[str]) -> bool:
        """Whether any presented key is one of ours, comparing every pair in full."""
        return self.matching(presented) is not None

    def matching(self, presented: Iterable[str]) -> str | None:
        """The first presented key that is one of ours (None: none is), comparing every
        pair in full."""
        found = None
        for candidate in presented:
            encoded = candidate.encode()
            match = False
            for key in self._keys:
                match |= hmac.compare_digest(encoded, key)
            if match and found is None:
                found = candidate
        return found


def presented_keys() -> list[str]:
    """The keys the current request carries: a Bearer token and/or an ``x-api-key``."""
    keys = []
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    api_key = request.headers.get("x-api-key", "").strip()
    if api_key:
        keys.append(api_key)
    return keys


def register_auth(app, keys: ApiKeys, config: ServerConfig) -> None:
    """Check the API key on every route that needs one (nothing to check without keys)."""
    if not keys:
        return
    open_rules = OPEN_RULES if config.metrics_require_key else OPEN_RULES | {METRICS_RULE}

    @app.before_request
    async def check_api_key():
        if request.method == "OPTIONS":
            return None  # CORS preflight: browsers send no credentials with it
        rule = request.url_rule.rule if request.url_rule is not None else None
        if rule in open_rules:
            return None
        presented = presented_keys()
        key = keys.matching(presented)
        if key is not None:
            g.api_key_owner = owner_of(key)
            return None
        if presented:
            raise Unauthorized("invalid API key", code="invalid_api_key")
        raise Unauthorized(
            "an API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            code="invalid_api_key",
        )

    @app.after_request
    async def challenge(response: Response) -> Response:
        if response.status_code == 401:
            response.headers.setdefault("WWW-Authenticate", "Bearer")
        return response
