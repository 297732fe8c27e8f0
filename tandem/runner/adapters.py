"""Model code of mlx-lm that takes the cache offset as one number.

mlx-lm's caches hold one Python number per layer; Tandem's (runner/paged.py) hold each
token's position, an ``mx.array`` of the step's T rows of one token each. Where a model
computes positions from the offset with numpy or ``mx.arange``, or builds a mask from it,
that fails (or would run one row only). The adaptations here change names in the model's own
module, so the model code runs unchanged on mlx-lm's caches (the load check's reference) and
on Tandem's:

- **numpy positions** (gpt_bigcode: ``np.arange(cache[0].offset, cache[0].offset + L)``,
  its learned position embeddings): the module's ``np`` becomes numpy whose ``arange`` over
  an array start gives each row's position, ``start[:, None]`` ((T, 1): one token per row).
- **llama4**: its text model builds the chunk mask from the first cache's offset and start,
  and trims its ``ChunkedKVCache`` objects, before the layers run; on Tandem's caches the
  layers run with no mask (the seam knows each layer's chunks or lack of them: its
  ``LayerSpec.span``). Its global layers scale queries by a temperature of each position,
  ``mx.arange(offset + 1, offset + L + 1)``: the module's ``mx`` becomes mlx.core whose
  ``arange`` over an array start gives each row's position (+ 1), shaped (T, 1, 1) so the
  model's ``[:, None]`` makes it (T, 1, 1, 1) against queries of (T, heads, 1, dim).

- **afm7**: its KV-reuse layers place queries at the reused keys' count; on Tandem's caches,
  at each row's position in the cache that stored them.
- **longcat_flash_ngram**: its n-gram embedding's state (the last n - 1 token ids) grows
  with the first tokens; on Tandem's caches it starts as n - 1 zeros, a fixed shape.

The first two assume one token per row, as a paged step feeds attention models; the (B, n) calls of
recurrent models would be compared by the load check against mlx-lm before any step (no
model type of mlx-lm combines the two).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tandem.runner import kv_owners
from tandem.runner.layers import model_modules


class _Rows(ModuleType):
    """A module (numpy or mlx.core) whose ``arange`` over an array start gives each row's
    position in ``shape``."""

    def __init__(self, base: ModuleType, shape: tuple[int, ...]) -> None:
        super().__init__(base.__name__)
        self._base, self._shape = base, shape

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def arange(self, start: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(start, mx.array):
            assert start.ndim == 1, "one position per row"
            return start.reshape(self._shape)
        return self._base.arange(start, *args, **kwargs)


NUMPY = _Rows(np, (-1, 1))
MLX = _Rows(mx, (-1, 1, 1))


def _source(module: ModuleType) -> str:
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""


def _replace_call(cls: type, adapted: Callable[[Callable], Callable]) -> None:
    """``cls.__call__`` becomes ``adapted(mlx-lm's __call__)``, once (a second model of the
    family in the process finds it done)."""
    if not getattr(cls, "_tandem", False):
        cls.__call__ = adapted(cls.__call__)
        cls._tandem = True


def _llama4_text_model(module: ModuleType) -> None:
    """Run llama4's text model without the mask built from scalar offsets, on Tandem's caches."""
    chunked = module.ChunkedKVCache

    def adapted(mlx_lm_call: Callable) -> Callable:
        def __call__(self, inputs: mx.array, cache=None):
            if cache is None or any(isinstance(c, chunked) for c in cache):
                return mlx_lm_call(self, inputs, cache)
            h = self.embed_tokens(inputs)
            for layer, c in zip(self.layers, cache, strict=True):
                h = layer(h, None, cache=c)
            return self.norm(h)

        return __call__

    _replace_call(module.LlamaModel, adapted)
    module.__dict__["mx"] = MLX


class _Context:
    """A stand-in for the n-gram embedding's cache: its context as a fixed-size state."""

    def __init__(self, cache: Any, context: mx.array) -> None:
        self.cache, self.context = cache, context

    def __getitem__(self, idx: int) -> mx.array:
        return self.context

    def __setitem__(self, idx: int, value: mx.array) -> None:
        self.cache[idx] = value


def _ngram_context(module: ModuleType) -> None:
    """longcat_flash_ngram on Tandem's state slots: its n-gram embedding keeps the last
    n - 1 token ids as a state that grows from none to n - 1 with the first tokens, and
    Tandem's slots hold a fixed shape. On Tandem's caches the state starts as n - 1 zeros
    instead: mlx-lm shifts the ids right with zeros, so the ids it reads at every position
    are the same, and the state it keeps is always the last n - 1 (the padded context's)."""
    own = module.ArraysCache

    def adapted(mlx_lm_call: Callable) -> Callable:
        def __call__(self, input_ids: mx.array, cache=None):
            if cache is None or type(cache) is own:  # mlx-lm's own cache
                return mlx_lm_call(self, input_ids, cache)
            context = cache[0]
            if context is None:
                context = mx.zeros((input_ids.shape[0], self.n - 1), dtype=mx.int64)
            return mlx_lm_call(self, input_ids, _Context(cache, context.astype(mx.int64)))

        return __call__

    _replace_call(module.NgramEmbedding, adapted)


def _afm7_reuse(module: ModuleType) -> None:
    """afm7's KV-reuse layers attend with the last layer's keys and place their queries at
    ``keys.shape[2] - L``: the keys' count in mlx-lm's caches, but one fresh key per row in
    Tandem's. On Tandem's caches the queries take each row's position from the cache that
    stored the keys (the seam attends over its pages, as for the layer itself)."""
    from tandem.runner.paged import PagedCache

    def adapted(mlx_lm_call: Callable) -> Callable:
        def __call__(self, x: mx.array, keys: mx.array, values: mx.array, mask=None):
            owner = kv_owners.owner(keys, values)
            if not isinstance(owner, PagedCache):
                return mlx_lm_call(self, x, keys, values, mask)
            b, n, _ = x.shape
            queries = self.q_proj(x).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
            queries = self.q_norm(self.rope(queries, offset=owner.offset))
            sdpa = module.scaled_dot_product_attention  # (Tandem's seam, installed there)
            out = sdpa(queries, keys, values, cache=None, scale=self.scale, mask=mask)
            return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))

        return __call__

    _replace_call(module.KVReuseAttention, adapted)


def install(model: nn.Module) -> bool:
    """Adapt the modules of ``model`` that take the cache offset as a number; True when one
    was (or already had been)."""
    found = False
    for name, module in model_modules(model).items():
        if not name.startswith("mlx_lm."):
            continue
        if module.__dict__.get("np") is NUMPY or module.__dict__.get("mx") is MLX:
            found = True
        elif name == "mlx_lm.models.afm7":
            _afm7_reuse(module)
            found = True
        elif name == "mlx_lm.models.longcat_flash_ngram":
            _ngram_context(module)
            found = True
        elif name == "mlx_lm.models.llama4":
            _llama4_text_model(module)
            found = True
        elif module.__dict__.get("np") is np and "np.arange(cache[0].offset" in _source(module):
            module.__dict__["np"] = NUMPY
            found = True
    return found
