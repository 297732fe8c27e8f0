"""Paged attention at mlx-lm's seam.

mlx-lm's attention layers call ``scaled_dot_product_attention(queries, keys, values, cache=...,
scale=..., mask=...)``, imported by name from ``mlx_lm.models.base`` into each model module.
``install`` rebinds that name in a model's module to ``paged_sdpa``, which handles our
``PagedCache`` and hands every other cache to mlx-lm's own function, so model code stays
unmodified.

A paged step feeds its tokens as a batch of single-token sequences, ``(T, heads, 1, D)``
queries. Single-token segments (decodes) are attended in groups of similar length over their
own pages (gathered, padded to the group's longest, masked); a multi-token segment (a prefill
chunk) gathers its own pages — or, starting at 0, uses its fresh keys — and runs the fused
causal SDPA. Either way a step reads the keys its segments have, not rows x longest.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

from tandem.runner import kernels
from tandem.runner.paged import PagedCache, StepContext

SEAM = "scaled_dot_product_attention"


def model_module(model: nn.Module) -> ModuleType:
    return sys.modules[type(model).__module__]


def has_seam(module: ModuleType) -> bool:
    return callable(getattr(module, SEAM, None))


def install(model: nn.Module) -> None:
    """Route the model's attention through ``paged_sdpa``; raises if the seam is missing."""
    module = model_module(model)
    current = getattr(module, SEAM, None)
    if current is paged_sdpa:
        return
    if not callable(current):
        raise ValueError(
            f"{module.__name__} does not call {SEAM}: Tandem cannot page its attention"
        )
    module.__dict__[SEAM] = paged_sdpa


def paged_sdpa(queries, keys, values, cache, scale: float, mask, sinks=None):
    if not isinstance(cache, PagedCache):
        fn = importlib.import_module("mlx_lm.models.base").scaled_dot_product_attention
        return fn(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    if sinks is not None:
        raise ValueError("attention sinks are not supported by paged attention yet")
    return gather_attention(cache.ctx, queries, keys, values, cache.state, scale)


def gather_attention(
    ctx: StepContext,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    pool: mx.array,
    scale: float,
) -> mx.array:
    """``queries`` (T, H, 1, D), the step's fresh ``keys``/``values`` (T, Hkv, 1, D), the
    layer's pool (slots, 2 Hkv, D: K then V) already holding them. Returns (T, H, 1, D).
    Without the kernel this is the pure-MLX path, and the oracle of every kernel."""
    hkv = keys.shape[1]
    p = ctx.pool.page_size
    pages = pool.reshape(pool.shape[0] // p, -1)  # whole pages: contiguous gathers
    outs = []
    for g in ctx.decodes:
        q = g.queries(queries)  # (B, H, 1, D)
        if ctx.kernel:
            o = kernels.paged_decode(q[:, :, 0, :], pool, g.tables, g.lengths, scale, p, g.work)
            outs.append(o[:, :, None, :])
            continue
        b = g.tables.shape[0]
        x = pages[g.tables].reshape(b, -1, 2 * hkv, pool.shape[-1])[:, : g.longest]
        # MLX's CPU SDPA is ~3x slower on strided K/V than on contiguous copies of them.
        k = mx.contiguous(x[:, :, :hkv].transpose(0, 2, 1, 3))  # (B, Hkv, L, D)
        v = mx.contiguous(x[:, :, hkv:].transpose(0, 2, 1, 3))
        outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=g.mask))
    for c in ctx.chunks:
        q = queries[c.first : c.first + c.n, :, 0, :].transpose(1, 0, 2)[None]  # (1, H, n, D)
        if c.slots is None:
            k = keys[c.first : c.first + c.n, :, 0, :]
            v = values[c.first : c.first + c.n, :, 0, :]
        else:
            x = pool[c.slots]  # (L, 2 Hkv, D)
            k, v = x[:, :hkv], x[:, hkv:]
        k = mx.contiguous(k.transpose(1, 0, 2)[None])
        v = mx.contiguous(v.transpose(1, 0, 2)[None])
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        outs.append(o[0].transpose(1, 0, 2)[:, :, None, :])  # (n, H, 1, D)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    if ctx.unpermute is not None:
        out = out[ctx.unpermute]
    return out
