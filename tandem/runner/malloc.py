"""Keep glibc from handing freed heap memory back after every step (Linux).

MLX's CPU backend computes on a stream thread of its own, so its temporaries come from one
of glibc's thread arenas, and its buffer cache (32 MiB on the CPU) keeps few of them: most
are freed back to the arena at once. glibc trims a heap's free top beyond
``M_TRIM_THRESHOLD``, keeping ``M_TOP_PAD`` (0 by default), and the next step touches those
pages again, each a page fault: a decode step's sizes change every step (one key more), so
the same memory went back and forth all the time. On the 2-core CPU machine, tiny llama,
16 rows at 256-512 positions, a decode step took 3.24 ms (median of 3) with glibc's
defaults and 2.39 ms with this with overlap off, 2.79 and 2.48 ms with it on
(``docs/benchmarks.md``, "Host memory").

``tune_malloc`` sets a 32 MiB top pad (half a thread-arena heap: a heap keeps that much
free at its top, and heaps beyond it can still be given back; 64, the whole heap, would keep
every arena at its peak for good), and the mmap threshold at 32 MiB (setting either turns glibc's
dynamic threshold off, which would otherwise leave it at 128 KiB). It keeps clear of the
user's own glibc malloc settings (``MALLOC_*_`` or ``GLIBC_TUNABLES``);
``TANDEM_NO_MALLOC_TUNING=1`` turns it off. Must not import mlx.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

log = logging.getLogger("tandem")

M_TOP_PAD = -2  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
TOP_PAD = 32 << 20
# Setting any of these turns glibc's dynamic mmap threshold off (it would otherwise rise to
# the size of each mmapped block freed, up to 32 MiB), leaving it at 128 KiB: every larger
# buffer MLX's cache misses would be mapped and unmapped each time. So it is set to that
# maximum at once.
MMAP_THRESHOLD = 32 << 20
OPT_OUT_ENV = "TANDEM_NO_MALLOC_TUNING"

_done: bool | None = None


_PARAMS = ("top_pad", "mmap_threshold", "trim_threshold")


def _users_own() -> bool:
    """Whether the user set one of these glibc malloc parameters (environment or tunables)."""
    if any(f"MALLOC_{k.upper()}_" in os.environ for k in _PARAMS):
        return True
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(f"glibc.malloc.{k}" in tunables for k in _PARAMS)


def tune_malloc() -> bool:
    """Set glibc's mmap threshold and top pad once; returns whether they are set (False
    off glibc, when opted out, or where the user set glibc's malloc parameters)."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    if os.environ.get(OPT_OUT_ENV, "") not in ("", "0"):
        return False
    if _users_own():
        log.info("glibc malloc: the environment sets its parameters; Tandem leaves them")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TOP_PAD, TOP_PAD))
    if _done:
        log.info(
            "glibc malloc: top pad %d MiB, mmap threshold %d MiB (freed heap memory kept "
            "for the next step)",
            TOP_PAD >> 20,
            MMAP_THRESHOLD >> 20,
        )
    return _done
