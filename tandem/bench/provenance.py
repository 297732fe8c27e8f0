"""What a benchmark result records about where it ran: the command line, the machine, the
versions of MLX, mlx-lm and the peers, and the commit of the tree."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        r = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def command_line() -> str:
    """This run's command line, runnable again (``python -m tandem.cli ...`` when started
    that way, where argv[0] is only the path of cli.py)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(os.path.join("tandem", "cli.py")):
        argv = [sys.executable, "-m", "tandem.cli", *argv[1:]]
    return shlex.join(argv)


def environment() -> dict[str, Any]:
    """Versions and machine, for results.json. Reads package metadata (imports no mlx)."""
    versions: dict[str, str] = {}
    for name in (
        "mlx",
        "mlx-cpu",
        "mlx-metal",
        "mlx-cuda-12",
        "mlx-cuda-13",
        "mlx-lm",
        "transformers",
        "tokenizers",
        "numpy",
        "fastapi",
        "uvicorn",
        "pyzmq",
        "httpx",
    ):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    commit = _git("rev-parse", "HEAD") or os.environ.get("TANDEM_GIT_COMMIT")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    gpu = None
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            gpu = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
    return {
        "versions": versions,
        "tandem": {"git_commit": commit, "dirty": bool(dirty) if dirty is not None else None},
        "python": sys.version,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu,
    }
