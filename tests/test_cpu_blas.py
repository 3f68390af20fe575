"""OpenBLAS under MLX's CPU matrix products (``runtime.cpu_blas``, ``--cpu-blas``).

The renamed copy of scipy-openblas32's library exports MLX's three BLAS
imports; loaded before MLX it is what those names resolve to, and MLX's
products on it agree with numpy; loaded after MLX, or with ``reference``,
nothing changes; an engine process gets it through its environment.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from api.server import create_app
from runtime import cpu_blas
from runtime.config import ServerConfig
from tests.conftest import wait_ready
from tests.test_api import CHAT, chat_body, post
from tests.test_server_process import hypercorn_args, spawn_server, stop_server

pytestmark = [
    pytest.mark.skipif(
        not cpu_blas.reference_blas_in_use(), reason="MLX here does not link the reference BLAS"
    ),
    pytest.mark.server,  # runs patchelf, fresh interpreters and servers
]

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter: which library MLX's imports bind to is settled when MLX
# loads. The reference BLAS's sgemm adds a product's terms one by one in float32, in
# order, each product rounded before its sum; numpy repeats that exactly. OpenBLAS
# sums in blocks with fused multiply-adds, so its results differ in the last bits.
PROBE = r"""
import json, sys
from pathlib import Path
from runtime import cpu_blas
loaded = cpu_blas.load_into_this_process(sys.argv[1]) if sys.argv[2] == "before" else None
import mlx.core as mx
import numpy as np
if sys.argv[2] == "after":
    loaded = cpu_blas.load_into_this_process(sys.argv[1])
a = np.random.default_rng(0).standard_normal((96, 80)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((80, 72)).astype(np.float32)
product = np.array(mx.array(a) @ mx.array(b))
in_order = np.zeros((96, 72), np.float32)
for k in range(80):
    in_order = in_order + a[:, k:k + 1] * b[k:k + 1, :]
print(json.dumps({
    "loaded": loaded,
    "openblas_mapped": "libopenblas-for-mlx-" in Path("/proc/self/maps").read_text(),
    "as_the_reference_blas_sums": bool((product == in_order).all()),
    "largest_error": float(abs(product - a.astype(np.float64) @ b).max()),
}))
"""


def _probe(mode: str, when: str, cache: Path) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(ROOT)}
    env.pop("LD_PRELOAD", None)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode, when],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_the_copy_exports_mlx_s_blas_names_and_is_made_once(cache):
    library = cpu_blas.openblas_for_mlx(cache / "mlx-trio-server")
    assert library is not None and library.parent == cache / "mlx-trio-server"
    exported = ctypes.CDLL(str(library))
    for name in cpu_blas.RENAMED_SYMBOLS:
        assert getattr(exported, name)  # raises AttributeError where the name is missing
    made = library.stat().st_mtime_ns
    assert cpu_blas.openblas_for_mlx(cache / "mlx-trio-server") == library
    assert library.stat().st_mtime_ns == made
    assert sorted(p.name for p in library.parent.iterdir()) == [library.name]  # no leftovers


def test_a_cache_folder_that_cannot_be_made_leaves_the_reference_blas(tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    assert cpu_blas.openblas_for_mlx(tmp_path / "a-file" / "mlx-trio-server") is None
    assert "the reference BLAS stays" in caplog.text


def test_loaded_before_mlx_it_serves_mlx_s_products(cache):
    got = _probe("openblas", "before", cache)
    assert got["loaded"] is True and got["openblas_mapped"]
    assert not got["as_the_reference_blas_sums"]
    assert got["largest_error"] < 1e-3


@pytest.mark.parametrize(("mode", "when"), [("reference", "before"), ("openblas", "after")])
def test_otherwise_mlx_keeps_its_reference_blas(mode, when, cache):
    got = _probe(mode, when, cache)
    assert got["loaded"] is False
    assert not got["openblas_mapped"]
    assert got["as_the_reference_blas_sums"]
    assert got["largest_error"] < 1e-3


def test_an_engine_process_gets_it_through_its_environment(cache):
    env = cpu_blas.child_environment("openblas", {"LD_PRELOAD": "other.so", "HOME": "/x"})
    first, second = env["LD_PRELOAD"].split(" ")
    assert Path(first).name.startswith("libopenblas-for-mlx-") and second == "other.so"
    assert cpu_blas.child_environment("reference", {"HOME": "/x"}) == {"HOME": "/x"}


def test_a_new_version_s_copy_replaces_the_older_ones(tmp_path):
    folder = tmp_path / "mlx-trio-server"
    folder.mkdir()
    (folder / "libopenblas-for-mlx-0.0.1.so").write_bytes(b"an older copy")
    (folder / "unrelated.so").write_bytes(b"")
    library = cpu_blas.openblas_for_mlx(folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted([library.name, "unrelated.so"])


def test_a_copy_ld_preload_cannot_name_is_left_out(tmp_path, monkeypatch, caplog):
    spaced = tmp_path / "a cache" / "mlx-trio-server"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a cache"))
    env = cpu_blas.child_environment("openblas", {"HOME": "/x"})
    assert env == {"HOME": "/x"}
    assert "LD_PRELOAD cannot name" in caplog.text
    assert any(spaced.glob("libopenblas-for-mlx-*.so"))  # made, but not named


def test_the_cache_folder_follows_xdg_cache_home():
    assert cpu_blas.cache_folder({"XDG_CACHE_HOME": "/c"}) == Path("/c/mlx-trio-server")
    assert cpu_blas.cache_folder({}).parts[-2:] == (".cache", "mlx-trio-server")


@pytest.mark.parametrize("mode", ["openblas", "reference"])
async def test_the_engine_process_multiplies_on_what_cpu_blas_names(mode, tiny_model_path):
    app = create_app(ServerConfig(model=tiny_model_path, max_tokens=8, cpu_blas=mode))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        pid = (await (await client.get("/health")).get_json())["engine"]["pid"]
        assert pid != os.getpid()
        status, body, _ = await post(client, CHAT, chat_body("hello"))
        maps = await trio.Path(f"/proc/{pid}/maps").read_text()
    assert status == 200 and body["choices"][0]["message"]["content"] is not None
    assert ("libopenblas-for-mlx-" in maps) == (mode == "openblas")


def test_hypercorn_with_the_engine_on_a_thread_loads_it_before_mlx(tiny_model_path):
    env = {"MLX_TRIO_MODEL": tiny_model_path, "MLX_TRIO_ENGINE_MODE": "thread"}
    proc, base = spawn_server(hypercorn_args, env)
    try:
        engine = httpx.get(f"{base}/health", timeout=5).json()["engine"]
        assert engine["mode"] == "thread"
        maps = Path(f"/proc/{engine['pid']}/maps").read_text()  # Hypercorn's worker
    finally:
        stop_server(proc)
    assert "libopenblas-for-mlx-" in maps
