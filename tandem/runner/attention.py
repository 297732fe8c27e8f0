"""Paged attention at mlx-lm's seam.

mlx-lm's attention layers call ``scaled_dot_product_attention(queries, keys, values, cache=...,
scale=..., mask=...)``, imported by name from ``mlx_lm.models.base`` into each model module.
``install`` rebinds that name in a model's module to ``paged_sdpa``, which handles our
``PagedCache`` and hands every other cache to mlx-lm's own function, so model code stays
unmodified. A module without the seam still runs: its layers are dense (``runner.layers``).

A paged step feeds its tokens as a batch of single-token sequences, ``(T, heads, 1, D)``
queries. Single-token segments (decodes) are attended in groups of similar length over their
own pages (gathered, padded to the group's longest, masked) or by the decode kernel; a
multi-token segment (a prefill chunk) gathers its own pages — or, starting at 0, uses its
fresh keys — and runs the fused SDPA; new prompts' chunks run it once a group, batched and
padded to the group's longest (``step_groups.batch_fresh``). A sliding-window layer reads
the last W positions only. Attention sinks (gpt-oss) go to the fused SDPA as mlx-lm passes
them. Either way a step reads the keys its segments have, not rows x longest.

Keys reach attention from the layer that stored them, or from another layer: gemma3n and
gemma4 layers share an earlier layer's KV (passed with that layer's cache, or with none),
iquestloopcoder's second loop attends over the first loop's keys with its own windowed cache.
So each forward records, by identity, which cache returned which keys (``runner.kv_owners``),
and the seam reads the pool of the cache that stored them, with its window.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

from tandem.runner import kernels, kv_owners, kv_quant
from tandem.runner.layers import ProbeCache, model_modules
from tandem.runner.paged import PagedCache, flat_tokens
from tandem.runner.step_context import AttnView

SEAM = "scaled_dot_product_attention"


def model_module(model: nn.Module) -> ModuleType:
    return sys.modules[type(model).__module__]


def has_seam(module: ModuleType) -> bool:
    return callable(getattr(module, SEAM, None))


def install(model: nn.Module) -> None:
    """Route the model's attention through ``paged_sdpa`` in every module its layers come
    from that has the seam (a model may reuse another model's attention class)."""
    for name, module in model_modules(model).items():
        if name == "mlx_lm.models.base" or not name.startswith("mlx_lm."):
            continue  # base defines the function itself
        if has_seam(module) and getattr(module, SEAM) is not paged_sdpa:
            module.__dict__[SEAM] = paged_sdpa


def _mlx_lm_sdpa(queries, keys, values, cache, scale, mask, sinks):
    fn = importlib.import_module("mlx_lm.models.base").scaled_dot_product_attention
    return fn(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def paged_sdpa(queries, keys, values, cache, scale: float, mask, sinks=None):
    owner = kv_owners.owner(keys, values)
    if owner is not None:  # the keys of a layer (this one, or one whose KV this one shares)
        cache = owner
    if isinstance(cache, ProbeCache):
        cache.at_seam(keys, values, mask)
    if not isinstance(cache, PagedCache):
        return _mlx_lm_sdpa(queries, keys, values, cache, scale, mask, sinks)
    if cache.spec.dense:  # keys and values are each token's gathered history
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )
    pool = cache.state
    view = cache.ctx.view(cache.spec.span, kernel=sinks is None)
    if cache.ctx.sequence:  # (B, H, n, D) -> (B n, H, 1, D) and back
        b, _, n, _ = queries.shape
        flat = [flat_tokens(x)[:, :, None, :] for x in (queries, keys, values)]
        out = gather_attention(view, *flat, pool, scale, sinks, cache.token)[:, :, 0, :]
        return out.reshape(b, n, *out.shape[1:]).transpose(0, 2, 1, 3)
    return gather_attention(view, queries, keys, values, pool, scale, sinks, cache.token)


def gather_attention(
    view: AttnView,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    pool: kv_quant.Buffer,
    scale: float,
    sinks: mx.array | None = None,
    token: mx.array | None = None,
) -> mx.array:
    """``queries`` (T, H, 1, D), the step's fresh ``keys``/``values`` (T, Hkv, 1, D), the
    layer's pool (slots, 2 Hkv, D: K then V; head-major (pages, 2 Hkv, page, D); or its
    quantized pages) already holding them
    (``token``: the in-place write the reads wait on, ``runner.kv_write``). Returns
    (T, H, 1, D). Without the kernel this is the pure-MLX path, and the oracle of every
    kernel."""
    hkv = keys.shape[1]
    float_pool = isinstance(pool, mx.array) and pool.shape[1] == 2 * hkv
    outs = []
    for g in view.decodes:
        q = g.queries(queries)  # (B, H, 1, D)
        if view.kernel:
            assert pool.ndim != 4, "the decode kernel reads position-major pages"
            outs.append(
                kernels.paged_decode(
                    q, pool, g.tables, g.lengths, scale, g.page, g.work, token=token
                )
            )
            continue
        if float_pool and pool.ndim == 4:  # head-major: whole pages, (B, Hkv, L, D) each
            k, v = kv_quant.take_head_pages(pool, g.page_rows(hkv), 0, g.longest)
        elif float_pool:  # (B, Hkv, L, D) each
            k, v = kv_quant.take_heads(pool, g.head_rows(hkv), token)
        else:
            x = kv_quant.take_pages(pool, g.tables, g.page, g.longest, token)  # (B, L, 2 Hkv, D)
            # MLX's CPU SDPA is ~3x slower on strided K/V than on contiguous copies of them.
            k = mx.contiguous(x[:, :, :hkv].transpose(0, 2, 1, 3))
            v = mx.contiguous(x[:, :, hkv:].transpose(0, 2, 1, 3))
        outs.append(
            mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=g.mask, sinks=sinks)
        )
    for c in view.chunks:
        if c.members:  # new prompts: one batched call
            outs.append(_fresh_batch(c, queries, keys, values, pool, scale, sinks))
            continue
        q = queries[c.first : c.first + c.n, :, 0, :].transpose(1, 0, 2)[None]  # (1, H, n, D)
        if c.slots is None:
            k, v = kv_quant.roundtrip(
                pool,
                keys[c.first : c.first + c.n, :, 0, :],
                values[c.first : c.first + c.n, :, 0, :],
            )
            k, v = mx.contiguous(k.transpose(1, 0, 2)), mx.contiguous(v.transpose(1, 0, 2))
        elif float_pool and pool.ndim == 4:  # (Hkv, L, D) each
            k, v = kv_quant.take_head_pages(pool, c.page_rows(hkv), c.skip, c.slots.shape[0])
        elif float_pool:  # (Hkv, L, D) each
            k, v = kv_quant.take_heads(pool, c.head_rows(hkv), token)
        else:
            x = kv_quant.take(pool, c.slots, token)  # (L, 2 Hkv, D)
            k = mx.contiguous(x[:, :hkv].transpose(1, 0, 2))
            v = mx.contiguous(x[:, hkv:].transpose(1, 0, 2))
        k, v = k[None], v[None]
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=c.mask, sinks=sinks)
        outs.append(o[0].transpose(1, 0, 2)[:, :, None, :])  # (n, H, 1, D)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    if view.unpermute is not None:
        out = out[view.unpermute]
    return out


