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

import re

import mlx.core as mx
import numpy as np

from tandem.runner import kv_quant, kv_write

WARPS = 4

# One thread block per work item x query head (x GQ query heads sharing a KV head on CUDA:
# ``grouped``): a work item is (sequence, chunk of CHUNK keys), listed on the host for the
# chunks that hold keys, so a short sequence costs one block however long the longest is. A
# sequence of one chunk writes its output directly (SPLIT 0); otherwise each block writes its
# normalized partial and log-sum-exp, and the merge kernel combines a sequence's partials
# (SPLIT 1).
_CUDA_BODY = """
    const int W = NW;
    const int E = D / 32;
    const int MAXP = dims[0];
    const int NB = H / GQ;  // blocks per work item, each GQ query heads of one KV head
    int item = blockIdx.x / NB;
    int h0 = (blockIdx.x % NB) * GQ;
    int b = work[2 * item];
    int chunk = work[2 * item + 1];
    int hk = h0 / (H / HKV);
    int warp = threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    int first = chunk * CHUNK;
    int len = min(lengths[b], first + CHUNK);
    float sc = scale[0];
    float qv[GQ][E];
    float acc[GQ][E];
    float m[GQ];
    float l[GQ];
    for (int g = 0; g < GQ; ++g) {
        for (int e = 0; e < E; ++e) {
            qv[g][e] = static_cast<float>(q[((size_t)b * H + h0 + g) * D + lane * E + e]) * sc;
            acc[g][e] = 0.0f;
        }
        m[g] = __int_as_float(0xff800000);  // -inf
        l[g] = 0.0f;
    }
    // U keys per iteration (every W-th from j): their loads are in flight together, and
    // each serves the GQ query heads of the block.
    for (int j = first + warp; j < len; j += U * W) {
        size_t kb[U];
        float kf[U][E];
        float vf[U][E];
        float s[U][GQ];
        for (int u = 0; u < U; ++u) {
            int ju = j + u * W < len ? j + u * W : j;  // past the end: read j again, masked
            size_t slot = (size_t)tables[(size_t)b * MAXP + ju / P] * P + (ju % P);
            kb[u] = (slot * 2 * HKV + hk) * D + lane * E;
        }
        for (int u = 0; u < U; ++u) {
            LOAD(kf[u], kb[u])
            LOAD(vf[u], kb[u] + (size_t)HKV * D)
        }
        for (int u = 0; u < U; ++u)
            for (int g = 0; g < GQ; ++g) {
                s[u][g] = 0.0f;
                for (int e = 0; e < E; ++e) s[u][g] += qv[g][e] * kf[u][e];
            }
        for (int off = 16; off > 0; off /= 2)
            for (int u = 0; u < U; ++u)
                for (int g = 0; g < GQ; ++g) s[u][g] += __shfl_xor_sync(0xffffffff, s[u][g], off);
        for (int g = 0; g < GQ; ++g) {
            float mn = m[g];
            for (int u = 0; u < U; ++u) {
                if (j + u * W >= len) s[u][g] = __int_as_float(0xff800000);
                mn = fmaxf(mn, s[u][g]);
            }
            float c = __expf(m[g] - mn);
            l[g] *= c;
            for (int e = 0; e < E; ++e) acc[g][e] *= c;
            for (int u = 0; u < U; ++u) {
                float p = __expf(s[u][g] - mn);
                l[g] += p;
                for (int e = 0; e < E; ++e) acc[g][e] += p * vf[u][e];
            }
            m[g] = mn;
        }
    }
    __shared__ float sm[NW][GQ];
    __shared__ float sl[NW][GQ];
    __shared__ float sacc[NW][GQ][D];
    for (int g = 0; g < GQ; ++g) {
        if (lane == 0) { sm[warp][g] = m[g]; sl[warp][g] = l[g]; }
        for (int e = 0; e < E; ++e) sacc[warp][g][lane * E + e] = acc[g][e];
    }
    __syncthreads();
    for (int g = warp; g < GQ; g += W) {  // each head's merge over the warps
        int h = h0 + g;
        float M = sm[0][g];
        for (int w = 1; w < W; ++w) M = fmaxf(M, sm[w][g]);
        float L = 0.0f;
        for (int w = 0; w < W; ++w) L += sl[w][g] == 0.0f ? 0.0f : sl[w][g] * __expf(sm[w][g] - M);
        for (int e = 0; e < E; ++e) {
            int d = lane * E + e;
            float o = 0.0f;
            for (int w = 0; w < W; ++w)
                o += sl[w][g] == 0.0f ? 0.0f : sacc[w][g][d] * __expf(sm[w][g] - M);
            WRITE_OUT
        }
        WRITE_LSE
    }
"""

