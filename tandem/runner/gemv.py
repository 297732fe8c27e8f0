"""One-row projections on CUDA through our own GEMV kernel: MLX's arithmetic, more loads in
flight.

A single-stream decode step reads every weight once per token (16.4 GB on the Qwen3-8B
shape), and on MLX's CUDA backend each of those reads is MLX's GEMV kernel: one warp per
output row, each lane loading 4 values per iteration, summing them, then loading the next 4.
On an H100 both Tandem and mlx-lm read the weights at about 2.3 TB/s that way, some 70% of the
memory's bandwidth (docs/benchmarks.md), so the step was the GEMV's speed, not host time.

This kernel computes each output exactly as MLX's does: lane ``l`` of the row's warp sums, in
order, the products of columns ``4 l + 128 i`` for i = 0, 1, ... (a multiply-add in float32
each), the warp reduces with cooperative groups' ``reduce``, and the sum is rounded to the
output type once. What changes is the schedule: each lane issues ``U`` iterations' loads
before it sums any of them, so a warp has ``U`` times the bytes in flight. Same operations in
the same order, so the output is meant to be bitwise equal; a check at load compares it with
MLX's product for each weight shape on the model's own weights and uses the kernel only
where every value is equal (nothing is approximate: a shape that differs keeps MLX's path).

Used by ``runner.weight_views``' modules for inputs of one row (``x.size`` equal to the input
width: a step of one decode row, or a one-token prefill), bias-free weights whose input
width is a multiple of 128, in float32, float16 or bfloat16. ``TANDEM_GEMV=0`` turns it off
(for comparisons).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import mlx.core as mx

log = logging.getLogger("tandem")

ROWS = 8  # output rows (warps) a block
UNROLL = 4  # iterations whose loads a lane issues before summing them

_HEADER = """
#include <cooperative_groups/reduce.h>

template <typename T>
struct alignas(4 * sizeof(T)) TandemVec4 {
  T v[4];
};
"""

_SOURCE = """
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane = warp.thread_rank();
  const int row = blockIdx.x * ROWS + threadIdx.y;
  if (row < N) {
    const T* wr = w + static_cast<size_t>(row) * K;
    float sum = 0.0f;
    const uintptr_t bits = reinterpret_cast<uintptr_t>(wr) | reinterpret_cast<uintptr_t>(x);
    if (bits % (4 * sizeof(T)) == 0) {
      for (int c = 4 * lane; c < K; c += 128 * U) {
        TandemVec4<T> a[U];
        TandemVec4<T> b[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (c + 128 * u < K) {
            a[u] = *reinterpret_cast<const TandemVec4<T>*>(wr + c + 128 * u);
            b[u] = *reinterpret_cast<const TandemVec4<T>*>(x + c + 128 * u);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (c + 128 * u < K) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              sum += static_cast<float>(a[u].v[j]) * static_cast<float>(b[u].v[j]);
            }
          }
        }
      }
    } else {
      // Views not aligned to 4 values: MLX's kernel then takes 2 values a lane (columns
      // 2 l + 64 i) where they are aligned to 2, else 1 (l + 32 i); the same orders here.
      const int per = (bits % (2 * sizeof(T)) == 0) ? 2 : 1;
      for (int c = per * lane; c < K; c += 32 * per) {
        for (int j = 0; j < per; ++j) {
          sum += static_cast<float>(wr[c + j]) * static_cast<float>(x[c + j]);
        }
      }
    }
    sum = cg::reduce(warp, sum, cg::plus<float>());
    if (lane == 0) {
      y[row] = static_cast<T>(sum);
    }
  }
"""

_kernel: Callable[..., list[mx.array]] | None = None
_checked: dict[tuple[int, int, mx.Dtype], bool] = {}
active = False  # some shape passed its check (``suits`` is False before any does)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _build() -> Callable[..., list[mx.array]]:
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="tandem_gemv",
            input_names=["w", "x"],
            output_names=["y"],
            source=_SOURCE,
            header=_HEADER,
        )
    return _kernel


def enabled() -> bool:
    """Whether this backend has the kernel (CUDA) and it is not turned off."""
    return (
        os.environ.get("TANDEM_GEMV") != "0"
        and mx.default_device() != mx.cpu
        and mx.cuda.is_available()
    )


def gemv(w: mx.array, x: mx.array, rows: int = ROWS, unroll: int = UNROLL) -> mx.array:
    """``x @ w.T`` for ``x`` of one row (any leading shape of size 1), ``w`` of (N, K) with
    K a multiple of 128, both of one dtype (``suits`` says where it may stand for it)."""
    n, k = w.shape
    if k % 128 or x.size != k or x.shape[-1] != k or x.dtype != w.dtype:
        raise ValueError(f"gemv: x {x.shape} {x.dtype} against w {w.shape} {w.dtype}")
    (y,) = _build()(
        inputs=[w, x],
        template=[("T", w.dtype), ("K", k), ("N", n), ("ROWS", rows), ("U", unroll)],
        grid=(32 * -(-n // rows), rows, 1),
        threadgroup=(32, rows, 1),
        output_shapes=[(*x.shape[:-1], n)],
        output_dtypes=[w.dtype],
    )
    return y


def suits(w: mx.array, x: mx.array) -> bool:
    """Whether ``x @ w.T`` may take the kernel: one row, the shape checked equal at load. (On
    the GPU: a GPU model's product run on a CPU stream would not suit, which Tandem never
    does.)"""
    return (
        active
        and x.size == x.shape[-1]
        and w.ndim == 2
        and x.shape[-1] == w.shape[1]
        and x.dtype == w.dtype
        and _checked.get((*w.shape, w.dtype), False)
    )


def check(weights: list[mx.array]) -> int:
    """Compare the kernel with MLX's product for each distinct weight shape (on the first
    weight of it, with random inputs of one row, 2-D and 3-D); shapes that agree bit for bit
    take the kernel. Returns how many shapes do."""
    global active
    if not enabled():
        active = False
        return 0
    for w in weights:
        key = (*w.shape, w.dtype)
        if key in _checked:
            continue
        _checked[key] = w.ndim == 2 and w.dtype in DTYPES and w.shape[1] % 128 == 0
        if _checked[key]:
            _checked[key] = _agrees(w, key)
    active = any(_checked.values())
    passed = sum(_checked.values())
    log.info("gemv: %d of %d weight shapes on Tandem's kernel", passed, len(_checked))
    return passed


def _agrees(w: mx.array, key: tuple) -> bool:
    """Whether the kernel's product equals MLX's, bit for bit, for a few inputs."""
    try:
        for seed in range(2):
            x = mx.random.normal((1, w.shape[1]), key=mx.random.key(seed)).astype(w.dtype)
            for xs in (x, x[None]):
                ref = xs @ w.T
                mx.eval(ref)  # MLX's side first: a kernel that fails fails alone
                got = gemv(w, xs)
                mx.eval(got)
                if not mx.array_equal(ref, got).item():
                    diff = mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max()
                    log.warning("gemv: %s differs from MLX's matmul (%g)", key, diff.item())
                    return False
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build: MLX's path
        log.warning("gemv: %s kept on MLX's matmul (%s)", key, e)
        return False
    return True
