"""Quantized KV pages (``--kv-cache-dtype int8|int4``).

A quantized layer keeps, per pool slot, its entry (K then V, flattened) as ``mx.quantize``
stores it: each run of ``group`` consecutive values becomes ``bits``-bit integers packed in
uint32 words, with one scale and one bias in the pool's dtype, as mlx-lm's
``QuantizedKVCache`` quantizes per token (group 64 by default). The group is the first of 64,
32 that divides the entry's last axis (a head's dimension; a dense layer's whole width), so a
group never spans two heads; where neither does (heads of 16 or 80) it is the first that
divides the flattened entry, and groups span heads (correct, coarser). A layer no group size
fits stays in the float dtype (the start-up report counts the quantized layers). A slot holds
a token, a page ``page_size`` slots, so every page is quantized on its own: sharing, freeing
and the prefix cache work on quantized pages exactly as on float ones.

Attention dequantizes what it reads (the pages a decode group gathers, a chunk's history),
and a chunk attending over its own fresh keys first rounds them through the same
quantization, so on the gather path every read of a position sees the quantized values of
what was written, chunked or whole, with a prefix hit or without, overlap on or off. (The
float K/V written may differ in the last bits between batch shapes, and quantization can
turn that into a step: docs/design.md. The CUDA decode kernel unpacks in place, in float32.)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from tandem.config import KV_CACHE_DTYPES
from tandem.runner import kv_write

GROUP_SIZES = (64, 32)  # the first that divides a layer's last axis


@dataclass(frozen=True)
class KVQuant:
    bits: int

    @staticmethod
    def parse(name: str) -> KVQuant | None:
        """``auto``: the model's dtype, unquantized; ``int8`` / ``int4``."""
        bits = KV_CACHE_DTYPES[name]
        return None if bits is None else KVQuant(bits)

    @staticmethod
    def group_for(entry: tuple[int, ...]) -> int | None:
        """The group size for slot entries shaped ``entry`` (None: not quantizable)."""
        width = math.prod(entry)
        for dim in (entry[-1], width):
            for g in GROUP_SIZES:
                if dim % g == 0:
                    return g
        return None

    def bytes_per_slot(self, entry: tuple[int, ...], dtype: mx.Dtype) -> int:
        """Pool bytes of one slot: packed values, one scale and one bias per group."""
        group = self.group_for(entry)
        width = math.prod(entry)
        if group is None:
            return width * dtype.size
        return width * self.bits // 8 + 2 * (width // group) * dtype.size


