"""The start-up check of the paged decode kernels (``runner.kernels``): each variant (float
or quantized pages, single launch or split and merge) against the pure-MLX gather path on a
small random case, once per shape; the runner uses the kernel only where it agrees."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from tandem.runner import kernels, kv_quant
from tandem.runner.kernels import CHUNK, DecodeWork, paged_decode
from tandem.runner.layers import LayerSpec
from tandem.runner.paged import quantizable

log = logging.getLogger("tandem")
_checked: dict[tuple, bool] = {}


def reference(q, pool, tables, lengths, scale: float, page_size: int) -> mx.array:
    """The same attention by gathering each sequence's pages (the oracle)."""
    outs = []
    for i in range(q.shape[0]):
        n = int(lengths[i].item())
        pages = tables[i, : -(-n // page_size)]
        slots = (pages[:, None] * page_size + mx.arange(page_size)[None]).reshape(-1)[:n]
        x = kv_quant.take(pool, slots)  # (n, 2 Hkv, D)
        hkv = x.shape[1] // 2
        k = x[:, :hkv].transpose(1, 0, 2)[None]
        v = x[:, hkv:].transpose(1, 0, 2)[None]
        outs.append(mx.fast.scaled_dot_product_attention(q[i : i + 1, :, None], k, v, scale=scale))
    return mx.concatenate(outs)[:, :, 0, :]


def usable(specs: list[LayerSpec], num_heads: int | None, quant: kv_quant.KVQuant | None) -> bool:
    """Whether a model's paged layers decode through the kernel: every shape it needs exists
    and agrees. With quantized pages, the float variant too: the load-time check against
    mlx-lm (runner/verify.py) runs on a float pool."""
    full = {
        (s.k_dim, s.k_heads, s.dtype, variant)
        for s in specs
        if not (s.dense or s.unused)
        for variant in {None, quant if quantizable(s, quant) else None}
    }
    return (
        num_heads is not None
        and bool(full)
        and all(available(d, num_heads, hkv, t, q) for d, hkv, t, q in full)
    )


def available(
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: mx.Dtype,
    quant: kv_quant.KVQuant | None = None,
) -> bool:
    """Whether the device kernel exists for this shape (and KV quantization) and agrees with
    the gather path (checked once per shape on a small random case)."""
    key = (head_dim, num_heads, num_kv_heads, dtype, quant)
    if key in _checked:
        return _checked[key]
    ok = False
    if head_dim % 32 == 0 and num_heads % num_kv_heads == 0 and mx.default_device() != mx.cpu:
        ok = _checked_variants(head_dim, num_heads, num_kv_heads, dtype, quant)
    _checked[key] = ok
    return ok


def _checked_variants(
    d: int, h: int, hkv: int, dtype: mx.Dtype, quant: kv_quant.KVQuant | None
) -> bool:
    """Both variants against ``reference``, over pages scattered through the pool: ragged
    lengths within one chunk (the single launch), then one short, one inside a chunk and one
    over three chunks (split and merge). The single variant runs at both its widths
    (``kernels.single_warps``: a wide one that fails is not used). Where the split
    variant's blocks serve several query heads (``kernels.grouped``) and it fails, it is
    checked again with one head a block (the layout measured longest) before the kernel is
    given up."""
    shape = (h, hkv, d, quant is not None, dtype)
    single = [1, 40, CHUNK]
    if not _case(d, h, hkv, dtype, single, quant, kernels.WARPS):
        return False
    wide = kernels.WIDE_WARPS  # (CUDA only: elsewhere the single variant runs ``WARPS``)
    cuda = mx.cuda.is_available() and wide != kernels.WARPS
    if cuda and not _case(d, h, hkv, dtype, single, quant, wide):
        log.warning("the decode kernel at %d warps a block failed its check: not used", wide)
        kernels.NARROW.add(shape)
    split = [1, 40, 2 * CHUNK + 77]
    if _case(d, h, hkv, dtype, split, quant):
        return True
    if kernels.grouped(*shape) == 1:
        return False
    log.warning("grouped split decode kernel failed its check: one query head a block")
    kernels.UNGROUPED.add(shape)
    return _case(d, h, hkv, dtype, split, quant)


def _case(*case) -> bool:
    """``_check_case(*case)``, a failure to build or run counting as a disagreement."""
    try:
        return _check_case(*case)
    except Exception as e:  # noqa: BLE001 - any failure means: not this variant
        log.warning("paged decode kernel failed (%s: %s)", type(e).__name__, e)
        return False


def _check_case(
    d: int,
    h: int,
    hkv: int,
    dtype: mx.Dtype,
    lengths: list[int],
    quant: kv_quant.KVQuant | None,
    warps: int | None = None,
) -> bool:
    p, pages = 16, 96
    rng = np.random.default_rng(0)
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
    if quant is not None:
        pool = kv_quant.QuantizedPages(pages * p, (2 * hkv, d), dtype, quant)
        pool.q, pool.scales, pool.biases = pool.encode(kv)
        kv = pool
    t, n = mx.array(tables), mx.array(lengths, dtype=mx.int32)
    work = DecodeWork(lengths)
    got = paged_decode(q, kv, t, n, d**-0.5, p, work, warps=warps).astype(mx.float32)
    want = reference(q, kv, t, n, d**-0.5, p).astype(mx.float32)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    ok = bool(mx.allclose(got, want, atol=tol, rtol=tol))
    if not ok:
        err = float(mx.max(mx.abs(got - want)))
        log.warning(
            "paged decode kernel (%s) disagrees with the gather path (%.3g)",
            "split" if work.split else "single",
            err,
        )
    return ok
