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

``unfused_prefill_attention`` and ``install_prefill_attention`` (called by the
same function when ``--prefill-attention unfused``, the default, on MLX's CUDA
backend) route a prefill's attention, and only a prefill's, to MLX's own
unfused attention:

* MLX's CUDA backend runs attention through a cuDNN graph built for the exact
  shapes and strides of the call and kept in an LRU cache. A prefill step of a
  shape not seen before (its group size, prompt length, cached prefix) builds
  one on the engine's thread before the step can run: measured on an H200, a
  prefill of one 100-400-token prompt took 62-89 ms (median) the first time
  against 9-12 ms once cached, some shapes 0.8-8 s, and a server meets new
  shapes with nearly every prompt. MLX's unfused attention (its own fallback,
  plain matmuls and a softmax) builds no graph: 24-39 ms the first time,
  10-16 ms after (docs/performance.md, "H200, eleventh session").
* MLX picks the fallback, call by call, for inputs cuDNN does not take: float32
  ones. So for a query longer than one token whose scores stay small (at most
  ``UNFUSED_SCORES_LIMIT`` elements; a long prompt's chunks keep cuDNN, whose
  build their compute outweighs) the query goes in as float32 and the result
  comes back in the input's dtype. Decoding (one query token a row) keeps
  MLX's choice (cuDNN or its vector kernel), whose shapes are few.
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


# Scores of at most this many elements (batch x query heads x query x keys) go
# through the unfused path: 2 GiB of float32, e.g. one 2048-token chunk over 8192
# keys with 32 heads; beyond it, a prefill's compute outweighs a cuDNN build.
UNFUSED_SCORES_LIMIT = 1 << 29

PREFILL_ATTENTION_MODES = ("unfused", "mlx")


def unfused_prefill_attention(fused, mx, limit: int = UNFUSED_SCORES_LIMIT):
    """``fused`` (``mx.fast.scaled_dot_product_attention``) with a prefill's calls
    sent to MLX's unfused attention; every other call as it was."""
    half = (mx.bfloat16, mx.float16)

    def attention(queries, keys, values, *args, **kwargs):
        batch, heads, length = queries.shape[:3]
        if (
            length > 1
            and queries.dtype in half
            and batch * heads * length * keys.shape[2] <= limit
        ):
            out = fused(queries.astype(mx.float32), keys, values, *args, **kwargs)
            return out.astype(queries.dtype)
        return fused(queries, keys, values, *args, **kwargs)

    attention.fused = fused
    return attention


def install_prefill_attention(mx) -> bool:
    """Route prefill attention to MLX's unfused path in this process, on CUDA only
    (MLX's Metal kernels build no per-shape graphs); whether it did. Idempotent."""
    if not mx.cuda.is_available():
        return False
    current = mx.fast.scaled_dot_product_attention
    if not hasattr(current, "fused"):
        mx.fast.scaled_dot_product_attention = unfused_prefill_attention(current, mx)
    return True
