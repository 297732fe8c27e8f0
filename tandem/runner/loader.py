"""Load model weights (mlx-lm directory or GGUF file) and size the KV budget."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger("tandem")


def load_model(path: Path) -> tuple[nn.Module, dict[str, Any]]:
    if path.is_file():
        from tandem.runner.gguf import load_gguf_model

        return load_gguf_model(path)
    from mlx_lm.utils import load_model as mlx_lm_load_model

    try:
        model, config = mlx_lm_load_model(path)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"cannot load model from {str(path)!r}: {e}") from e
    return model, config


def available_memory_bytes() -> int:
    """Memory the KV cache may still claim on the default device."""
    info = mx.device_info()
    total = info.get("memory_size") or info.get("total_memory")
    if total:
        return max(0, int(total) - mx.get_active_memory())
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
