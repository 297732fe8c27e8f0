"""Do later phases of one process decode slower? Runs the plain-loop ceiling (c), Tandem
at the 8,192-token budget (t), Tandem with a pool just big enough (ts), MLX's synchronize
(sync) or a CUDA memory-pool trim (trim) in the order given, printing each phase's decode
step and MLX's / the CUDA pool's memory after it.

    python scripts/gpu_phase_drift.py 256 c,t,c,t,c      # B, plan (SHAPE, DTYPE env)

On an H100 (2026-12-07, docs/benchmarks/h100-host/2026-12-07-12/drift.log) the steps
drifted within and between processes (Tandem 10.2-15.8 ms, the ceiling 12.2-17.6 ms at
B = 256) with no order to it, and every phase gave all its memory back."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tandem.runner  # noqa: F401  (preloads BLAS before mlx)

# isort: split
import mlx.core as mx

from tandem.bench import sides
from tandem.bench.ceiling import free, plain_decode
from tandem.bench.ramp import _tandem
from tandem.bench.shapes import make_model

B = int(sys.argv[1]) if len(sys.argv) > 1 else 256
PLAN = sys.argv[2] if len(sys.argv) > 2 else "c,t,c,t,c"
SHAPE = os.environ.get("SHAPE", "qwen3-0.6b")
DTYPE = os.environ.get("DTYPE", "bfloat16")


def cudart():
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    import glob

    for p in glob.glob("/tmp/site/**/libcudart.so*", recursive=True) + glob.glob(
        "/usr/local/cuda*/lib64/libcudart.so*"
    ):
        try:
            return ctypes.CDLL(p)
        except OSError:
            pass
    return None


RT = cudart()


def pool_reserved() -> str:
    if RT is None:
        return "no cudart"
    pool = ctypes.c_void_p()
    if RT.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), 0) != 0:
        return "no pool"
    out = []
    for attr in (5, 7):
        v = ctypes.c_uint64()
        RT.cudaMemPoolGetAttribute(pool, attr, ctypes.byref(v))
        out.append(v.value / 2**30)
    return f"pool reserved {out[0]:.1f} GiB used {out[1]:.1f} GiB"


def mem(tag: str) -> None:
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        smi = "?"
    print(
        f"  [{tag}] active {mx.get_active_memory() / 2**30:.1f} cache "
        f"{mx.get_cache_memory() / 2**30:.1f} peak {mx.get_peak_memory() / 2**30:.1f} GiB; "
        f"smi {smi}; {pool_reserved()}",
        flush=True,
    )


def ceiling(path: Path, vocab: int) -> None:
    from mlx_lm.utils import load

    model = load(str(path))[0]
    sets = sides.prompt_sets(seed=B, count=2, b=B, length=256, vocab=vocab)
    plain_decode(model, sets[0], 32)
    t = time.perf_counter()
    _, t_first = plain_decode(model, sets[1], 128)
    end = time.perf_counter()
    n = 127
    print(f"ceiling: decode {(end - t_first) / n * 1e3:.2f} ms/step, prefill {t_first - t:.2f} s")
    mem("after ceiling run")
    model = None
    free()
    mem("after ceiling free")


def tandem(path: Path, vocab: int, opts: dict) -> None:
    r = _tandem(path, B, 256, 128, vocab, 8192, opts)
    print(
        f"tandem {opts}: {r['tok_s']:,.0f} tok/s; decode median {r['decode_step_ms_median']:.2f}"
        f" ms, ramp {r['ramp_s']:.2f} s"
    )
    mem("after tandem close")


def main() -> None:
    print(mx.default_device(), "cudart", RT is not None, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(SHAPE, DTYPE, Path(tmp))
        vocab = min(int(json.loads((path / "config.json").read_text())["vocab_size"]), 512)
        mem("start")
        for ph in PLAN.split(","):
            if ph == "c":
                ceiling(path, vocab)
            elif ph == "t":
                tandem(path, vocab, {})
            elif ph == "ts":  # a small pool
                tandem(path, vocab, {"kv_budget_tokens": B * 400 + 8192})
            elif ph == "sync":
                mx.synchronize()
                mem("after synchronize")
            elif ph == "trim":
                if RT is None:
                    raise SystemExit("trim needs the CUDA runtime (libcudart)")
                mx.synchronize()
                pool = ctypes.c_void_p()
                RT.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), 0)
                RT.cudaMemPoolTrimTo(pool, ctypes.c_size_t(0))
                mem("after trim")
            else:
                raise SystemExit(f"unknown phase {ph!r} (c, t, ts, sync, trim)")


if __name__ == "__main__":
    main()
