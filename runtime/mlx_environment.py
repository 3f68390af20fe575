"""The MLX settings a long-running server needs, as MLX reads them: environment variables.

Owns nothing but ``server_defaults``, called by the engine before its first MLX
operation (``runtime.engine.loading.make_engine_core``, in the engine's thread
or process). It receives the environment and sets, where the operator has not,
the variables MLX's CUDA backend reads when it builds its caches (each cache
reads its variable once, when first used). Emits the names it set.

* ``MLX_ENABLE_CACHE_THRASHING_CHECK=0``. MLX's CUDA caches (CUDA graph
  executables, cuDNN attention graphs, convolution plans) count their misses
  over the process's whole life and never reset the count: once a cache has
  missed twice its capacity (800 for the graph cache, 512 for attention), every
  further miss raises "Cache thrashing is happening", however high the hit
  rate. A server meets new shapes for as long as it runs (each prefill group's
  batch size and prompt length is one), so from then on every step with a new
  shape would fail its requests. The check is a diagnostic for benchmarks;
  MLX's own test suite turns it off too.
* ``MLX_CUDA_SDPA_CACHE_SIZE=1024``. Every prefill shape not in the cuDNN
  attention cache builds and finalizes a cuDNN graph (runtime compilation
  included) on the engine's thread: 4 % of the engine's samples in a native
  profile on an H200 at 64 clients (docs/performance.md). The default 256
  cycles through a server's mix of prefill group sizes and prompt lengths.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SERVER_DEFAULTS = {
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
    "MLX_CUDA_SDPA_CACHE_SIZE": "1024",
}


def server_defaults(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set each of ``SERVER_DEFAULTS`` the environment does not set; the names set."""
    environ = os.environ if environ is None else environ
    chosen = [name for name in SERVER_DEFAULTS if name not in environ]
    for name in chosen:
        environ[name] = SERVER_DEFAULTS[name]
    return chosen
