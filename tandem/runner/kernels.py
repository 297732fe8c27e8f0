"""Paged decode attention kernels: one query token per sequence over its own pages.

``paged_decode(q, pool, tables, lengths, scale, page_size, work)``:
q (B, H, D) or (B, H, 1, D); pool (slots, 2 Hkv, D) with K then V per slot; tables
(B, max_pages) int32 page ids; lengths (B,) int32; ``work`` the step's ``DecodeWork``; returns
q's shape. ``token``: the layer's latest in-place write (``runner.kv_write``), read after.

One thread block per (sequence, chunk of CHUNK keys, query head), for the chunks that hold
keys only, so a long sequence spreads over many blocks (flash-decoding) while a short one
costs one block however long the longest is; on CUDA a block of the split variant serves
every query head of one KV head (``grouped``), each K and V load feeding them all. Each
warp (CUDA) or SIMD group (Metal) walks every W-th key of its chunk with an online softmax
in float32 and the groups merge through shared memory. When every sequence fits one chunk
that is the output (one launch); otherwise the blocks write normalized partials with their
log-sum-exp and a second kernel merges each sequence's partials (two launches, where merging
in MLX ops cost about ten per layer). K and V are read in place from the pool (no gather).
Quantized pages (``runner.kv_quant``) are read in place too, on CUDA: each load takes its
bits from the packed word and applies its group's scale and bias (the Metal body has no such
variant; quantized pages gather there).

CUDA (``mx.fast.cuda_kernel``) is measured on the H200 (docs/benchmarks.md). The Metal
version (``mx.fast.metal_kernel``) follows the same algorithm but could not be compiled or
run here (no Apple GPU on our machines); ``kernel_check.available()`` builds and checks either
against the pure-MLX gather path once, and the runner falls back to that path when the check
fails.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from tandem.runner import kernel_source, kv_quant, kv_write

WARPS = 4

# Shapes that change from step to step (table width, work items) are inputs, not template
# parameters: a template value is a new kernel to compile.
# ``token``: unread, it orders the kernel after the layer's in-place KV write.
_INPUTS = ["q", "kv_pool", "tables", "lengths", "work", "scale", "dims", "token"]
# Quantized pages (runner/kv_quant.py): packed values, scales and biases instead of the pool.
_QUANT_INPUTS = ["q", "kv_q", "kv_s", "kv_b", "tables", "lengths", "work", "scale", "dims", "token"]
CHUNK = 512  # keys per block: a long sequence is split over many blocks (flash-decoding)
_kernels: dict[tuple[str, bool], object] = {}

UNROLL = 2  # keys per warp iteration (the CUDA body's U)


def _build(name: str, quantized: bool = False):
    """``name``: "single", "split" or "merge"; None when no GPU backend (or, for quantized
    pages, no CUDA backend: the Metal body has no quantized reads) is present."""
    key = (name, quantized)
    if key not in _kernels:
        if mx.cuda.is_available():
            make, body, dialect = mx.fast.cuda_kernel, kernel_source.cuda_body(quantized), "cuda"
        elif mx.metal.is_available() and not quantized:
            make, body, dialect = mx.fast.metal_kernel, kernel_source.METAL_BODY, "metal"
        else:
            return None
        tag = "_q" if quantized else ""
        inputs = _QUANT_INPUTS if quantized else _INPUTS
        _kernels["single", quantized] = make(
            name=f"tandem_paged_decode{tag}",
            input_names=inputs,
            output_names=["out"],
            source=kernel_source.source(body, dialect, 0),
        )
        _kernels["split", quantized] = make(
            name=f"tandem_paged_decode_split{tag}",
            input_names=inputs,
            output_names=["part", "lse"],
            source=kernel_source.source(body, dialect, 1),
        )
        _kernels["merge", quantized] = make(
            name=f"tandem_paged_merge{tag}",
            input_names=["part", "lse", "offsets"],
            output_names=["out"],
            source=kernel_source.source(kernel_source.MERGE, dialect, None),
        )
    return _kernels[key]


class DecodeWork:
    """A decode group's work list, built once per step and shared by every layer: one item per
    (sequence, chunk holding keys), each sequence's range of items, and the page tables'
    width (``dims``)."""

    def __init__(self, lengths: list[int] | np.ndarray, width: int | None = None, pad=None) -> None:
        """``pad``: when sequences span chunks, the item count is padded to ``pad(count)``
        with items (0, 0), whose partials the merge never reads (a compiled step's shape
        then changes less often)."""
        n = np.asarray(lengths, dtype=np.int64)
        chunks = -(-n // CHUNK)
        offsets = np.concatenate([[0], np.cumsum(chunks)])
        real = int(offsets[-1])
        self.split = real > len(n)
        self.num_items = pad(real) if pad is not None and self.split else real
        rows = np.zeros(self.num_items, dtype=np.int64)
        idx = np.zeros(self.num_items, dtype=np.int64)
        rows[:real] = np.repeat(np.arange(len(n)), chunks)
        idx[:real] = np.arange(real) - np.repeat(offsets[:-1], chunks)
        self.items = mx.array(np.stack([rows, idx], axis=1).reshape(-1).astype(np.int32))
        self.offsets = mx.array(offsets.astype(np.int32))
        self.width = width
        self.dims = None if width is None else mx.array([width], dtype=mx.int32)


_scales: dict[float, mx.array] = {}


def _scale(scale: float) -> mx.array:
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
        mx.eval(_scales[scale])
    return _scales[scale]


# (query heads, KV heads, head dim, quantized pages, dtype) whose grouped split variant
# failed its start-up check (runner/kernel_check.py): one query head a block there.
UNGROUPED: set[tuple] = set()


def grouped(
    h: int, hkv: int, d: int, quantized: bool = False, dtype: mx.Dtype = mx.bfloat16
) -> int:
    """Query heads one block of the split variant serves on CUDA: all that share a KV head,
    so each K and V load feeds them all, where their registers (two values per head and
    dimension a lane holds) and shared memory allow; else one. On an H100 (Qwen3-8B
    attention, 32 query heads over 8 KV heads, bf16; ``scripts/gpu_decode_attention.py``)
    a layer at 32k positions took 1.15 ms instead of 2.59 at 16 sequences, 0.40 instead of
    0.87 at 4 and 0.17 instead of 0.26 at one; at 2k, 0.16 instead of 0.23 at 16. Within
    one chunk (the single launch, no merge) one head a block stays: the grouped blocks'
    merge launch cost more there than they saved (85 against 60 us at 384 positions)."""
    g = h // hkv
    if g <= 1 or g * (d // 32) > 32 or WARPS * g * d * 4 > 32 * 1024:
        return 1
    return 1 if (h, hkv, d, quantized, dtype) in UNGROUPED else g


# The single variant's warps a block on CUDA where a launch has at most ``WIDE_BLOCKS``
# blocks (one to four sequences of Qwen3-8B's 32 query heads): each warp walks a quarter of
# the keys it walks at ``WARPS``. On an H100 (``scripts/gpu_decode_attention.py --warps
# 4,8,16``, 384 keys) a layer took 43 instead of 60 us at one sequence and 55 instead of
# 66 at four; at 16 sequences (512 blocks) 125 instead of 72, so wider blocks stop there.
WIDE_WARPS = 16
WIDE_BLOCKS = 128
# Shapes (as ``UNGROUPED``'s) whose wide single variant failed its start-up check.
NARROW: set[tuple] = set()


def single_warps(blocks: int, shape: tuple) -> int:
    """Warps a block of the single variant runs on CUDA, for a launch of ``blocks`` blocks
    of ``shape`` (query heads, KV heads, head dim, quantized pages, dtype)."""
    return WIDE_WARPS if blocks <= WIDE_BLOCKS and shape not in NARROW else WARPS


def paged_decode(
    q: mx.array,
    pool: kv_quant.Buffer,
    tables: mx.array,
    lengths: mx.array,
    scale: float,
    page_size: int,
    work: DecodeWork,
    unroll: int = UNROLL,
    token: mx.array | None = None,
    warps: int | None = None,
) -> mx.array:
    """``warps``: a block's warps in the single variant on CUDA (None: ``single_warps``;
    the start-up check runs both widths)."""
    b, h, d = q.shape[0], q.shape[1], q.shape[-1]
    quantized = isinstance(pool, kv_quant.QuantizedPages)
    hkv = (pool.entry[0] if quantized else pool.shape[1]) // 2
    shape = (h, hkv, d, quantized, q.dtype)
    nw, per_block = WARPS, 1  # warps a block, and query heads it serves
    cuda = mx.cuda.is_available()
    if cuda:
        if work.split:
            per_block = grouped(*shape)
        else:
            nw = warps if warps is not None else single_warps(work.num_items * h, shape)
    template = [
        ("T", q.dtype),
        ("H", h),
        ("HKV", hkv),
        ("D", d),
        ("P", page_size),
        ("NW", nw),
        ("CHUNK", CHUNK),
    ]
    if cuda:
        template += [("U", unroll), ("GQ", per_block)]
    if quantized:
        template += [("BITS", pool.bits), ("G", pool.group)]
    inputs = [
        q,
        *(kv_write.handle(a) for a in kv_quant.parts(pool)),  # one-row views (kv_write.handle)
        tables,
        lengths,
        work.items,
        _scale(scale),
        work.dims if work.width == tables.shape[1] else mx.array([tables.shape[1]], dtype=mx.int32),
        kv_write.zero() if token is None else token,
    ]
    threads = (work.num_items * (h // per_block) * 32 * nw, 1, 1)
    if not work.split:
        (out,) = _build("single", quantized)(
            inputs=inputs,
            template=template,
            grid=threads,
            threadgroup=(32 * nw, 1, 1),
            output_shapes=[q.shape],
            output_dtypes=[q.dtype],
        )
        return out
    part, lse = _build("split", quantized)(
        inputs=inputs,
        template=template,
        grid=threads,
        threadgroup=(32 * nw, 1, 1),
        output_shapes=[(work.num_items, h, d), (work.num_items, h)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (out,) = _build("merge", quantized)(
        inputs=[part, lse, work.offsets],
        template=[("T", q.dtype), ("H", h), ("D", d)],
        grid=(b * h * d, 1, 1),
        threadgroup=(d, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return out
