"""The paged decode kernels' source (runner/kernels.py builds and launches them): the CUDA
and Metal bodies of the decode kernel, its merge, and the substitutions each variant and
dialect takes. Template names (T, H, HKV, D, P, NW, CHUNK, U, GQ, BITS, G) are the
launch's ``template`` values."""

from __future__ import annotations

import re

# One thread block per work item x query head (x GQ query heads sharing a KV head on CUDA:
# ``grouped``): a work item is (sequence, chunk of CHUNK keys), listed on the host for the
# chunks that hold keys, so a short sequence costs one block however long the longest is. A
# sequence of one chunk writes its output directly (SPLIT 0); otherwise each block writes its
# normalized partial and log-sum-exp, and the merge kernel combines a sequence's partials
# (SPLIT 1).
CUDA_BODY = """
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

METAL_BODY = """
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
WRITES = {
    0: ("out[((size_t)b * H + h) * D + d] = static_cast<T>(o / L);", ""),
    1: (
        "part[((size_t)item * H + h) * D + d] = o / L;",
        "if (lane == 0) lse[(size_t)item * H + h] = M + LOG(L);",
    ),
}

MERGE = """
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

DIALECTS = {
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


def source(body: str, dialect: str, split: int | None) -> str:
    if split is not None:
        out, lse = WRITES[split]
        body = body.replace("WRITE_OUT", out).replace("WRITE_LSE", lse)
    for k, v in DIALECTS[dialect].items():
        body = re.sub(rf"\b{k}\b", v, body)
    return body


# ``LOAD(dst, index)`` in the CUDA body: the E values a lane reads for one key, K at flat
# index ``index`` (slot-major, K then V per slot), into float ``dst[E]``. From the float pool:
# E consecutive values. From quantized pages: the lane loads each packed word once and unpacks
# BITS-bit fields (mx.quantize's layout: value x in word x * BITS / 32 at bit
# (x % (32 / BITS)) * BITS; value = field * scale + bias); where E divides the group size G
# (head dims 64, 128, 256) its values share one scale and bias, loaded once, else (96, 192) it
# loads the next group's where its values cross into it. Values are unpacked in float32 (the
# gather path's mx.dequantize rounds them to the pool's dtype first).
LOAD_FLOAT = "for (int e = 0; e < E; ++e) NAME[e] = static_cast<float>(kv_pool[(INDEX) + e]);"
LOAD_QUANTIZED = """{
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


def cuda_body(quantized: bool) -> str:
    load = LOAD_QUANTIZED if quantized else LOAD_FLOAT
    return re.sub(
        r"LOAD\((.+?), (.+?)\)\n",
        lambda m: load.replace("NAME", m.group(1)).replace("INDEX", m.group(2)) + "\n",
        CUDA_BODY,
    )
