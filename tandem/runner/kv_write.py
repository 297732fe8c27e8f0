"""KV writes in place, and the reads that must follow them (MLX's CUDA backend).

An MLX scatter (``pool[slots] = new``) writes into its input buffer only when MLX may donate
it: nothing else holds the buffer. MLX's CUDA backend keeps every input of an encoded kernel
alive until its CUDA graph completes, so while the previous step still runs on the device its
attention holds the layer's buffer and the next step's scatter copies the whole buffer first
(per layer, per step: with a default-sized pool, gigabytes a step). Two buffer sets avoid the
copy at twice the memory (``paged.PagePool``'s ``double_buffer``, the CPU's choice).

Here the write is a kernel that stores the new entries straight into the pool's buffer, which
MLX treats as an input it does not change: the pool array is never replaced. Order is ours to
keep, and it holds because
- every kernel of a step reaches the device after every kernel of the steps submitted before
  it (one stream; each ``async_eval`` commits its CUDA graph before the next is built), so a
  write never overtakes an earlier step's read;
- inside a step, every read of a layer's pool (the decode kernel, the gathers here) takes the
  layer's write ``token`` as an input: MLX then runs the write first and links the two in its
  CUDA graph (it links a node to the node that wrote one of its inputs' buffers; the pool
  itself is written by no node MLX knows of, so a plain MLX gather of the pool could run
  concurrently with the write);
- a layer's writes form one chain (each takes the last one's token as ``after``), so what a
  submission evaluates runs every write issued since the one before, also writes that no
  read of their own forward took.

One kernel writes K and V of N tokens (no concatenation): the pool's rows are K then V
flattened, as ``paged.PagePool.write`` lays them out. Metal is not covered: its encoder orders
kernels by the buffers MLX sees written, so an unseen write could race; Metal keeps the
scatter. ``available`` checks the kernels once against the scatter and gather they replace.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

log = logging.getLogger("tandem")

# One thread per written value. ``after`` (the layer's previous write token, or a zero)
# chains a layer's writes (runner/paged.py); slots outside the pool (-1: a compiled step's
# padding rows) are skipped.
_WRITE = """
    const int W = WK + WV;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) token[0] = after[0];
    if (i >= (size_t)slots_shape[0] * W) return;
    size_t n = i / W;
    int j = (int)(i % W);
    int slot = slots[n];
    if (slot < 0 || slot >= R) return;
    T x = j < WK ? k[n * WK + j] : v[n * WV + (j - WK)];
    const_cast<T*>(pool)[(size_t)slot * W + j] = x;
"""

# Rows of a (R, W) view of the pool at ``idx`` (any shape): idx.shape + (W,).
_GATHER = """
    size_t count = 1;
    for (int d = 0; d < idx_ndim; ++d) count *= idx_shape[d];
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t n = i / W;
    if (n >= count) return;
    out[i] = src[(size_t)idx[n] * W + (i % W)];
