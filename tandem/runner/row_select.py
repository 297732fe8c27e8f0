"""The LM head only on the rows a step needs: a wrapper around the model's body."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class SelectRows(nn.Module):
    """Wraps the model body so the LM head runs only on the rows a step needs (sampled and
    prompt-scored positions), not on every prefill token."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_rows", None)

    def __getattr__(self, name: str):
        # The outer model reaches into its body (tied embeddings: model.embed_tokens).
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "inner":
                raise
            return getattr(self.inner, name)

    def select(self, rows: mx.array | None, *, sequence: bool = False) -> None:
        """Keep only token ``rows``: of (T, 1, D) rows, or of (B, n, D) sequences taken
        sequence by sequence (returned as (k, 1, D) either way)."""
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_sequence", sequence)

    def __call__(self, *args, **kwargs):
        h = self.inner(*args, **kwargs)
        rows = self.__dict__.get("_rows")
        if rows is None:
            return h
        if self.__dict__.get("_sequence"):
            return h.reshape(-1, h.shape[-1])[rows][:, None]
        return h[rows]


def install_row_selection(model: nn.Module) -> SelectRows | None:
    """Put ``SelectRows`` around ``model.model`` when the model's output equals its head
    applied to the selected rows (checked on a probe); None: full logits, rows taken after."""
    inner = model.get("model") if isinstance(model, dict) else None
    if not isinstance(inner, nn.Module) or not hasattr(inner, "layers"):
        return None
    x = mx.array([[1], [2], [3]])
    full = model(x)
    wrapper = SelectRows(inner)
    model.model = wrapper
    rows = mx.array([2, 0])
    wrapper.select(rows)
    try:
        ok = bool(mx.allclose(model(x), full[rows], atol=1e-4, rtol=1e-3))
    except Exception:  # noqa: BLE001 - a model that does more after its body: no selection
        ok = False
    wrapper.select(None)
    if not ok:
        model.model = inner
        return None
    return wrapper
