"""Paged decode attention kernels: one query token per sequence over its own pages.

``paged_decode(q, pool, tables, lengths, scale, page_size)``:
q (B, H, D); pool (slots, 2 Hkv, D) with K then V per slot; tables (B, max_pages) int32 page
ids; lengths (B,) int32;
returns (B, H, D). One thread block per (sequence, query head, chunk of CHUNK keys), so a long
sequence spreads over many blocks (flash-decoding); each warp (CUDA) or SIMD group (Metal)
walks every W-th key of its chunk with an online softmax in float32, the groups merge through
shared memory, and the chunks' partial softmaxes merge in MLX. K and V are read in place from
the pool (no gather).

CUDA (``mx.fast.cuda_kernel``) is measured on the H200 (docs/benchmarks.md). The Metal
version (``mx.fast.metal_kernel``) follows the same algorithm but could not be compiled or
run here (no Apple GPU on our machines); ``available()`` builds and checks either against
the pure-MLX gather path once, and the runner falls back to that path when the check fails.
"""

from __future__ import annotations

import logging

import mlx.core as mx

log = logging.getLogger("tandem")

WARPS = 4

_CUDA_SOURCE = """
    const int W = NW;
    const int E = D / 32;
    const int MAXP = dims[0];
    const int NC = dims[1];
    int chunk = blockIdx.x % NC;
    int bh = blockIdx.x / NC;
    int b = bh / H;
    int h = bh % H;
    int hk = h / (H / HKV);
    int warp = threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    int first = chunk * CHUNK;
    int len = min(lengths[b], first + CHUNK);
    float sc = scale[0];
    float qv[E];
    float acc[E];
    for (int e = 0; e < E; ++e) {
        qv[e] = static_cast<float>(q[((size_t)b * H + h) * D + lane * E + e]) * sc;
        acc[e] = 0.0f;
    }
    float m = __int_as_float(0xff800000);  // -inf
    float l = 0.0f;
    for (int j = first + warp; j < len; j += W) {
        size_t slot = (size_t)tables[(size_t)b * MAXP + j / P] * P + (j % P);
        size_t base = (slot * 2 * HKV + hk) * D + lane * E;
        size_t vbase = base + (size_t)HKV * D;
        float s = 0.0f;
        for (int e = 0; e < E; ++e) s += qv[e] * static_cast<float>(kv_pool[base + e]);
        for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
        float mn = fmaxf(m, s);
        float c = __expf(m - mn);
        float p = __expf(s - mn);
        l = l * c + p;
        for (int e = 0; e < E; ++e)
            acc[e] = acc[e] * c + p * static_cast<float>(kv_pool[vbase + e]);
        m = mn;
    }
    __shared__ float sm[NW];
    __shared__ float sl[NW];
    __shared__ float sacc[NW][D];
    if (lane == 0) { sm[warp] = m; sl[warp] = l; }
    for (int e = 0; e < E; ++e) sacc[warp][lane * E + e] = acc[e];
    __syncthreads();
    if (warp == 0) {
        float M = sm[0];
        for (int w = 1; w < W; ++w) M = fmaxf(M, sm[w]);
        float L = 0.0f;
        for (int w = 0; w < W; ++w) L += sl[w] == 0.0f ? 0.0f : sl[w] * __expf(sm[w] - M);
        size_t part = (size_t)blockIdx.x;
        for (int e = 0; e < E; ++e) {
            int d = lane * E + e;
            float o = 0.0f;
            for (int w = 0; w < W; ++w)
                o += sl[w] == 0.0f ? 0.0f : sacc[w][d] * __expf(sm[w] - M);
            acc_out[part * D + d] = o;
        }
        if (lane == 0) { m_out[part] = M; l_out[part] = L; }
    }
"""

_METAL_SOURCE = """
    const int W = NW;
    const int E = D / 32;
    const int MAXP = dims[0];
    const int NC = dims[1];
    uint blk = threadgroup_position_in_grid.x;
    uint tid = thread_position_in_threadgroup.x;
    int chunk = blk % NC;
    int bh = blk / NC;
    int b = bh / H;
    int h = bh % H;
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
            acc_out[blk * D + d] = o;
        }
        if (lane == 0) { m_out[blk] = M; l_out[blk] = L; }
    }
"""

# Shapes that change from step to step (table width, chunks) are inputs, not template
# parameters: a template value is a new kernel to compile.
_INPUTS = ["q", "kv_pool", "tables", "lengths", "scale", "dims"]
_OUTPUTS = ["acc_out", "m_out", "l_out"]
CHUNK = 512  # keys per block: a long sequence is split over many blocks (flash-decoding)
_kernel = None
_checked: dict[tuple, bool] = {}