"""

_kernels: dict[str, object] = {}
_checked: dict[mx.Dtype, bool] = {}
_THREADS = 256


def _kernel(name: str):
    if name not in _kernels:
        if name == "write":
            _kernels[name] = mx.fast.cuda_kernel(
                name="tandem_kv_write",
                input_names=["pool", "slots", "k", "v", "after"],
                output_names=["token"],
                source=_WRITE,
            )
        else:
            _kernels[name] = mx.fast.cuda_kernel(
                name="tandem_kv_gather",
                input_names=["src", "idx", "token"],
                output_names=["out"],
                source=_GATHER,
            )
    return _kernels[name]


_zeros: list[mx.array] = []


def handle(a: mx.array) -> mx.array:
    """A one-row view of ``a``'s buffer, for a kernel that indexes the whole buffer through
    its pointer (the view starts where ``a`` does; the kernel is given the row count).

    MLX's CUDA encoder adds each kernel input's whole size to the CUDA graph it records and
    commits the graph once that passes ``MLX_MAX_MB_PER_BUFFER`` (1,000 on an H100/H200; it
    counts elements). With a default-sized pool a layer's buffer is gigabytes, so passed
    whole it closed a graph after every write and every decode kernel: tens of graphs a step,
    each a task MLX counts against the 10 it lets run ahead of the host, and a single stream
    15-24% slower than with a small pool (docs/benchmarks.md, "2026-12-06"). The view counts
    one row; the buffer is the same, so MLX orders the kernels as before."""
    return a[:1] if a.shape[0] > 1 else a


def zero() -> mx.array:
    """A token no write produced (a layer's first write waits on nothing)."""
    if not _zeros:
        _zeros.append(mx.zeros((1,), dtype=mx.int32))
        mx.eval(_zeros[0])
    return _zeros[0]


def write(
    pool: mx.array,
    slots: mx.array,
    k: mx.array,
    v: mx.array | None = None,
    after: mx.array | None = None,
) -> mx.array:
    """Store rows ``k`` (N, ...) — then ``v`` (N, ...) beside them — of ``pool`` (R, ...) at
    ``slots`` (N,) in place; returns the write's token ((1,) int32) for the reads to take."""
    n = slots.shape[0]
    wk = k.size // max(n, 1)
    wv = 0 if v is None else v.size // max(n, 1)
    assert wk + wv == pool.size // pool.shape[0], "a row's values fill one pool entry"
    assert n * (wk + wv) < 2**31, "one thread per value: the grid's x is a 32-bit count"
    (token,) = _kernel("write")(
        inputs=[
            handle(pool),
            slots,
            k.astype(pool.dtype),
            k if v is None else v.astype(pool.dtype),
            zero() if after is None else after,
        ],
        template=[("T", pool.dtype), ("WK", wk), ("WV", wv), ("R", pool.shape[0])],
        grid=(max(n * (wk + wv), 1), 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )
    return token


def gather(src: mx.array, idx: mx.array, token: mx.array) -> mx.array:
    """``src.reshape(R, -1)[idx]`` after the write ``token``: idx.shape + (row width,)."""
    rows = src.shape[0]
    w = src.size // rows
    n = idx.size
    assert n * w < 2**31, "one thread per value: the grid's x is a 32-bit count"
    (out,) = _kernel("gather")(
        inputs=[handle(src), idx.astype(mx.int32), token],
        template=[("W", w)],
        grid=(max(n * w, 1), 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(*idx.shape, w)],
        output_dtypes=[src.dtype],
    )
    return out


def available(dtype: mx.Dtype) -> bool:
    """Whether in-place writes work here for pools of ``dtype`` (CUDA only; checked once
    against a scatter, a layer's two successive writes and a gather after them)."""
    if dtype not in _checked:
        ok = False
        if mx.default_device() != mx.cpu and mx.cuda.is_available():
            try:
                ok = _selfcheck(dtype)
            except Exception as e:  # noqa: BLE001 - any failure means: scatter instead
                log.warning("in-place KV writes unavailable (%s: %s)", type(e).__name__, e)
        _checked[dtype] = ok
    return _checked[dtype]


def _selfcheck(dtype: mx.Dtype) -> bool:
    rng = np.random.default_rng(0)
    pool = mx.zeros((64, 6, 32), dtype=dtype)
    mx.eval(pool)
    want = np.zeros((64, 6, 32), dtype=np.float32)
    token = None
    for n in (5, 3):
        slots = rng.choice(64, size=n, replace=False).astype(np.int32)
        k = rng.standard_normal((n, 2, 32)).astype(np.float32)
        v = rng.standard_normal((n, 4, 32)).astype(np.float32)
        want[slots] = np.concatenate([k, v], axis=1)
        token = write(pool, mx.array(slots), mx.array(k), mx.array(v), token)
    assert token is not None
    idx = mx.array(rng.integers(0, 64, size=(3, 7)).astype(np.int32))
    got = gather(pool, idx, token)
    exact = np.asarray(mx.array(want).astype(dtype).astype(mx.float32))
    rows = exact[np.asarray(idx)].reshape(3, 7, -1)
    ok = np.array_equal(np.asarray(got.astype(mx.float32)), rows)
    ok = ok and np.array_equal(np.asarray(pool.astype(mx.float32)), exact)
    if not ok:
        log.warning("in-place KV writes disagree with a scatter; not used")
    return bool(ok)
