"""Layer kinds: what each layer of a model caches and how its attention reads the pool.

The kind comes from the model's own declaration, ``model.make_cache()`` (mlx-lm's cache
objects): ``KVCache`` is full attention, ``RotatingKVCache(max_size=W)`` a sliding window of W
positions (the token itself and the W - 1 before it, as mlx-lm's rotating cache and its
windowed mask give), ``ChunkedKVCache(C)`` llama4's chunked attention (each query reads the
positions of its chunk of C: kept as a window of C, read from the chunk's start),
``ArraysCache`` a recurrent state (``runner.state``), ``CacheList`` a composite of those.
Every other cache kind (quantized or layer-shared caches) is refused at load, naming the
model type, the layer and the kind, before anything reaches a step.

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

import sys
from dataclasses import dataclass
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache

from tandem.runner import kv_owners


def model_modules(model: nn.Module) -> dict[str, ModuleType]:
    """The loaded modules the model and its layers come from, by name (where the seams and
    adapters are installed: a model may reuse another model's classes)."""
    names = {type(model).__module__} | {type(m).__module__ for m in model.modules()}
    return {n: sys.modules[n] for n in names if n in sys.modules}


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
    chunked: bool = False  # the window is llama4's chunk: positions since its chunk's start

    @property
    def span(self) -> int | None:
        """What its attention reads, as step_context's views take it: None (everything),
        W > 0 (a sliding window of W), -C (the query's chunk of C, runner.step_context)."""
        return -self.window if self.chunked and self.window else self.window

    @property
    def width(self) -> int:
        """Pool entries per slot for a dense layer: K and V flattened side by side."""
        return self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def bytes_per_token(self) -> int:
        return self.width * self.dtype.size

    @property
    def unused(self) -> bool:
        """The layer stores nothing in its cache (it has no attention)."""
        return self.k_heads == 0

    @property
    def kind(self) -> str:
        if self.unused:
            return "unused"
        base = "full" if self.window is None else f"window {self.window}"
        base = f"chunks of {self.window}" if self.chunked else base
        return f"{base}, {'dense' if self.dense else 'paged'}"


@dataclass(frozen=True)
class Attn:
    """A KV cache layer: full attention (window None), a sliding window, or chunked
    attention (llama4: each query reads its chunk of ``window`` positions)."""

    window: int | None = None
    chunked: bool = False


@dataclass(frozen=True)
class State:
    """A recurrent layer's fixed-size state (mlx-lm's ``ArraysCache`` of ``size`` arrays)."""

    size: int


# A model's caches as it declares them: one node per entry of ``make_cache()``, a tuple for
# a composite ``CacheList`` (e.g. falcon_h1's mamba state beside its attention).
Node = Attn | State | tuple


@dataclass(frozen=True)
class StateSpec:
    """Per array of a recurrent layer's cache: its per-sequence shape and dtype (None: the
    layer never sets that entry)."""

    entries: tuple[tuple[tuple[int, ...], mx.Dtype] | None, ...]

    @property
    def bytes_per_seq(self) -> int:
        return sum(int(np.prod(e[0])) * e[1].size for e in self.entries if e is not None)


def declared_layout(model: nn.Module, model_type: str) -> list[Node] | None:
    """The model's cache nodes from its own ``make_cache()``; None when it declares none
    (one full-attention cache per layer). Raises for kinds Tandem does not serve."""
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        return None
    return [_node(c, str(i), model_type) for i, c in enumerate(make_cache())]


def _node(c, where: str, model_type: str) -> Node:
    from mlx_lm.models.cache import (
        ArraysCache,
        CacheList,
        ChunkedKVCache,
        KVCache,
        RotatingKVCache,
    )

    kind = type(c).__name__
    if type(c) is KVCache:
        return Attn()
    if type(c) is ChunkedKVCache:
        return Attn(int(c.chunk_size), chunked=True)
    if type(c) is RotatingKVCache and not c.keep:
        return Attn(int(c.max_size))
    if type(c) is ArraysCache:
        return State(len(c.cache))
    if type(c) is CacheList:
        return tuple(_node(sub, f"{where}.{j}", model_type) for j, sub in enumerate(c.caches))
    if type(c) is RotatingKVCache:
        kind += f" with keep={c.keep}"
    raise ValueError(
        f"model type {model_type!r}: layer {where} needs cache kind {kind}, which Tandem "
        "does not serve yet (it serves KVCache, RotatingKVCache, ChunkedKVCache, ArraysCache "
        "and CacheList layers)"
    )


def build_caches(layout: list[Node], attn, state) -> tuple[list, list, list]:
    """Cache objects in the model's structure: ``attn(i, node)`` for the i-th attention node,
    ``state(j, node)`` for the j-th state node (CacheLists around composites). Returns
    (the model's cache list, attention objects, state objects) in index order."""
    attns: list = []
    states: list = []
    return [_make(n, attn, state, attns, states) for n in layout], attns, states


def _make(node: Node, attn, state, attns: list, states: list):
    """``build_caches``' recursion (a module function: a nested one calling itself would be
    a reference cycle holding every step's caches, and the pool, until a collection)."""
    from mlx_lm.models.cache import CacheList

    if isinstance(node, tuple):
        return CacheList(*(_make(n, attn, state, attns, states) for n in node))
    if isinstance(node, State):
        states.append(state(len(states), node))
        return states[-1]
    attns.append(attn(len(attns), node))
    return attns[-1]


class ProbeCache:
    """Records what a layer stores and what its attention receives."""

    def __init__(self) -> None:
        self.offset = 0
        self.stored: tuple[mx.array, mx.array] | None = None
        self.seam_ok: bool | None = None  # None: the seam never saw this cache
        self.mask_windows: set[int] = set()  # windows the model asked this cache's masks for

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.stored = (keys, values)
        kv_owners.stored(keys, values, self)
        return keys, values

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """What the last ``update_and_fetch`` returned (gemma3n's KV-shared layers read it)."""
        if self.stored is None:
            raise AttributeError("the cache has stored nothing yet")
        return self.stored

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            self.mask_windows.add(window_size)
        return None

    def at_seam(self, keys: mx.array, values: mx.array, mask) -> None:
        stored = self.stored
        ok = stored is not None and keys is stored[0] and values is stored[1] and mask is None
        self.seam_ok = ok if self.seam_ok is None else (self.seam_ok and ok)


# Model types whose code reads and reassigns a cache's ``keys``/``values`` only to manage its
# lazy graph: DeepSeek sparse attention's indexer zeroes ``values`` and ties the caches
# together with ``mx.depends``; it computes nothing from them (tested in the family suite).
# Their caches (``Bookkeeping``) answer a read with what ``update_and_fetch`` returned and
# drop an assignment. Any other model that touches them is refused at load: it may compute
# with them (minimax_m3_vl's block-sparse indexer places queries by the keys' count, which a
# gathered, padded history does not give).
GRAPH_BOOKKEEPING = frozenset({"deepseek_v32", "glm_moe_dsa"})


class Bookkeeping:
    """``keys``/``values`` for GRAPH_BOOKKEEPING models' caches (a mixin, after a cache
    class with ``keys_and_values``)."""

    @property
    def keys(self) -> mx.array:
        return self.keys_and_values()[0]  # type: ignore[attr-defined]

    @keys.setter
    def keys(self, _value: mx.array) -> None:
        pass

    @property
    def values(self) -> mx.array:
        return self.keys_and_values()[1]  # type: ignore[attr-defined]

    @values.setter
    def values(self, _value: mx.array) -> None:
        pass


class BookkeepingProbe(ProbeCache, Bookkeeping):
    pass


class ProbeState(ArraysCache):
    """Records the arrays a recurrent layer keeps (an ``ArraysCache``, as model code checks)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)


def probe_layers(
    model: nn.Module, model_type: str, layout: list[Node] | None
) -> tuple[list[Node], list[LayerSpec], list[StateSpec], int]:
    """The layout, each attention layer's spec, each state layer's spec and the vocabulary
    size, from one token through the model (the seam must be installed: it reports to
    ``ProbeCache.at_seam``)."""
    if layout is None:
        layout = [Attn() for _ in model.layers]
    probe = BookkeepingProbe if model_type in GRAPH_BOOKKEEPING else ProbeCache
    caches, attns, states = build_caches(
        layout, lambda i, n: probe(), lambda j, n: ProbeState(n.size)
    )
    try:
        with kv_owners.forward():
            logits = model(mx.array([[0]]), cache=caches)
        first = [[None if a is None else a.dtype for a in c.cache] for c in states]
        if states:  # a state's dtype may change once it exists (float32 SSM parameters)
            for c in attns:
                c.stored, c.offset = None, 1
            with kv_owners.forward():
                model(mx.array([[1]]), cache=caches)
    except Exception as e:  # noqa: BLE001 - it uses its caches in ways Tandem's do not serve
        raise ValueError(
            f"model type {model_type!r} does not run on Tandem's caches: {type(e).__name__}: {e}"
        ) from e
    state_specs = []
    for j, c in enumerate(states):
        entries = tuple(
            None
            if a is None
            else (tuple(a.shape[1:]), a.dtype if d is None else _wider(a.dtype, d))
            for a, d in zip(c.cache, first[j], strict=True)
        )
        if all(e is None for e in entries):
            raise ValueError(f"model type {model_type!r}: state layer {j} keeps no state")
        state_specs.append(StateSpec(entries))
    windows = [n.window for n in _flat(layout) if isinstance(n, Attn)]
    chunked = [n.chunked for n in _flat(layout) if isinstance(n, Attn)]
    specs = []
    if attns and all(c.stored is None for c in attns):
        raise ValueError(
            f"model type {model_type!r}: attention layer 0 stores nothing in its cache, nor "
            "does any other"
        )
    for i, c in enumerate(attns):
        if c.stored is None:
            # A declared cache the layer never uses (nemotron-nas: attention replaced by a
            # linear layer): no pool entries. One another layer's KV was meant to reach
            # would compute wrong scores, which the load check refuses.
            specs.append(LayerSpec(0, 0, 0, 0, mx.float32, window=windows[i], chunked=chunked[i]))
            continue
        k, v = c.stored
        if k.ndim != 4 or v.ndim != 4 or k.shape[2] != 1 or v.shape[2] != 1:
            raise ValueError(
                f"model type {model_type!r}: attention layer {i} caches arrays shaped "
                f"{k.shape} and {v.shape}, not (batch, heads, tokens, dim)"
            )
        same = k.shape == v.shape and k.dtype == v.dtype
        if c.mask_windows - {windows[i]}:
            raise ValueError(
                f"model type {model_type!r}: attention layer {i} caches a window of "
                f"{windows[i] or 'all'} positions but asks for masks of {sorted(c.mask_windows)} "
                "(mlx-lm's prefill and decode see different windows), which Tandem does not "
                "serve"
            )
        specs.append(
            LayerSpec(
                k_heads=k.shape[1],
                k_dim=k.shape[3],
                v_heads=v.shape[1],
                v_dim=v.shape[3],
                dtype=k.dtype,
                window=windows[i],
                dense=not (same and c.seam_ok),
                chunked=chunked[i],
            )
        )
    return layout, specs, state_specs, int(logits.shape[-1])


def _wider(a: mx.Dtype, b: mx.Dtype) -> mx.Dtype:
    return (mx.zeros((1,), a) + mx.zeros((1,), b)).dtype


def _flat(layout: list[Node]) -> list[Node]:
    out: list[Node] = []
    for n in layout:
        out.extend(_flat(list(n)) if isinstance(n, tuple) else [n])
    return out
