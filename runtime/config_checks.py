"""Settings this process cannot honour: start-up refuses them rather than ignoring them.

Receives a ``ServerConfig`` and whether a launcher started this process as
one rank of several (read from the environment when not given); emits the
problems, one sentence each naming the flag (empty: none). ``api.server``'s
``create_app`` and the ``mlx-trio-server`` command stop on any.
"""

from __future__ import annotations

import importlib.util

from runtime.config import ServerConfig, flag
from runtime.distributed import PIPELINE_ON_GPU, launched_rank


def unsupported(config: ServerConfig, *, distributed: bool | None = None) -> list[str]:
    """The settings of ``config`` this process cannot honour."""
    if distributed is None:
        distributed = launched_rank() is not None
    problems = []
    if config.embedding_model and importlib.util.find_spec("mlx_embeddings") is None:
        problems.append(
            f"{flag('embedding_model')} needs mlx-embeddings: install the `embeddings` extra "
            "(pip install 'mlx-trio-server[embeddings]')"
        )
    if config.pipeline and not distributed:
        problems.append(
            f"{flag('pipeline')} splits the model's layers across the ranks of a distributed "
            "launch: start the server with mlx.launch (see docs/distributed.md)"
        )
    if distributed:
        if config.pipeline and config.distributed_backend == "nccl":
            problems.append(PIPELINE_ON_GPU)
        if not config.model:
            problems.append(
                f"distributed serving needs {flag('model')} (a model that can be sharded)"
            )
        for name in ("adapter_path", "draft_model", "kv_bits"):
            if getattr(config, name) is not None:
                problems.append(f"{flag(name)} is not supported in distributed serving")
    return problems
