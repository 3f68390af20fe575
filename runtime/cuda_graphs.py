"""How MLX's CUDA backend groups a step's kernels into CUDA graphs.

Owns ``cuda_graph_environment(choice, environ)``, called by the engine before its
first MLX operation (``runtime.engine.loading.make_engine_core``), next to
``runtime.mlx_environment.server_defaults``. It receives ``--cuda-graphs`` and the
environment, and sets the variables MLX reads once, when its CUDA command encoder is
built. Emits nothing; it returns the variables it set.

MLX records a step's kernels into a CUDA graph and ends the graph (instantiates, or
updates a cached instance of the same topology, and launches it) once it holds a
number of operations or of megabytes of inputs, whichever comes first: 100
operations or 1,000 MB on an H100 or H200 (``MLX_MAX_OPS_PER_BUFFER``,
``MLX_MAX_MB_PER_BUFFER``). A graph whose topology MLX has not cached is
instantiated anew on the engine's thread, and the steps where the decoding batch
changes (a row joins or leaves, its KV caches grow) met new ones: on an H100,
beside a long prefill, they were the slowest steps, and without graphs they were
not (docs/performance.md). A decoding batch's KV caches are inputs of every
layer, so under MLX's rule their sizes also move where a step's graphs end.

* ``off`` (the default): no graphs; each kernel is launched on its own
  (``MLX_USE_CUDA_GRAPHS=0``). On an H100, alternated in one call, it made more
  tokens/s than MLX's rule at 16, 32 and 64 clients, whose batches change every
  few steps, as well as the shorter gaps beside a long prefill.
* ``mlx``: MLX's own rule, as above.
* ``ops``: a graph ends by its number of operations only, so that its boundaries
  follow the step's operations and not its caches' sizes.

A variable the operator set is left as it is. Only on CUDA: MLX's Metal backend reads
the same variables for its command buffers.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CUDA_GRAPH_MODES = ("mlx", "ops", "off")

# Megabytes of inputs no graph of a step reaches (MLX reads the limit as an int).
UNBOUNDED_MB = 1_000_000_000

_VARIABLES = {
    "mlx": {},
    "ops": {"MLX_MAX_MB_PER_BUFFER": str(UNBOUNDED_MB)},
    "off": {"MLX_USE_CUDA_GRAPHS": "0"},
}


def cuda_graph_environment(choice: str,
                           environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set the MLX variables ``choice`` (one of ``CUDA_GRAPH_MODES``) asks for, each
    where ``environ`` (the process's environment) does not set it; the names set."""
    if choice not in _VARIABLES:
        raise ValueError(f"cuda graphs: {choice!r} is not one of {CUDA_GRAPH_MODES}")
    environ = os.environ if environ is None else environ
    chosen = [name for name in _VARIABLES[choice] if name not in environ]
    for name in chosen:
        environ[name] = _VARIABLES[choice][name]
    return chosen