def _build():
    global _kernel
    if _kernel is None:
        make, source = None, ""
        if mx.cuda.is_available():
            make, source = mx.fast.cuda_kernel, _CUDA_SOURCE
        elif mx.metal.is_available():
            make, source = mx.fast.metal_kernel, _METAL_SOURCE
        if make is not None:
            _kernel = make(
                name="tandem_paged_decode",
                input_names=_INPUTS,
                output_names=_OUTPUTS,
                source=source,
            )
    return _kernel


def paged_decode(
    q: mx.array,
    pool: mx.array,
    tables: mx.array,
    lengths: mx.array,
    scale: float,
    page_size: int,
) -> mx.array:
    kernel = _build()
    assert kernel is not None
    b, h, d = q.shape
    hkv = pool.shape[1] // 2
    chunks = max(1, -(-tables.shape[1] * page_size // CHUNK))
    acc, m, l_ = kernel(
        inputs=[
            q,
            pool,
            tables,
            lengths,
            mx.array([scale], dtype=mx.float32),
            mx.array([tables.shape[1], chunks], dtype=mx.int32),
        ],
        template=[
            ("T", q.dtype),
            ("H", h),
            ("HKV", hkv),
            ("D", d),
            ("P", page_size),
            ("NW", WARPS),
            ("CHUNK", CHUNK),
        ],
        grid=(b * h * chunks * 32 * WARPS, 1, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(b, h, chunks, d), (b, h, chunks), (b, h, chunks)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    if chunks == 1:
        return (acc[:, :, 0] / l_[:, :, 0, None]).astype(q.dtype)
    # Merge the chunks' partial softmaxes; a chunk past a sequence's end has l = 0.
    top = mx.max(m, axis=2, keepdims=True)
    w = mx.where(l_ > 0, mx.exp(m - top), 0.0)
    num = mx.sum(acc * w[..., None], axis=2)
    return (num / mx.sum(l_ * w, axis=2)[..., None]).astype(q.dtype)


def reference(q, pool, tables, lengths, scale: float, page_size: int) -> mx.array:
    """The same attention by gathering each sequence's pages (the oracle)."""
    hkv = pool.shape[1] // 2
    outs = []
    for i in range(q.shape[0]):
        n = int(lengths[i].item())
        pages = tables[i, : -(-n // page_size)]
        slots = (pages[:, None] * page_size + mx.arange(page_size)[None]).reshape(-1)[:n]
        k = pool[slots][:, :hkv].transpose(1, 0, 2)[None]
        v = pool[slots][:, hkv:].transpose(1, 0, 2)[None]
        outs.append(mx.fast.scaled_dot_product_attention(q[i : i + 1, :, None], k, v, scale=scale))
    return mx.concatenate(outs)[:, :, 0, :]


def available(head_dim: int, num_heads: int, num_kv_heads: int, dtype: mx.Dtype) -> bool:
    """Whether the device kernel exists for this shape and agrees with the gather path (checked
    once per shape on a small random case)."""
    key = (head_dim, num_heads, num_kv_heads, dtype)
    if key in _checked:
        return _checked[key]
    ok = False
    if head_dim % 32 == 0 and num_heads % num_kv_heads == 0 and mx.default_device() != mx.cpu:
        try:
            ok = _selfcheck(head_dim, num_heads, num_kv_heads, dtype)
        except Exception as e:  # noqa: BLE001 - any failure means: use the gather path
            log.warning("paged decode kernel unavailable (%s: %s)", type(e).__name__, e)
    _checked[key] = ok
    return ok


def _selfcheck(d: int, h: int, hkv: int, dtype: mx.Dtype) -> bool:
    """Ragged lengths (one short, one inside a chunk, one over three chunks) over pages
    scattered through the pool, against ``reference``."""
    import numpy as np

    p, pages = 16, 96
    rng = np.random.default_rng(0)
    lengths = [1, 40, 2 * CHUNK + 77]
    width = -(-max(lengths) // p)
    order = rng.permutation(pages)
    tables = np.zeros((len(lengths), width), dtype=np.int32)
    used = 0
    for i, n in enumerate(lengths):
        k = -(-n // p)
        tables[i, :k] = order[used : used + k]
        used += k
    k1, k2 = mx.random.split(mx.random.key(0), 2)
    q = mx.random.normal((len(lengths), h, d), key=k1).astype(dtype)
    kv = mx.random.normal((pages * p, 2 * hkv, d), key=k2).astype(dtype)
    t, n = mx.array(tables), mx.array(lengths, dtype=mx.int32)
    got = paged_decode(q, kv, t, n, d**-0.5, p).astype(mx.float32)
    want = reference(q, kv, t, n, d**-0.5, p).astype(mx.float32)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    ok = bool(mx.allclose(got, want, atol=tol, rtol=tol))
    if not ok:
        err = float(mx.max(mx.abs(got - want)))
        log.warning("paged decode kernel disagrees with the gather path (%.3g); not used", err)
    return ok
