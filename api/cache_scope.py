"""A request's prompt-cache scope: whose cached prefixes it may reuse.

Receives the request (its API key, through ``api.auth.presented_keys``) and
its ``cache_salt`` field; emits the ``Submit.cache_scope`` string its Session
carries (``""``: the shared scope). With API keys set and
``--prompt-cache-scope key`` (the default), each key's requests reuse only the
entries its own requests made; a ``cache_salt`` (vLLM's field) narrows a
request's scope further, to the requests that send the same salt. Only a hash
of the key and salt is kept: the scope is compared, never read.
"""

from __future__ import annotations

import hashlib

from api.auth import presented_keys
from runtime.config import ServerConfig


def prompt_cache_scope(config: ServerConfig, salt: str | None) -> str:
    """The current request's scope (call inside a request context)."""
    parts = []
    if config.prompt_cache_scope == "key" and (config.api_key or config.api_key_file):
        parts += [f"key:{key}" for key in sorted(presented_keys())]
    if salt:
        parts.append(f"salt:{salt}")
    if not parts:
        return ""
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:32]
