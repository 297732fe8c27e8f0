"""Steady decode steps through ``mx.compile``: the model's graph traced once per shape.

On MLX's CUDA backend a decode step is host-bound: building the model's graph in Python
(every layer's modules, our cache objects and seam) costs about as much as submitting it.
A compiled step replays a traced graph instead, so the Python runs once per shape. It applies
to steps of single-token rows (the steady state of a batch) and of speculative verifies,
each position of which is a row of its own (no prefill chunk or prompt log-probabilities):
full attention, sliding windows and chunks, paged or dense (MLA, softcapped scores:
``runner.layers``; they gather each row's whole table under its mask, ``static_context``),
on float pages or quantized ones (their packed values, scales and biases as three arrays;
with one buffer set only). Recurrent layers (hybrids, which verify uncompiled) take part
where every row's state is resident (``runner.state``: the rows of the step before, in its
order, none starting a sequence or taking a snapshot): the trace takes those states and
returns the next ones, which stay resident; such steps are not padded.
Windowed and chunked layers read each row's pages from the one holding its first key, in
tables of the most pages their span covers (or the full tables' width, if less), through
the gather path as uncompiled steps do, and write into the window page group where there
is one.

Everything the graph depends on is an input array or fixed by the input shapes, so a replay
is the step it stands for: token ids, positions, write slots, page tables (width rounded up
to ``WIDTH_STEP`` pages, so a row growing by a page rarely makes a new shape), lengths and the
decode kernel's work list. Rows are padded to a ``bucket`` (padding rows attend one key and
write into the pool's scratch page, slot -1, which no table names), so rows joining and
leaving rarely make a new shape either. A new shape is a new trace (Python once more, then
replays).

The pool's buffers: with in-place writes (``runner.kv_write``) they are constants of the
trace, written by kernels and never replaced; the step takes the layers' last write tokens
and returns the new ones (the chain of ``runner.paged``);
otherwise (the CPU, scatters) they are inputs and the step returns the new buffers, which
replace them. Either way the pool is the one after the step, as the uncompiled path leaves it.
A failed step turns compiled steps off (``ModelRunner.reset``): a trace that fails when it is
evaluated would fail again at every replay, and the recreated pool is not its constants.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from tandem.engine.plan import Segment
from tandem.runner import kernels, kv_quant, state
from tandem.runner.static_context import StaticContext, StaticGroup
from tandem.runner.step_context import first_key, slot

if TYPE_CHECKING:
    from tandem.runner.model_runner import ModelRunner

log = logging.getLogger("tandem")

WIDTH_STEP = 8  # page-table width granularity, in pages
MAX_SHAPES = 64  # traces kept; past it the least recently used is dropped
# Rows compiled by default where KV writes are in place (CUDA). H100, bf16, 0.6B shape, steady
# steps uncompiled -> compiled: 16 rows 6.56 -> 4.86 ms, 64 rows 6.26 -> 5.17, 256 rows 7.75
# -> 7.53, 9.86 -> 8.91, 15.38 / 14.18 -> 11.62 / 11.84 (alternating; docs/benchmarks.md).
GPU_ROWS = 256
# Rows compiled by default on the CPU, where a C++ compiler builds MLX's fused kernels:
# the SmolLM2 shape's single stream 1.09x mlx-lm's generate_step compiled against 0.97x not,
# 4 rows 1.04x against 0.96x; at 16 rows a compiled step was 13-18% slower (its tables,
# rounded up to 8 pages, read more keys under a mask: attention is most of a CPU step).
CPU_ROWS = 4
# A draft model's catch-up chunk of at most this many tokens (the accepted tokens of a verify,
# then the first proposal) runs as rows of a compiled step, counted as one request against
# ``compile_decode`` with the decode kernel, as a verify is; a longer one (a new request's
# prompt) runs uncompiled. (On the H100 at 8 streams, where these chunks ran uncompiled, the
# draft's host build took 66 ms a round in the first of three runs and 13 ms in the later
# ones: new shapes.)
CHUNK_ROWS = 16


def default_rows(inplace: bool, kv: bool = True) -> int:
    """Rows compiled where ``compile_decode`` is not given: ``GPU_ROWS`` with in-place writes
    (CUDA), or on a GPU for a model without KV layers (nothing to write); ``CPU_ROWS`` on the
    CPU where MLX compiles (``cpu_compiler``); else none (docs/benchmarks.md)."""
    if inplace or (not kv and mx.default_device() != mx.cpu):
        return GPU_ROWS
    if mx.default_device() == mx.cpu and cpu_compiler():
        return CPU_ROWS
    return 0


@functools.cache
def cpu_compiler() -> bool:
    """Whether MLX compiles functions on the CPU here: a compiled function traced once and
    replayed, its fused kernel built and run. MLX builds such a kernel with the system's
    ``g++`` when it is first evaluated (then keeps the library under the temporary
    directory); with no ``g++`` on the PATH (or compilation disabled) it does not compile at
    all and runs the function's Python at every call (checked: three calls, three runs of
    the body), which for a decode step would be a trace per step. Probed once at load, so
    that case, and on a fresh kernel cache a compiler that fails, leave compiled steps off
    rather than slowing or failing steps."""
    calls = 0

    def probe(x: mx.array, y: mx.array) -> mx.array:
        nonlocal calls
        calls += 1
        return mx.exp(x * y) * mx.sigmoid(x) + y

    try:
        with mx.stream(mx.cpu):
            f = mx.compile(probe)
            for _ in range(2):
                mx.eval(f(mx.arange(8, dtype=mx.float32), mx.array(0.5)))
    except Exception as e:  # noqa: BLE001 - any failure means: no compiled CPU steps
        log.warning("compiled decode steps off: MLX could not build a fused CPU kernel (%s)", e)
        return False
    if calls > 1:
        log.info("compiled decode steps off: MLX does not compile here (no g++ on the PATH?)")
        return False
    return True


def table_width(longest_start: int, page: int) -> int:
    """Pages in a step's tables: the longest row's (up to ``longest_start``), rounded up."""
    return -(-(longest_start // page + 1) // WIDTH_STEP) * WIDTH_STEP


def bucket(n: int) -> int:
    """The rows a step of ``n`` runs as: a power of two up to 8, then multiples of 8 up to
    64 and of 16 beyond (rows joining and leaving rarely make a new shape)."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    step = 8 if n <= 64 else 16
    return -(-n // step) * step


def _body_of(ref: weakref.ref) -> Callable[..., tuple]:
    """The traced function, holding its ``StaticDecode`` weakly (the bound method would be
    a cycle through the compiled function, keeping a deleted engine's pool)."""

    return lambda *args: ref()._body(*args)


class StaticDecode:
    def __init__(self, runner) -> None:
        self._runner = weakref.ref(runner)  # (the runner holds this: no cycle)
        # A compiled function per step shape, the least recently used dropped past
        # ``MAX_SHAPES`` (its trace goes with it; one function holding every trace would
        # match each call against all of them, and dropping it would drop them all).
        self._fns: OrderedDict[tuple, Callable[..., tuple]] = OrderedDict()
        self.traces = 0  # how often the Python model ran (tests, benchmarks)
        self.shapes: set[tuple] = set()  # every shape ever met (a re-trace is not new)
        self.replays = 0  # compiled steps that replayed a trace
        self.verifies = 0  # compiled steps with speculative verify rows (or draft chunks)
        # A draft model's runner (runner/draft.py): its catch-up chunks, whose last
        # positions' logits propose, run as rows too (a target's prefill chunks do not: a
        # chunk's attention, taken whole, rounds differently from row by row).
        self.chunks = False
        self._expanded: tuple[tuple[Segment, ...] | None, tuple[Segment, ...] | None] = (None, None)
        self._no_work = kernels.DecodeWork([1], 1)

    @property
    def runner(self) -> ModelRunner:
        runner = self._runner()
        assert runner is not None, "the runner of a compiled step is gone"
        return runner

    @staticmethod
    def eligible(runner) -> bool:
        pool = runner.pool
        # (Two buffer sets replay one array per layer: not quantized pages' three.)
        return (
            pool is not None
            and (runner.kv_quant is None or pool.num_sets == 1)
            and all(not s.unused for s in runner.specs)
        )

    def rows(self, n: int) -> int:
        """The rows a step of ``n`` runs as: ``bucket(n)``; exactly ``n`` with recurrent
        states (the resident states are the rows')."""
        return n if self.runner.state_pool is not None else bucket(n)

    def expand(self, segments: tuple[Segment, ...]) -> tuple[Segment, ...] | None:
        """The step's rows: a single-token segment is one; a speculative verify (every
        position sampled) is one per position, each attending to the keys up to its own as a
        decode does (and as the decode kernel takes verifies uncompiled: ``StepContext``), and
        so is a draft model's catch-up chunk (``chunks``). None where a segment is neither (a
        prefill chunk, prompt log-probabilities), or a model with recurrent states verifies
        (its states advance position by position)."""
        if all(s.num_tokens == 1 for s in segments):
            return segments
        if self.runner.state_pool is not None:
            return None
        if self._expanded[0] is segments:  # (``applies``, then ``forward``: one step's)
            return self._expanded[1]
        rows: list[Segment] = []
        out: tuple[Segment, ...] | None = None
        for s in segments:
            verify = s.num_samples == s.num_tokens
            if s.num_tokens == 1:
                rows.append(s)
            elif s.logprobs < 0 and (verify or (self.chunks and s.num_tokens <= CHUNK_ROWS)):
                rows += [
                    replace(s, start=s.start + j, num_tokens=1, num_samples=1, draft=-1)
                    for j in range(s.num_tokens)
                ]
            else:
                break
        else:
            out = tuple(rows)
        self._expanded = (segments, out)
        return out

    def applies(self, segments: tuple[Segment, ...], head: list[int]) -> bool:
        # N counts requests with the decode kernel: a verify one (on the H100, 4 streams at
        # K = 4 ran 1.97x of plain with their 20-row verifies compiled, 1.45x uncompiled:
        # docs/benchmarks.md), and a draft's catch-up one. The gather path counts their
        # rows: each gathers its whole table, where uncompiled a verify's chunk gathers once
        # (compiled steps of 16 rows ran 13-18% slower there).
        rows = len(segments) if self.runner.decode_kernel else sum(s.num_tokens for s in segments)
        if rows > self.runner.compile_decode:
            return False
        expanded = self.expand(segments)
        if expanded is None:
            return False
        segments = expanded
        if not state.steady(self.runner.state_pool, segments):
            return False
        if self.runner.pool.pending() > self.rows(len(segments)):
            return False  # (two buffer sets, after a bigger step: its replay runs uncompiled)
        if head != list(range(len(segments))) and not self.chunks:
            return False
        if self.runner.decode_kernel or not self.runner.specs:  # (no KV: nothing gathered)
            return True
        # The gather path reads every row's table out to the longest row's: not where that
        # would more than double the keys read (ragged batches run uncompiled, grouped).
        p = self.runner.pool.page_size
        keys = table_width(max(s.start for s in segments), p) * p
        return self.rows(len(segments)) * keys <= 2 * sum(s.start + p for s in segments) + 1024

    def forward(self, segments: tuple[Segment, ...], inputs: mx.array, head: list[int]) -> mx.array:
        """The logits of token indices ``head``, (len(head), vocab) (``applies`` said yes)."""
        expanded = self.expand(segments)
        assert expanded is not None
        self.verifies += len(expanded) > len(segments)
        segments = expanded
        r = self.runner
        pool = r.pool
        p = pool.page_size
        n = len(segments)
        m = self.rows(n)  # rows past n: position 0 over page 0, written to slot -1 (scratch)
        starts = np.zeros(m, dtype=np.int64)
        starts[:n] = np.fromiter((s.start for s in segments), dtype=np.int64, count=n)
        used = starts // p + 1
        # (A model without KV layers, all recurrent, reads no tables: one fixed width.)
        width = table_width(int(starts.max()), p) if r.specs else WIDTH_STEP
        tables = np.zeros((m, width), dtype=np.int32)
        slots = np.full(m, -1, dtype=np.int64)
        if r.specs:
            for i, s in enumerate(segments):
                tables[i, : used[i]] = s.pages[: used[i]]
            slots = tables[np.arange(m), starts // p] * p + (starts % p)
            slots[n:] = -1
        lengths = starts + 1
        windows, wslots = self._windows(segments, starts, m, width)
        if m > n:
            inputs = mx.concatenate([inputs, mx.zeros((m - n,), dtype=inputs.dtype)])
        # The gather path reads no work list: fixed inputs, no new shapes.
        work = kernels.DecodeWork(lengths, width, pad=bucket) if r.decode_kernel else self._no_work
        shape = (m, width, work.num_items)
        fn = self._fns.get(shape)
        if fn is None:
            if len(self._fns) >= MAX_SHAPES:
                self._fns.popitem(last=False)
            fn = self._fns[shape] = mx.compile(_body_of(weakref.ref(self)))
            self.shapes.add(shape)
        self._fns.move_to_end(shape)
        # In place: the layers' last write tokens, which this step's writes chain onto
        # (runner/paged.py); otherwise the buffers themselves, and with two buffer sets
        # the previous step's writes this set replays.
        lags: list[mx.array] = []
        sp = r.state_pool  # the rows' resident states, in; their next ones, out
        states = [] if sp is None else state.resident_inputs(sp)
        before = pool.step_state()  # (a failure here leaves the uncompiled path its pool)
        try:
            if pool.inplace:
                bufs = [kernels.kv_write.zero() if t is None else t for t in pool.tokens]
            else:
                if pool.num_sets > 1:
                    host = [slots[:n].astype(np.int32)]
                    if pool.window_pages:
                        host.append(wslots[:n])
                    pool.begin_step([(h, mx.array(h)) for h in host])
                    lags = self._lags(len(host), m)
                bufs = kv_quant.flat(pool.sets[pool.current])
            traces = self.traces
            outs = fn(
                inputs,
                mx.array(starts.astype(np.int32)),
                mx.array(slots.astype(np.int32)),
                mx.array(tables),
                mx.array(lengths.astype(np.int32)),
                work.items,
                work.offsets,
                work.dims,
                *windows,
                *states,
                *bufs,
                *lags,
            )
        except Exception:
            pool.restore_step(before)
            raise
        self.replays += self.traces == traces
        if sp is not None:
            assert states, "a recurrent model's steady rows have resident states"
            state.make_resident(sp, segments, list(outs[len(outs) - len(states) :]))
            outs = outs[: len(outs) - len(states)]
        k = len(bufs)
        written = list(outs[1 : 1 + k])
        if pool.inplace:
            pool.tokens = written
        else:
            pool.sets[pool.current] = kv_quant.unflat(pool.sets[pool.current], written)
            for layer, e in enumerate(outs[1 + k :]):  # (double buffering: the other set's)
                pool.record(pool.group[layer], layer, [e if m == n else e[:n]])
        if head == list(range(n)):
            return outs[0] if m == n else outs[0][:n]
        return outs[0][mx.array(head, dtype=mx.int32)]

    def _lags(self, groups: int, m: int) -> list[mx.array]:
        """Per page group the slots the previous step wrote, then per layer its entries:
        what this step's buffer set replays, padded to the step's ``m`` rows (``applies``:
        never fewer) with rows that write the scratch slot -1, so the trace's shapes are the
        step's own."""
        pool = self.runner.pool
        # (A group no layer writes replays nothing: all its rows are padding.)
        slots = [mx.full((m,), -1, dtype=mx.int32)] * groups
        seen: set[int] = set()
        out: list[mx.array] = []
        for layer, buf in enumerate(pool.sets[pool.current]):
            g = pool.group[layer]
            lag = pool.lag(g, layer)
            n = 0 if lag is None else lag[0].shape[0]
            pad = m - n
            if lag is not None and g not in seen:  # (a group's slots: from its first layer)
                seen.add(g)
                s = lag[0]
                slots[g] = mx.concatenate([s, mx.full((pad,), -1, dtype=mx.int32)]) if pad else s
            entry = kv_quant.entry_shape(buf)
            v = mx.zeros((0, *entry), dtype=buf.dtype) if lag is None else lag[1][0]
            if pad:
                v = mx.concatenate([v, mx.zeros((pad, *entry), dtype=buf.dtype)])
            out.append(v)
        return slots + out

    def _windows(
        self, segments: tuple[Segment, ...], starts: np.ndarray, m: int, full_width: int
    ) -> tuple[list[mx.array], np.ndarray]:
        """The window group's write slots, then per span of the model's sliding windows
        and chunks (``LayerSpec.span``) each row's table from the page of its first key,
        its keys' end and first key in that table, as wide as the most pages a span covers
        or the full tables where those are narrower (a shape changes no more often than
        theirs). Padding rows: position 0 over page 0. And the window slots on the host."""
        r = self.runner
        p = r.pool.page_size
        windowed = bool(r.pool.window_pages)
        out = []
        wslots = np.full(m, -1, dtype=np.int32)
        if windowed:
            for i, s in enumerate(segments):
                wslots[i] = slot(s.wpages, s.start, p)
        out.append(mx.array(wslots))
        for span in self.spans:
            # (No wider than the full tables: a row's pages up to its own end fit in those.)
            width = min((abs(span) - 1) // p + 2, full_width)
            tables = np.zeros((m, width), dtype=np.int32)
            ends = np.ones(m, dtype=np.int32)
            firsts = np.zeros(m, dtype=np.int32)
            for i, s in enumerate(segments):
                pos = int(starts[i])
                lo = int(first_key(pos, span))
                first = lo // p
                pages = (s.wpages if windowed else s.pages)[first : pos // p + 1]
                tables[i, : len(pages)] = pages
                ends[i], firsts[i] = pos + 1 - first * p, lo - first * p
            out += [mx.array(tables), mx.array(ends), mx.array(firsts)]
        return out, wslots

    @functools.cached_property
    def spans(self) -> list[int]:
        """The model's sliding windows and chunks, one entry each (``LayerSpec.span``)."""
        return sorted({s.span for s in self.runner.specs if s.span is not None})

    def _body(self, inputs, positions, slots, tables, lengths, items, offsets, dims, *rest):
        r = self.runner
        pool = r.pool
        wslots, rest = rest[0], rest[1:]
        k = 3 * len(self.spans)
        spans = {
            span: StaticGroup(*rest[3 * j : 3 * j + 2], None, pool.page_size, rest[3 * j + 2])
            for j, span in enumerate(self.spans)
        }
        rest = rest[k:]
        sp = r.state_pool
        ns = 0 if sp is None else len(state.resident_inputs(sp))
        initial, rest = rest[:ns], rest[ns:]
        cur = pool.current
        nbuf = len(pool.specs) if pool.inplace else len(kv_quant.flat(pool.sets[cur]))
        bufs, lags = rest[:nbuf], rest[nbuf:]
        saved, saved_tokens, saved_step = pool.sets[cur], pool.tokens, pool.step_state()
        if pool.inplace:
            pool.tokens = list(bufs)
        else:
            pool.sets[cur] = kv_quant.unflat(saved, bufs)
        try:
            if lags:  # two buffer sets: replay the previous step's writes with this step's
                groups = len(lags) - nbuf
                own = [slots, wslots][:groups]
                for g in range(groups):
                    merged = mx.concatenate([lags[g], own[g]])
                    layer_lags = {i: lags[groups + i] for i in range(nbuf) if pool.group[i] == g}
                    pool.replay_into(g, merged, layer_lags)
            kernel = bool(r.decode_kernel)
            num_items = items.shape[0] // 2
            work = SimpleNamespace(
                items=items,
                offsets=offsets,
                dims=dims,
                width=tables.shape[1],
                num_items=num_items,
                split=num_items > tables.shape[0],
            )
            group = StaticGroup(tables, lengths, work, pool.page_size)
            window_slots = wslots if pool.window_pages else slots
            ctx = StaticContext(positions, slots, group, kernel, window_slots, spans, r.mask_rank)
            keep: list = []
            caches = None if sp is None else state.resident_caches(sp, initial, keep)
            logits = r.call(ctx, inputs[:, None], list(range(inputs.shape[0])), caches)
            self.traces += 1
            written = list(pool.tokens) if pool.inplace else kv_quant.flat(pool.sets[cur])
            if lags:  # this step's own entries per layer, for the other set
                written += [pool.written(pool.group[i])[i][0] for i in range(nbuf)]
            kept = state.kept_outputs(keep)
            assert len(kept) == ns, "a compiled step keeps the states it reads"
            written += kept
        finally:  # the caller stores what the step returns; no tracer stays behind
            pool.sets[cur], pool.tokens = saved, saved_tokens
            pool.restore_step(saved_step)
        return (logits, *written)