def _fresh_batch(c, queries, keys, values, pool, scale: float, sinks) -> mx.array:
    """The batched item ``c``'s members, each attending its own fresh keys causally, in one
    call over (members, heads, ``c.n``, D): (their tokens, H, 1, D), member by member."""
    if c.pad_rows is None:  # one run of equal lengths: the step's rows as they are
        lo, hi = c.first, c.first + c.n * c.count
        q, k, v = queries[lo:hi, :, 0, :], keys[lo:hi, :, 0, :], values[lo:hi, :, 0, :]
    else:
        rows = c.pad_rows
        q, k, v = queries[rows, :, 0, :], keys[rows, :, 0, :], values[rows, :, 0, :]
    k, v = kv_quant.roundtrip(pool, k, v)

    def batch(x: mx.array) -> mx.array:  # (count n, heads, D) -> (count, heads, n, D)
        return x.reshape(c.count, c.n, *x.shape[1:]).transpose(0, 2, 1, 3)

    o = mx.fast.scaled_dot_product_attention(
        batch(q),
        mx.contiguous(batch(k)),
        mx.contiguous(batch(v)),
        scale=scale,
        mask="causal",
        sinks=sinks,
    )
    o = o.transpose(0, 2, 1, 3).reshape(c.count * c.n, o.shape[1], o.shape[3])
    if c.real_rows is not None:
        o = o[c.real_rows]
    return o[:, :, None, :]
