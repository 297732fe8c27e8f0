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

Both assume one token per row, as a paged step feeds attention models; the (B, n) calls of
recurrent models would be compared by the load check against mlx-lm before any step (no
model type of mlx-lm combines the two).
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

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


def _llama4_text_model(module: ModuleType) -> None:
    """Run llama4's text model without the mask built from scalar offsets, on Tandem's caches."""
    cls = module.LlamaModel
    if getattr(cls, "_tandem", False):
        return
    mlx_lm_call = cls.__call__
    chunked = module.ChunkedKVCache

    def __call__(self, inputs: mx.array, cache=None):
        if cache is None or any(isinstance(c, chunked) for c in cache):
            return mlx_lm_call(self, inputs, cache)
        h = self.embed_tokens(inputs)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, None, cache=c)
        return self.norm(h)

    cls.__call__ = __call__
    cls._tandem = True
    module.__dict__["mx"] = MLX


def install(model: nn.Module) -> bool:
    """Adapt the modules of ``model`` that take the cache offset as a number; True when one
    was (or already had been)."""
    found = False
    for name, module in model_modules(model).items():
        if not name.startswith("mlx_lm."):
            continue
        if module.__dict__.get("np") is NUMPY or module.__dict__.get("mx") is MLX:
            found = True
        elif name == "mlx_lm.models.llama4":
            _llama4_text_model(module)
            found = True
        elif module.__dict__.get("np") is np and "np.arange(cache[0].offset" in _source(module):
            module.__dict__["np"] = NUMPY
            found = True
    return found
