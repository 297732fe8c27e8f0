"""Layer kinds: what each layer of a model caches and how its attention reads the pool.

The kind comes from the model's own declaration, ``model.make_cache()`` (mlx-lm's cache
objects): ``KVCache`` is full attention, ``RotatingKVCache(max_size=W)`` a sliding window of W
positions (the token itself and the W - 1 before it, as mlx-lm's rotating cache and its
windowed mask give). Every other cache kind (recurrent ``ArraysCache`` state, ``CacheList``,
chunked or quantized caches) is refused at load, naming the model type, the layer and the
kind, before anything reaches a step.

A probe then runs one token through the model with caches that record every array each layer
stores and what its attention does with them:

- **paged**: the layer hands exactly the arrays ``update_and_fetch`` returned (and no array
  mask of its own) to mlx-lm's ``scaled_dot_product_attention``, and K and V have one shape:
  attention runs at the seam over the request's own pages (``runner.attention``);
- **dense**: anything else (a model that computes its scores itself, e.g. gemma2's logit
  soft-capping, or MLA latents whose "keys" and "values" differ in shape and whose rope scores
  come in as a mask): ``update_and_fetch`` returns each token's own history gathered from the
  pool, padded, and the mask the model asks for marks the real positions. Correct for any
  such layer; it costs tokens x context per layer, so the runner caps a dense model's tokens
  per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class LayerSpec:
    """One cache layer: K (heads, dim) and V (heads, dim) per token, the window (None: full
    attention) and whether attention runs at the seam (paged) or on gathered history."""

    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int
    dtype: mx.Dtype
    window: int | None = None
    dense: bool = False

    @property
    def width(self) -> int:
        """Pool entries per slot for a dense layer: K and V flattened side by side."""
        return self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def bytes_per_token(self) -> int:
        return self.width * self.dtype.size

    @property
    def kind(self) -> str:
        base = "full" if self.window is None else f"window {self.window}"
        return f"{base}, {'dense' if self.dense else 'paged'}"


def declared_windows(model: nn.Module, model_type: str) -> list[int | None] | None:
    """Per cache layer: None (full attention) or the sliding window; None overall when the
    model declares no caches (one full-attention cache per layer). Raises for kinds Tandem
    does not serve."""
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        return None
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    windows: list[int | None] = []
    for i, c in enumerate(make_cache()):
        kind = type(c).__name__
        if type(c) is KVCache:
            windows.append(None)
        elif type(c) is RotatingKVCache and not c.keep:
            windows.append(int(c.max_size))
        else:
            if type(c) is RotatingKVCache:
                kind += f" with keep={c.keep}"
            raise ValueError(
                f"model type {model_type!r}: layer {i} needs cache kind {kind}, which Tandem "
                "does not serve yet (it serves KVCache and RotatingKVCache layers)"
            )
    return windows


class ProbeCache:
    """Records what a layer stores and what its attention receives."""

    def __init__(self) -> None:
        self.offset = 0
        self.stored: tuple[mx.array, mx.array] | None = None
        self.seam_ok: bool | None = None  # None: the seam never saw this cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.stored = (keys, values)
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return None

    def at_seam(self, keys: mx.array, values: mx.array, mask) -> None:
        stored = self.stored
        ok = stored is not None and keys is stored[0] and values is stored[1] and mask is None
        self.seam_ok = ok if self.seam_ok is None else (self.seam_ok and ok)


def probe_layers(
    model: nn.Module, model_type: str, windows: list[int | None] | None
) -> tuple[list[LayerSpec], int]:
    """Each cache layer's spec and the vocabulary size, from one token through the model
    (the seam must be installed: it reports to ``ProbeCache.at_seam``)."""
    n = len(windows) if windows is not None else len(model.layers)
    caches = [ProbeCache() for _ in range(n)]
    logits = model(mx.array([[0]]), cache=caches)
    specs = []
    for i, c in enumerate(caches):
        if c.stored is None:
            raise ValueError(
                f"model type {model_type!r}: layer {i} stores nothing in its cache "
                "(shared or skipped KV), which Tandem does not serve yet"
            )
        k, v = c.stored
        if k.ndim != 4 or v.ndim != 4 or k.shape[2] != 1 or v.shape[2] != 1:
            raise ValueError(
                f"model type {model_type!r}: layer {i} caches arrays shaped {k.shape} and "
                f"{v.shape}, not (batch, heads, tokens, dim)"
            )
        same = k.shape == v.shape and k.dtype == v.dtype
        specs.append(
            LayerSpec(
                k_heads=k.shape[1],
                k_dim=k.shape[3],
                v_heads=v.shape[1],
                v_dim=v.shape[3],
                dtype=k.dtype,
                window=windows[i] if windows is not None else None,
                dense=not (same and c.seam_ok),
            )
        )
    return specs, int(logits.shape[-1])
