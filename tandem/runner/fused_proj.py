"""Projections of one input in one matmul: a layer's ``q_proj``, ``k_proj`` and ``v_proj``
(and its MLP's ``gate_proj`` and ``up_proj``) become slices of one matmul over their
concatenated weights, so a decode step launches 4 matmuls a layer instead of 7 (on MLX's
CUDA backend each is a kernel the host encodes and launches, and a single-stream step is
all host time).

mlx-lm's modules stay as they are: each projection is replaced by a ``Part`` that asks the
layer's ``FusedLinear`` for its slice of the input. The first part called on an input
computes the fused product; the others called on the same input (the same array object)
take their slices of it. A part called on another input while a product is pending (a model
that projects keys from another tensor) computes its own rows of the fused weight alone,
which is what the original module did. Each output column is the same dot product over
the same input in either case.

Inputs of at most ``rows`` rows are fused (``fuse_projections``; 1: a single-stream decode
step, where slices of the product are contiguous). With more rows a slice of the product
is strided, and the layer's norms or rope may copy it: whether fewer matmuls pay for that is
for a GPU run to say. Inputs of more rows take each part's own rows of the fused weight
(contiguous, no copy) and run as before.

Fused are plain ``nn.Linear`` and ``nn.QuantizedLinear`` groups of one kind, input size,
bias presence and quantization; anything else is left alone.

Off unless ``fuse_projections`` (``--fuse-projections``): on the CPU it changes nothing
measurable (a matmul launch costs little there), and it has not yet been measured on a GPU,
where it is meant to pay (``PARTS=fused bash scripts/h200_host.sh``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tandem.runner import weight_views

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


NAMES = ("weight", "scales", "biases", "bias")


class _Pending:
    """Each part's rows of the fused arrays, and the last fused product and its input (a
    plain object: none of it is a module parameter)."""

    __slots__ = ("rows", "most", "x", "out", "taken")

    def __init__(self, rows: list[dict[str, mx.array]], most: int) -> None:
        self.rows = rows  # per part: its rows of each fused array (views, no copy)
        self.most = most  # inputs of at most this many rows take the fused product
        self.x: mx.array | None = None
        self.out: mx.array | None = None
        self.taken = 0


class FusedLinear(nn.Module):
    """The concatenated weights of ``parts`` (same kind, input size, bias and quantization)."""

    def __init__(self, parts: list[nn.Module], rows: int = 1) -> None:
        super().__init__()
        first = parts[0]
        self.quantized = isinstance(first, nn.QuantizedLinear)
        names = [n for n in NAMES if n in first and first[n] is not None]
        for name in names:
            self[name] = mx.concatenate([p[name] for p in parts], axis=0)
        if self.quantized:
            self.group_size, self.bits, self.mode = first.group_size, first.bits, first.mode
        mx.eval([self[n] for n in names])
        per_part, lo = [], 0
        for p in parts:
            hi = lo + int(p["weight"].shape[0])
            per_part.append({n: self[n][lo:hi] for n in names})
            lo = hi
        mx.eval(per_part)
        self._bounds = _Bounds([r["weight"].shape[0] for r in per_part])
        self._pending = _Pending(per_part, rows)

    def _matmul(self, x: mx.array, a: dict[str, mx.array]) -> mx.array:
        """``x`` times the weight in ``a`` (the fused arrays or one part's rows of them), as
        ``nn.Linear`` / ``nn.QuantizedLinear`` compute it."""
        bias = a.get("bias")
        if not self.quantized:
            w = a["weight"]
            return x @ w.T if bias is None else mx.addmm(bias, x, w.T)
        y = mx.quantized_matmul(
            x,
            a["weight"],
            scales=a["scales"],
            biases=a.get("biases"),
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        return y if bias is None else y + bias

    def part(self, i: int, x: mx.array) -> mx.array:
        p = self._pending
        if x.size > p.most * x.shape[-1]:  # more rows: each part its own rows
            return self._matmul(x, p.rows[i])
        if p.x is None:
            p.x, p.out, p.taken = x, self._matmul(x, self), 0
        elif p.x is not x:  # another input while a product is pending: its own rows
            return self._matmul(x, p.rows[i])
        out = p.out
        p.taken += 1
        if p.taken == len(p.rows):  # every part has its slice: let go of the product
            p.x = p.out = None
        lo, hi = self._bounds.of(i)
        return out[..., lo:hi]

    def release(self) -> None:
        self._pending.x = self._pending.out = None


class _Bounds:
    """Each part's columns of the fused product."""

    __slots__ = ("cuts",)

    def __init__(self, sizes: list[int]) -> None:
        self.cuts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]

    def of(self, i: int) -> tuple[int, int]:
        return self.cuts[i], self.cuts[i + 1]


class _Ref:
    """A part's link to its fused layer, kept out of the module tree (no second copy of the
    fused weights among the parameters)."""

    __slots__ = ("fused",)

    def __init__(self, fused: FusedLinear) -> None:
        self.fused = fused


class Part(nn.Module):
    """One projection of a fused group: its slice of the fused product."""

    def __init__(self, fused: FusedLinear, index: int) -> None:
        super().__init__()
        self._ref = _Ref(fused)
        self.index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self._ref.fused.part(self.index, x)


def _kind(m: Any) -> tuple | None:
    """What must match for a group to fuse; None: a module this does not fuse."""
    if type(m) in (nn.Linear, weight_views.Linear):  # (either order of the two installs)
        return ("linear", m["weight"].shape[1], m["weight"].dtype, "bias" in m)
    if type(m) is nn.QuantizedLinear:
        q = (m.group_size, m.bits, m.mode, "biases" in m, m["scales"].dtype)
        return ("quantized", m["weight"].shape[1], "bias" in m, *q)
    return None


def fuse(model: nn.Module, rows: int = 1) -> list[FusedLinear]:
    """Fuse every group of ``GROUPS`` in ``model``'s modules, for inputs of at most ``rows``
    rows; returns the fused layers."""
    fused: list[FusedLinear] = []
    wanted = {n for names in GROUPS for n in names}
    # Only the parents: each layer's originals go as soon as its parts replace them (a list
    # of every module would hold them all until the end, next to their fused copies).
    parents = [m for _, m in model.named_modules() if wanted & m.keys()]
    while parents:
        module = parents.pop()
        for names in GROUPS:
            parts = [module.get(n) for n in names]
            kinds = {_kind(p) for p in parts}
            if len(kinds) != 1 or None in kinds:
                continue
            f = FusedLinear(parts, rows)
            module["fused_" + "_".join(n.split("_")[0] for n in names)] = f
            for i, n in enumerate(names):
                module[n] = Part(f, i)
            fused.append(f)
        del module, parts
    mx.clear_cache()
    return fused


@contextlib.contextmanager
def releasing(fused: list[FusedLinear]) -> Iterator[None]:
    """A forward, with no pending product before or after it (a part a model never called
    would hold its layer's product, and its other parts would take their own rows, until
    one is dropped; forwards outside a step, at load, may leave one)."""
    for f in fused:
        f.release()
    try:
        yield
    finally:
        for f in fused:
            f.release()
