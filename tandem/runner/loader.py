"""Load model weights (mlx-lm directory or GGUF file) and size the KV budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tandem.runner.mlx_compat import guard_cuda_rope


def compute_dtype(dtype: str) -> mx.Dtype | None:
    """The float type a ``--dtype`` computes in; None: as stored (``auto`` on a GPU)."""
    if dtype == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    target = getattr(mx, dtype, None)
    if not isinstance(target, mx.Dtype) or not mx.issubdtype(target, mx.floating):
        raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
    return target


def load_model(path: Path, dtype: str = "auto") -> tuple[nn.Module, dict[str, Any]]:
    guard_cuda_rope()  # an MLX CUDA launch fault on small rotary widths (runner/mlx_compat.py)
    if path.is_file():
        from tandem.runner.gguf import load_gguf_model

        # Float tensors (quantization scales and biases included) straight to the compute
        # type: a float32 run never rounds a GGUF's F32 norms or biases through float16.
        return load_gguf_model(path, dtype=compute_dtype(dtype))
    from mlx_lm.utils import load_model as mlx_lm_load_model

    try:
        model, config = mlx_lm_load_model(path)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"cannot load model from {str(path)!r}: {e}") from e
    return model, config


def prepare_for_device(model: nn.Module, dtype: str) -> str:
    """Pick the compute dtype; returns a short description for the log.

    ``auto`` keeps the checkpoint as it is on GPUs; on the CPU backend it dequantizes and
    computes in float32, because MLX's CPU kernels are fast only there (a 4-bit SmolLM2-135M
    forward took 120 ms/token in float32 and 4.6 s in float16; dequantized float32: 45 ms).
    """
    if dtype == "auto":
        if mx.default_device() != mx.cpu:
            return "as stored"
        from mlx_lm.utils import dequantize_model

        # Scales and biases to float32 first, so the dequantization itself is float32
        # (through the stored float16 it was off by up to 4e-3 per weight).
        model.set_dtype(mx.float32)
        dequantize_model(model)
        dtype = "float32"
    target = compute_dtype(dtype)
    assert target is not None
    model.set_dtype(target)
    mx.eval(model.parameters())
    return dtype


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


CPU_KV_BYTES = 4 << 30  # default KV pool cap on the CPU backend (it shares host memory)


def kv_memory_bytes(fraction: float | None) -> int:
    """Bytes for the KV pool: ``fraction`` of the available memory (None: half of it, and on
    the CPU backend at most CPU_KV_BYTES, as vLLM's CPU backend defaults to 4 GiB)."""
    memory = int(available_memory_bytes() * (fraction or 0.5))
    if fraction is None and mx.default_device() == mx.cpu:
        memory = min(memory, CPU_KV_BYTES)
    return memory
