"""Keep glibc from handing freed heap memory back after every step (Linux).

MLX's CPU backend computes on a stream thread of its own, so its temporaries come from one
of glibc's thread arenas, and its buffer cache (32 MiB on the CPU) keeps few of them: most
are freed back to the arena at once. A thread arena trims its heap's top whenever more
than ``M_TOP_PAD`` (0 by default) is free there, and the next step touches those pages
again, each a page fault: a decode step's sizes change every step (one key more), so the
same memory went back and forth all the time. On the 2-core CPU machine, tiny llama,
16 rows at 256-512 positions, a decode step took 3.5 ms with the default and 2.4 ms with a
32 or 64 MiB pad (``docs/benchmarks.md``, "Host memory").

``tune_malloc`` sets a 64 MiB top pad (the size of one thread-arena heap), so a heap stays
at the size its steps need. It must not run where the user set glibc's own
``MALLOC_TOP_PAD_``; ``TANDEM_NO_MALLOC_TUNING=1`` turns it off. Must not import mlx.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

log = logging.getLogger("tandem")

M_TOP_PAD = -2  # glibc's mallopt parameter (malloc.h)
TOP_PAD = 64 << 20
OPT_OUT_ENV = "TANDEM_NO_MALLOC_TUNING"

_done: bool | None = None


def tune_malloc() -> bool:
    """Set glibc's top pad once; returns whether it is set (False off glibc, when opted
    out, or when ``MALLOC_TOP_PAD_`` is the user's)."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    if os.environ.get(OPT_OUT_ENV, "") not in ("", "0") or "MALLOC_TOP_PAD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    _done = bool(mallopt(M_TOP_PAD, TOP_PAD))
    if _done:
        log.info(
            "glibc malloc: top pad %d MiB (freed heap memory kept for the next step)", TOP_PAD >> 20
        )
    return _done
