"""How a step's tokens are grouped for attention: decodes in groups of similar length
(``group_decodes``), prefill chunks as ``ChunkItem``s, and new prompts' chunks batched
(``batch_fresh``). ``step_context.StepContext`` builds them; ``attention`` runs them."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from tandem.runner import kv_quant

MAX_PADDING = 0.25  # padded slots allowed per batched group (decode keys, chunk tokens)


@dataclass
class ChunkItem:
    """A multi-token segment: queries ``[first, first + n)`` over the gathered ``slots``
    (None: its own fresh keys) under ``mask`` ("causal" or an (n, keys) bool array). Or
    several segments that each start a sequence, attended in one batched causal call
    (``batch_fresh``): ``members`` (first, length) each, run padded to ``n``."""

    first: int
    n: int
    slots: mx.array | None
    mask: mx.array | str = "causal"
    members: tuple[tuple[int, int], ...] = ()
    # Batched members not one run of equal lengths: the token rows each padded member
    # reads (its last repeated: causal, no real query sees a key past its own), and the
    # rows of the batched output that are real, in the members' order.
    pad_rows: mx.array | None = None
    real_rows: mx.array | None = None
    # The pages ``slots`` are on, its first key ``skip`` positions into the first: what a
    # head-major pool gathers (``kv_quant.take_head_pages``).
    pages: tuple[int, ...] = ()
    skip: int = 0
    _rows: dict[int, mx.array] = field(default_factory=dict, init=False, repr=False, compare=False)
    _pages: dict[int, mx.array] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def count(self) -> int:
        return max(len(self.members), 1)

    def token_rows(self) -> list[int]:
        """The step's token indices this item's output rows are, in order."""
        if not self.members:
            return list(range(self.first, self.first + self.n))
        return [i for first, m in self.members for i in range(first, first + m)]

    def head_rows(self, hkv: int) -> mx.array:
        """(2, Hkv, L): ``slots`` in a float pool, head by head (``kv_quant.head_rows``)."""
        assert self.slots is not None
        if hkv not in self._rows:
            self._rows[hkv] = kv_quant.head_rows(self.slots, hkv)
        return self._rows[hkv]

    def page_rows(self, hkv: int) -> mx.array:
        """(2, Hkv, pages): ``pages`` in a head-major pool, head by head."""
        assert self.slots is not None and self.pages
        if hkv not in self._pages:
            self._pages[hkv] = kv_quant.head_rows(mx.array(self.pages, dtype=mx.int32), hkv)
        return self._pages[hkv]


def _runs(fresh: list[ChunkItem]) -> tuple[list[list[ChunkItem]], list[ChunkItem]]:
    """Runs of 2+ chunks of equal length one right after another (by ``first``), and the
    chunks in none."""
    runs: list[list[ChunkItem]] = []
    rest: list[ChunkItem] = []

    def close(run: list[ChunkItem]) -> None:
        if len(run) > 1:
            runs.append(run)
        else:
            rest.extend(run)

    cur: list[ChunkItem] = []
    for c in sorted(fresh, key=lambda c: c.first):
        if cur and c.n == cur[-1].n and c.first == cur[-1].first + cur[-1].n:
            cur.append(c)
        else:
            close(cur)
            cur = [c]
    close(cur)
    return runs, rest


def batch_fresh(chunks: list[ChunkItem]) -> list[ChunkItem]:
    """Chunks that each start a sequence (fresh keys, causal) as batched items: one
    attention call an item instead of one a prompt. A run of equal lengths one after
    another (new prompts of one length) is a reshape of the step's rows; the rest are
    grouped by length, as decode groups are, each group padded to its longest (within
    ~MAX_PADDING of its real tokens) through a gather. The other chunks stay as they are.
    (A batch of equal prompts cut by the step's budget ends in a shorter first piece: it
    stays out of its run, not padded to it.)"""
    fresh = [c for c in chunks if c.slots is None and isinstance(c.mask, str)]
    if len(fresh) < 2:
        return chunks
    out = [c for c in chunks if not (c.slots is None and isinstance(c.mask, str))]
    runs, rest = _runs(fresh)
    for run in runs:
        members = tuple((c.first, c.n) for c in run)
        out.append(ChunkItem(run[0].first, run[0].n, None, members=members))
    for group in group_decodes([c.n for c in rest]):
        items = sorted((rest[i] for i in group), key=lambda c: c.first)
        if len(items) == 1:
            out.append(items[0])
            continue
        n = max(c.n for c in items)
        members = tuple((c.first, c.n) for c in items)
        pad = [first + min(j, m - 1) for first, m in members for j in range(n)]
        real = [g * n + j for g, (_, m) in enumerate(members) for j in range(m)]
        padded = any(m < n for _, m in members)
        out.append(
            ChunkItem(
                items[0].first,
                n,
                None,
                members=members,
                pad_rows=mx.array(np.asarray(pad, dtype=np.int32)),
                real_rows=mx.array(np.asarray(real, dtype=np.int32)) if padded else None,
            )
        )
    # In order of their first tokens (a padded group's members may still interleave with
    # other items: ``unpermute`` then puts the rows back).
    return sorted(out, key=lambda c: c.first)


def group_decodes(lengths: list[int]) -> list[list[int]]:
    """Indices into ``lengths`` grouped so padding to each group's longest wastes at most
    ~MAX_PADDING of the group's real key slots."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if groups:
            g = groups[-1]
            longest = lengths[g[0]]
            if longest * (len(g) + 1) <= (1 + MAX_PADDING) * (real + n):
                g.append(i)
                real += n
                continue
        groups.append([i])
        real = n
    return groups
