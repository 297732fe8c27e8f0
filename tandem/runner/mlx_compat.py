"""A guard around an MLX CUDA launch fault that Tandem's step layout reaches.

MLX's CUDA rope (0.32.x, ``backend/cuda/rope.cu``; read in v0.32.1) sizes its thread block by
handing powers of two to x (``dims / 2``), y (``T = shape[-2]``) and z (``B * ceil(N / 4)``,
B = ``shape[0]``, N the middle axes' product) until the block holds 1,024 threads, with no
cap per axis. CUDA allows at most 64 threads in z, so when x and y together take 8 threads
or fewer, i.e. ``floor(log2(dims / 2)) + floor(log2(T)) <= 3``, and ``B * ceil(N / 4) >=
128``, the launch is rejected (``cudaGraphAddKernelNode ... invalid argument``). Tandem's
attention-model steps feed (tokens, heads, 1, D) queries with an offset per token, so a
model rotating fewer than 32 dims (StableLM 2 and small GPT-NeoX / Pythia checkpoints rotate
16 of 64) may fail any step of 128 tokens or more at 4 heads (16 at 32 heads). The rope
sweeps that match this condition are scripts/gpu_rope_hd16.py (H200) and
scripts/gpu_partial_rope.py (H100, partial rotary); whether whole models hit it on the
device is what the second script's model run checks.

``guard_cuda_rope`` wraps ``mx.fast.rope`` on a CUDA device: a call that meets that
condition gets its ``T`` axis padded with zero rows (to 2 rows for 16-30 dims, 4 for 8-14,
...), which moves 2-16 threads into y; the padded rows are cut off again. Row ``t`` keeps
position ``offset + t``, so the result is the same; every other call goes straight to MLX.
"""

from __future__ import annotations

import contextlib
import functools
import math

import mlx.core as mx

_MLX_ROPE = mx.fast.rope


def invalid_launch(shape: tuple[int, ...], dims: int) -> bool:
    """Whether MLX 0.32's CUDA rope rejects (..., T, D) inputs of ``shape`` rotating
    ``dims``: the block's z exceeds 64. (B = T = 1 is left out: a row-contiguous input takes
    MLX's single-row path, and another would need 509 heads or more to fault.)"""
    if dims >= 32 or dims < 2 or len(shape) < 3:
        return False
    b, t = shape[0], shape[-2]
    if t < 1 or (b == 1 and t == 1):
        return False
    n = math.prod(shape[1:-2])
    return int(math.log2(dims // 2)) + int(math.log2(t)) <= 3 and b * -(-n // 4) >= 128


def rows_needed(dims: int) -> int:
    """The fewest rows in T for which x and y take 16 threads: 2 for 16-30 dims, 4 for 8-14,
    8 for 4-6, 16 for 2."""
    return 1 << (4 - int(math.log2(dims // 2)))


def padded_rope(a: mx.array, dims: int, **kwargs) -> mx.array:
    """``mx.fast.rope`` with the T axis padded by zero rows to ``rows_needed(dims)``, then
    cut back: the same values as the unpadded call (on the call's own stream)."""
    t = a.shape[-2]
    pad = [(0, 0)] * (a.ndim - 2) + [(0, rows_needed(dims) - t), (0, 0)]
    stream = kwargs.get("stream")
    with mx.stream(stream) if stream is not None else contextlib.nullcontext():
        return _MLX_ROPE(mx.pad(a, pad), dims, **kwargs)[..., :t, :]


@functools.wraps(_MLX_ROPE)
def _guarded_rope(a: mx.array, dims: int, **kwargs) -> mx.array:
    if invalid_launch(a.shape, dims):  # (its first test, dims >= 32, passes most calls)
        return padded_rope(a, dims, **kwargs)
    return _MLX_ROPE(a, dims, **kwargs)


def guard_cuda_rope(force: bool = False) -> bool:
    """Install the guard as ``mx.fast.rope`` when the default device is a CUDA GPU (or
    ``force``); returns whether it is installed. Idempotent."""
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    if force or on_cuda:
        mx.fast.rope = _guarded_rope
    return mx.fast.rope is _guarded_rope


def unguard_rope() -> None:
    """MLX's own ``mx.fast.rope`` again, if the guard is what is installed."""
    if mx.fast.rope is _guarded_rope:
        mx.fast.rope = _MLX_ROPE
