"""Linear layers' transposed weights, made once at load instead of in every step's graph.

MLX's ``nn.Linear`` computes ``x @ weight.T`` (and ``nn.Embedding.as_linear``, a tied output
projection, the same): every call adds a Transpose node to the step's graph, a view the matmul
reads the weight through. The view evaluated once at load has the same strides over the same
memory, so the matmul is the same kernel on the same data (token-exact by construction), and a
step's graph has one node fewer per linear layer: 197 of some 1,400 on the Qwen3-0.6B shape at
one row. A decode step on MLX's CUDA backend is host time, much of it per node (building the
graph, then ``async_eval`` walking it).

The modules stay mlx-lm's: their class becomes a subclass whose call reads the held view
while the module's weight is still the array it was made from (anything that replaces a
weight gets MLX's own path for it). A weight must not be changed in place after load (a view
would keep its old values; nothing in Tandem or mlx-lm does that). Quantized layers have no
Transpose node (``quantized_matmul`` takes ``transpose=True``) and are left alone.

A batch of one row (``x`` of shape (1, L, D): a single stream's step, a prefill chunk) reads a
second view, (1, D, N): MLX's ``matmul`` flattens a 3-D ``x`` against a 2-D weight (a Flatten
and an Unflatten node around the Matmul), while two 3-D operands of batch 1 are one Matmul
node. The kernel and its arguments are the same (one GEMM or GEMV of M = L rows on the CPU and
in MLX's CUDA matmul, which collapses a batch of one), so the output is bitwise equal. A step
of T rows feeds (T, 1, D): against (1, D, N) that would be a broadcast weight, which MLX's
CPU matmul runs as T products of one row each; it keeps the 2-D view.

On CUDA a bias-free module's one-row input takes ``runner.gemv``'s kernel instead, where its
load check found it bitwise equal to MLX's product for that weight shape (with the views off,
``TANDEM_WEIGHT_VIEWS=0``, it is off too).
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from tandem.runner import gemv

_HELD = "_tandem_weight_t"  # an instance attribute, not a module parameter


def _kernel(module: nn.Module, x: mx.array) -> bool:
    """Whether ``x`` times the module's weight takes ``runner.gemv``'s kernel: the weight
    the views were made from (a replaced one gets MLX's path) and a product that suits it."""
    if not gemv.active:  # (the CPU, or no shape checked equal: no lookups per call)
        return False
    held = module.__dict__.get(_HELD)
    return held is not None and held[0] is module["weight"] and gemv.suits(held[0], x)


def _transposed(module: nn.Module, x: mx.array) -> mx.array:
    """The weight's transpose for ``x @``: the held 3-D view for a batch of one row, else
    the 2-D one (or MLX's own ``weight.T`` once the weight was replaced)."""
    w = module["weight"]
    held = module.__dict__.get(_HELD)
    if held is not None and held[0] is w:
        return held[2] if x.ndim == 3 and x.shape[0] == 1 else held[1]
    if held is not None:  # a replaced weight: let the old one go
        del module.__dict__[_HELD]
    return w.T


class Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        if "bias" not in self and _kernel(self, x):
            return gemv.gemv(self["weight"], x)
        wt = _transposed(self, x)
        return mx.addmm(self["bias"], x, wt) if "bias" in self else x @ wt


class Embedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        if _kernel(self, x):
            return gemv.gemv(self["weight"], x)
        return x @ _transposed(self, x)


_CLASSES: dict[type, type] = {nn.Linear: Linear, nn.Embedding: Embedding}


def install(model: nn.Module) -> int:
    """Give every plain ``nn.Linear`` and ``nn.Embedding`` of ``model`` its transposed weight
    views, evaluated; returns how many modules (none with ``TANDEM_WEIGHT_VIEWS=0``, for
    comparisons)."""
    if os.environ.get("TANDEM_WEIGHT_VIEWS") == "0":
        return 0
    views: list[mx.array] = []
    plain: list[mx.array] = []  # bias-free weights, for the GEMV kernel's check
    modules = 0
    for _, m in model.named_modules():
        cls = _CLASSES.get(type(m))
        if cls is None:
            continue
        w = m["weight"]
        wt = w.T
        views += [wt, wt[None]]
        m.__dict__[_HELD] = (w, *views[-2:])
        m.__class__ = cls
        modules += 1
        if "bias" not in m:
            plain.append(w)
    mx.eval(views)
    gemv.check(plain)
    return modules