class QuantizedPages:
    """One layer's quantized pool: packed values, scales and biases, one row per slot."""

    def __init__(self, rows: int, entry: tuple[int, ...], dtype: mx.Dtype, quant: KVQuant):
        group = quant.group_for(entry)
        assert group is not None, "a layer no group size divides stays unquantized"
        self.bits, self.group, self.entry = quant.bits, group, entry
        width = math.prod(entry)
        self.q = mx.zeros((rows, width * quant.bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((rows, width // group), dtype=dtype)
        self.biases = mx.zeros((rows, width // group), dtype=dtype)

    def parts(self) -> list[mx.array]:
        return [self.q, self.scales, self.biases]

    def with_parts(self, q: mx.array, scales: mx.array, biases: mx.array) -> QuantizedPages:
        """The same layout over other arrays (a compiled step's inputs and outputs)."""
        other = copy.copy(self)
        other.q, other.scales, other.biases = q, scales, biases
        return other

    def encode(self, x: mx.array) -> list[mx.array]:
        """(N, *entry) entries as the pool stores them."""
        flat = x.reshape(x.shape[0], -1).astype(self.scales.dtype)
        return list(mx.quantize(flat, group_size=self.group, bits=self.bits))

    def decode(self, q: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
        """Stored rows (any leading shape) back to (..., *entry)."""
        x = mx.dequantize(q, scales, biases, group_size=self.group, bits=self.bits)
        return x.reshape(*q.shape[:-1], *self.entry)


Buffer = mx.array | QuantizedPages


def entry_shape(buf: mx.array) -> tuple[int, ...]:
    """One position's entry in a float pool: (2 Hkv, D) also in a head-major one (pages,
    2 Hkv, page, D)."""
    return (buf.shape[1], buf.shape[3]) if buf.ndim == 4 else tuple(buf.shape[1:])


def parts(buf: Buffer) -> list[mx.array]:
    return buf.parts() if isinstance(buf, QuantizedPages) else [buf]


def flat(bufs: Sequence[Buffer]) -> list[mx.array]:
    """Every array of ``bufs``, layer by layer."""
    return [a for buf in bufs for a in parts(buf)]


def unflat(like: Sequence[Buffer], arrays: Sequence[mx.array]) -> list[Buffer]:
    """``flat``'s inverse: buffers laid out as ``like``'s, over ``arrays``."""
    out: list[Buffer] = []
    i = 0
    for buf in like:
        if isinstance(buf, QuantizedPages):
            out.append(buf.with_parts(*arrays[i : i + 3]))
            i += 3
        else:
            out.append(arrays[i])
            i += 1
    assert i == len(arrays), "one array per part of each buffer"
    return out


def _rows(a: mx.array, idx: mx.array, token: mx.array | None) -> mx.array:
    """``a[idx]``; after an in-place write ``token`` (``runner.kv_write``) when given."""
    if token is None:
        return a[idx]
    return kv_write.gather(a, idx, token).reshape(*idx.shape, *a.shape[1:])


def take(buf: Buffer, slots: mx.array, token: mx.array | None = None) -> mx.array:
    """The entries at ``slots`` (any shape), dequantized: ``slots.shape + entry``."""
    if not isinstance(buf, QuantizedPages):
        return _rows(buf, slots, token)
    return buf.decode(*(_rows(p, slots, token) for p in buf.parts()))


def take_pages(
    buf: Buffer, tables: mx.array, page: int, longest: int, token: mx.array | None = None
) -> mx.array:
    """Each row's first ``longest`` positions through its page table (B, max_pages): whole
    pages gathered as contiguous runs, then cut; (B, longest) + entry, dequantized."""
    b = tables.shape[0]

    def gather(a: mx.array) -> mx.array:
        x = _rows(a.reshape(a.shape[0] // page, -1), tables, token)
        return x.reshape(b, -1, *a.shape[1:])[:, :longest]

    if not isinstance(buf, QuantizedPages):
        return gather(buf)
    return buf.decode(*(gather(p) for p in buf.parts()))


def head_rows(slots: mx.array, hkv: int) -> mx.array:
    """The rows of a float pool seen as (slots x 2 Hkv, D) that hold the keys (``[0]``) and
    the values (``[1]``) at ``slots`` (..., L), head by head: (2, ..., Hkv, L)."""
    keys = slots[..., None, :] * (2 * hkv) + mx.arange(hkv, dtype=mx.int32)[:, None]
    return mx.stack([keys, keys + hkv])


def take_heads(
    buf: mx.array, rows: mx.array, token: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """Keys and values of a float pool (slots, 2 Hkv, D) at ``rows`` (``head_rows``), both in
    one gather straight into the (..., Hkv, L, D) layout SDPA reads. On MLX's CPU, gathering
    whole positions and then copying each half's transpose contiguous made a layer's gather
    and SDPA 1.37x slower (SmolLM2's shape, 64 rows of 256 keys; scripts/cpu_gather_probe.py)."""
    return _halves(_rows(buf.reshape(-1, buf.shape[-1]), rows, token))


def _halves(x: mx.array) -> tuple[mx.array, mx.array]:
    """``x[0]`` and ``x[1]`` as views (an integer index is a gather in MLX: a copy)."""
    return x[:1].squeeze(0), x[1:].squeeze(0)


def take_head_pages(buf: mx.array, rows: mx.array, skip: int, n: int) -> tuple[mx.array, mx.array]:
    """Keys and values of a head-major float pool (pages, 2 Hkv, page, D) through page
    ``rows`` (``head_rows`` of page tables: (2, ..., Hkv, pages)): positions ``[skip, skip +
    n)`` of the gathered pages, (..., Hkv, n, D) each. Each head's page is one contiguous
    run, so a gather moves whole runs of page x D entries, not one of D per position and
    head as ``take_heads`` does: on MLX's CPU a gather + SDPA 1.05-2x faster (SmolLM2's
    shape 1.2-1.5x; docs/benchmarks.md), the outputs bitwise the same."""
    _, _, page, d = buf.shape
    x = buf.reshape(-1, page * d)[rows]
    x = x.reshape(*x.shape[:-2], -1, d)
    if skip or x.shape[-2] != n:
        x = x[..., skip : skip + n, :]
    return _halves(x)


def roundtrip(buf: Buffer, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    """Fresh (N, Hkv, D) keys and values as a read of the pool returns them once written
    (unchanged for a float pool)."""
    if not isinstance(buf, QuantizedPages):
        return keys, values
    x = buf.decode(*buf.encode(mx.concatenate([keys, values], axis=1)))
    return x[:, : keys.shape[1]], x[:, keys.shape[1] :]