_METAL_BODY = """
    const int W = NW;
    const int E = D / 32;
    const int MAXP = dims[0];
    uint blk = threadgroup_position_in_grid.x;
    uint tid = thread_position_in_threadgroup.x;
    int item = blk / H;
    int h = blk % H;
    int b = work[2 * item];
    int chunk = work[2 * item + 1];
    int hk = h / (H / HKV);
    int warp = tid / 32;
    int lane = tid % 32;
    int first = chunk * CHUNK;
    int len = min(int(lengths[b]), first + CHUNK);
    float sc = scale[0];
    float qv[E];
    float acc[E];
    for (int e = 0; e < E; ++e) {
        qv[e] = float(q[(b * H + h) * D + lane * E + e]) * sc;
        acc[e] = 0.0f;
    }
    float m = -INFINITY;
    float l = 0.0f;
    for (int j = first + warp; j < len; j += W) {
        size_t slot = size_t(tables[b * MAXP + j / P]) * P + (j % P);
        size_t base = (slot * 2 * HKV + hk) * D + lane * E;
        size_t vbase = base + (size_t)HKV * D;
        float s = 0.0f;
        for (int e = 0; e < E; ++e) s += qv[e] * float(kv_pool[base + e]);
        s = simd_sum(s);
        float mn = max(m, s);
        float c = fast::exp(m - mn);
        float p = fast::exp(s - mn);
        l = l * c + p;
        for (int e = 0; e < E; ++e) acc[e] = acc[e] * c + p * float(kv_pool[vbase + e]);
        m = mn;
    }
    threadgroup float sm[NW];
    threadgroup float sl[NW];
    threadgroup float sacc[NW * D];
    if (lane == 0) { sm[warp] = m; sl[warp] = l; }
    for (int e = 0; e < E; ++e) sacc[warp * D + lane * E + e] = acc[e];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (warp == 0) {
        float M = sm[0];
        for (int w = 1; w < W; ++w) M = max(M, sm[w]);
        float L = 0.0f;
        for (int w = 0; w < W; ++w) L += sl[w] == 0.0f ? 0.0f : sl[w] * fast::exp(sm[w] - M);
        for (int e = 0; e < E; ++e) {
            int d = lane * E + e;
            float o = 0.0f;
            for (int w = 0; w < W; ++w)
                o += sl[w] == 0.0f ? 0.0f : sacc[w * D + d] * fast::exp(sm[w] - M);
            WRITE_OUT
        }
        WRITE_LSE
    }
"""

# (WRITE_OUT, WRITE_LSE) per variant; ``o / L`` is the block's normalized output. Every work
# item has at least one key (the host lists only chunks that start below the length), so L > 0.
_WRITES = {
    0: ("out[((size_t)b * H + h) * D + d] = static_cast<T>(o / L);", ""),
    1: (
        "part[((size_t)item * H + h) * D + d] = o / L;",
        "if (lane == 0) lse[(size_t)item * H + h] = M + LOG(L);",
    ),
}

_MERGE = """
    int bh = BLOCK;
    int b = bh / H;
    int h = bh % H;
    int d = THREAD;
    int s = offsets[b];
    int e = offsets[b + 1];
    float M = lse[(size_t)s * H + h];
    for (int j = s + 1; j < e; ++j) M = MAX(M, lse[(size_t)j * H + h]);
    float num = 0.0f;
    float den = 0.0f;
    for (int j = s; j < e; ++j) {
        float w = EXP(lse[(size_t)j * H + h] - M);
        den += w;
        num += w * part[((size_t)j * H + h) * D + d];
    }
    out[((size_t)b * H + h) * D + d] = static_cast<T>(num / den);
"""

_DIALECTS = {
    "cuda": {
        "LOG": "__logf",
        "EXP": "__expf",
        "MAX": "fmaxf",
        "BLOCK": "blockIdx.x",
        "THREAD": "threadIdx.x",
    },
    "metal": {
        "LOG": "fast::log",
        "EXP": "fast::exp",
        "MAX": "max",
        "BLOCK": "threadgroup_position_in_grid.x",
        "THREAD": "thread_position_in_threadgroup.x",
    },
}


def _source(body: str, dialect: str, split: int | None) -> str:
    if split is not None:
        out, lse = _WRITES[split]
        body = body.replace("WRITE_OUT", out).replace("WRITE_LSE", lse)
    for k, v in _DIALECTS[dialect].items():
        body = re.sub(rf"\b{k}\b", v, body)
    return body


# Shapes that change from step to step (table width, work items) are inputs, not template
# parameters: a template value is a new kernel to compile.
# ``token``: unread, it orders the kernel after the layer's in-place KV write.
_INPUTS = ["q", "kv_pool", "tables", "lengths", "work", "scale", "dims", "token"]
# Quantized pages (runner/kv_quant.py): packed values, scales and biases instead of the pool.
_QUANT_INPUTS = ["q", "kv_q", "kv_s", "kv_b", "tables", "lengths", "work", "scale", "dims", "token"]
CHUNK = 512  # keys per block: a long sequence is split over many blocks (flash-decoding)
_kernels: dict[tuple[str, bool], object] = {}

