"""Preload an optimized BLAS before MLX on Linux CPU.

MLX's Linux CPU wheel links a reference BLAS. Loading an optimized BLAS with RTLD_GLOBAL
*before* ``import mlx`` makes MLX resolve its BLAS symbols there (float32 matmuls ran ~35x
faster on our 2-core machines). Must not import mlx itself.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("tandem")

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)
OPT_OUT_ENV = "TANDEM_NO_BLAS_PRELOAD"
# Read by OpenBLAS as it loads, unless set already: its idle worker threads spin (yielding)
# for 2^28 cycles after each call by default, so on a few cores they take the time MLX's
# worker and the host's step building need. On our 2-core machines a random tiny llama's
# B = 16 decode step took 1.9-2.6 ms with 2^4 against 2.9-5.0 (the SmolLM2 shape unchanged
# within noise; docs/benchmarks.md, "OpenBLAS's idle spin").
OPENBLAS_ENV = {"OPENBLAS_THREAD_TIMEOUT": "4"}

_loaded: str | None = None


def preload_blas() -> str | None:
    """Load the first optimized BLAS found; returns its path or None.

    Skipped off Linux, when ``TANDEM_NO_BLAS_PRELOAD=1``, or when mlx is already imported
    (too late to take effect — said in the log rather than silently).
    """
    global _loaded
    if _loaded is not None or not sys.platform.startswith("linux"):
        return _loaded
    if os.environ.get(OPT_OUT_ENV, "") not in ("", "0"):
        log.info("BLAS preload disabled by %s", OPT_OUT_ENV)
        return None
    if "mlx.core" in sys.modules:
        log.warning("mlx was imported before tandem: optimized BLAS not preloaded")
        return None
    path = os.environ.get("TANDEM_BLAS_PATH") or next(
        (p for p in CANDIDATES if os.path.exists(p)), None
    )
    if path is None:
        return None
    for key, value in OPENBLAS_ENV.items():
        os.environ.setdefault(key, value)
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _loaded = path
    log.info("preloaded optimized BLAS for MLX's CPU backend: %s", path)
    return path
