"""A request's prompt-cache scope: whose cached prefixes it may reuse.

Receives the request (the key it was accepted with, through
``api.auth.request_owner``: a hash, as the response store keys its entries) and
its ``cache_salt`` field; emits the ``Submit.cache_scope`` string its Session
carries (``""``: the shared scope). With API keys set and
``--prompt-cache-scope key`` (the default), each key's requests reuse only the
entries its own requests made; a ``cache_salt`` (vLLM's field) narrows a
request's scope further, to the requests that send the same salt. Only a hash
of the key and salt is kept: the scope is compared, never read.
"""

from __future__ import annotations

import hashlib

from api.auth import ANONYMOUS, request_owner
from runtime.config import ServerConfig


def prompt_cache_scope(config: ServerConfig, salt: str | None) -> str:
    """The current request's scope (call inside a request context)."""
    parts = []
    owner = request_owner()
    if config.prompt_cache_scope == "key" and owner != ANONYMOUS:
        parts.append(f"key:{owner}")
    if salt:
        parts.append(f"salt:{salt}")
    if not parts:
        return ""
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:32]
