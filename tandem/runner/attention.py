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
    k_pool, v_pool = cache.state
    return gather_attention(cache.ctx, queries, keys, values, k_pool, v_pool, scale)


def gather_attention(
    ctx: StepContext,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    scale: float,
) -> mx.array:
    """The pure-MLX path (and the oracle of every kernel): ``queries`` (T, H, 1, D), the
    step's fresh ``keys``/``values`` (T, Hkv, 1, D), the layer's pool (S, Hkv, D) already
    holding them. Returns (T, H, 1, D)."""
    outs = []
    for g in ctx.decodes:
        q = queries[g.rows]  # (B, H, 1, D)
        k = k_pool[g.slots].transpose(0, 2, 1, 3)  # (B, Hkv, L, D)
        v = v_pool[g.slots].transpose(0, 2, 1, 3)
        outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=g.mask))
    for c in ctx.chunks:
        q = queries[c.first : c.first + c.n, :, 0, :].transpose(1, 0, 2)[None]  # (1, H, n, D)
        if c.slots is None:
            k = keys[c.first : c.first + c.n, :, 0, :]
            v = values[c.first : c.first + c.n, :, 0, :]
        else:
            k, v = k_pool[c.slots], v_pool[c.slots]  # (L, Hkv, D)
        k, v = k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        outs.append(o[0].transpose(1, 0, 2)[:, :, None, :])  # (n, H, 1, D)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    if ctx.unpermute is not None:
        out = out[ctx.unpermute]
    return out