# ``LOAD(dst, index)`` in the CUDA body: the E values a lane reads for one key, K at flat
# index ``index`` (slot-major, K then V per slot), into float ``dst[E]``. From the float pool:
# E consecutive values. From quantized pages: the lane loads each packed word once and unpacks
# BITS-bit fields (mx.quantize's layout: value x in word x * BITS / 32 at bit
# (x % (32 / BITS)) * BITS; value = field * scale + bias); where E divides the group size G
# (head dims 64, 128, 256) its values share one scale and bias, loaded once, else (96, 192) it
# loads the next group's where its values cross into it. Values are unpacked in float32 (the
# gather path's mx.dequantize rounds them to the pool's dtype first).
_LOAD_FLOAT = "for (int e = 0; e < E; ++e) NAME[e] = static_cast<float>(kv_pool[(INDEX) + e]);"
_LOAD_QUANTIZED = """{
            size_t w = (INDEX) * BITS / 32;
            int sh = (int)((INDEX) % (32 / BITS)) * BITS;
            float gs = static_cast<float>(kv_s[(INDEX) / G]);
            float gb = static_cast<float>(kv_b[(INDEX) / G]);
            uint32_t word = kv_q[w];
            for (int e = 0; e < E; ++e) {
                if (sh == 32) { word = kv_q[++w]; sh = 0; }
                if (e > 0 && ((INDEX) + e) % G == 0) {  // E does not divide G (head dim 96)
                    gs = static_cast<float>(kv_s[((INDEX) + e) / G]);
                    gb = static_cast<float>(kv_b[((INDEX) + e) / G]);
                }
                NAME[e] = static_cast<float>((word >> sh) & ((1u << BITS) - 1u)) * gs + gb;
                sh += BITS;
            }
        }"""
UNROLL = 2  # keys per warp iteration (the CUDA body's U)


def _cuda_body(quantized: bool) -> str:
    load = _LOAD_QUANTIZED if quantized else _LOAD_FLOAT
    return re.sub(
        r"LOAD\((.+?), (.+?)\)\n",
        lambda m: load.replace("NAME", m.group(1)).replace("INDEX", m.group(2)) + "\n",
        _CUDA_BODY,
    )


def _build(name: str, quantized: bool = False):
    """``name``: "single", "split" or "merge"; None when no GPU backend (or, for quantized
    pages, no CUDA backend: the Metal body has no quantized reads) is present."""
    key = (name, quantized)
    if key not in _kernels:
        if mx.cuda.is_available():
            make, body, dialect = mx.fast.cuda_kernel, _cuda_body(quantized), "cuda"
        elif mx.metal.is_available() and not quantized:
            make, body, dialect = mx.fast.metal_kernel, _METAL_BODY, "metal"
        else:
            return None
        tag = "_q" if quantized else ""
        inputs = _QUANT_INPUTS if quantized else _INPUTS
        _kernels["single", quantized] = make(
            name=f"tandem_paged_decode{tag}",
            input_names=inputs,
            output_names=["out"],
            source=_source(body, dialect, 0),
        )
        _kernels["split", quantized] = make(
            name=f"tandem_paged_decode_split{tag}",
            input_names=inputs,
            output_names=["part", "lse"],
            source=_source(body, dialect, 1),
        )
        _kernels["merge", quantized] = make(
            name=f"tandem_paged_merge{tag}",
            input_names=["part", "lse", "offsets"],
            output_names=["out"],
            source=_source(_MERGE, dialect, None),
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
) -> mx.array:
    b, h, d = q.shape[0], q.shape[1], q.shape[-1]
    quantized = isinstance(pool, kv_quant.QuantizedPages)
    hkv = (pool.entry[0] if quantized else pool.shape[1]) // 2
    template = [
        ("T", q.dtype),
        ("H", h),
        ("HKV", hkv),
        ("D", d),
        ("P", page_size),
        ("NW", WARPS),
        ("CHUNK", CHUNK),
    ]
    per_block = 1  # query heads a block serves (CUDA: the split variant's, ``grouped``)
    if mx.cuda.is_available():
        per_block = grouped(h, hkv, d, quantized, q.dtype) if work.split else 1
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
    threads = (work.num_items * (h // per_block) * 32 * WARPS, 1, 1)
    if not work.split:
        (out,) = _build("single", quantized)(
            inputs=inputs,
            template=template,
            grid=threads,
            threadgroup=(32 * WARPS, 1, 1),
            output_shapes=[q.shape],
            output_dtypes=[q.dtype],
        )
        return out
    part, lse = _build("split", quantized)(
        inputs=inputs,
        template=template,
        grid=threads,
        threadgroup=(32 * WARPS, 1, 1),
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
