"""Learned positions computed with numpy from the cache offset (gpt_bigcode's
``np.arange(cache[0].offset, cache[0].offset + L)``).

mlx-lm's caches hold one Python number per layer; Tandem's (runner/paged.py) hold each
token's position, an ``mx.array`` of the step's T rows of one token each. numpy turns a
one-element array into a number, so such a model ran one row and failed with more
("Only length-1 arrays can be converted to Python scalars"). In the module of such a model,
``np`` becomes numpy with one change: ``arange(start, stop)`` with an array ``start`` gives
each row's position, ``start[:, None]`` ((T, 1): one token per row, as a paged step feeds
them). Everything else, and ``arange`` on numbers (mlx-lm's own caches), is numpy's. A
layout with more tokens per row (the (B, n) calls of recurrent models) would be compared by
the load check against mlx-lm before any step; no model type of mlx-lm combines the two.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class _RowPositions(ModuleType):
    """numpy, with ``arange`` taking a (T,) array of positions as its start."""

    def __init__(self) -> None:
        super().__init__("numpy")

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def arange(start: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(start, mx.array):
            assert start.ndim == 1, "one position per row"
            return start[:, None]
        return np.arange(start, *args, **kwargs)


NUMPY = _RowPositions()


def _reads_offset_with_numpy(module: ModuleType) -> bool:
    """Whether the module calls ``np.arange`` on a cache offset (read from its source)."""
    import inspect

    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return False
    return "np.arange(cache[0].offset" in source


def install(model: nn.Module) -> bool:
    """Give the model's modules that compute positions with numpy from the cache offset the
    numpy above; True when one did."""
    names = {type(model).__module__} | {type(m).__module__ for m in model.modules()}
    found = False
    for name in names:
        module = sys.modules.get(name)
        if module is None or not name.startswith("mlx_lm."):
            continue
        if module.__dict__.get("np") is NUMPY:
            found = True
        elif module.__dict__.get("np") is np and _reads_offset_with_numpy(module):
            module.__dict__["np"] = NUMPY
            found = True
    return found
