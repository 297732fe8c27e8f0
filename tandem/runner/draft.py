"""The draft model of speculative decoding (engine/drafting.py says how the scheduler uses
it): a second model runner whose KV pool has the target's pages, fed the scheduler's
``DraftQuery``s.

Queries are one lazy graph: the catch-up chunks and the first proposal in one forward, then
``k - 1`` single-token forwards, each fed the argmax of the one before on the device. Most
ride the target's step (``build``, called by ``ModelRunner.launch``): the verify segments
read the proposals on the device, and the host waits once a step, as without a draft. The
rest (requests whose proposals the host needs first) go through ``propose``, which waits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import mlx.core as mx

from tandem.engine.plan import DraftQuery, RowSampling, Segment, StepPlan

if TYPE_CHECKING:
    from tandem.runner.model_runner import ModelRunner

log = logging.getLogger("tandem")

_NONE = RowSampling((), (), (), ())


class DraftModel:
    def __init__(self, runner: ModelRunner, vocab_size: int, max_tokens: int) -> None:
        """``runner``: the draft's, its pool allocated with the target's page count and
        size; attention-only (build.py checks). ``vocab_size``: the target's (a larger draft
        vocabulary is cut to it). ``max_tokens``: catch-up tokens one call may feed."""
        assert not runner.recurrent
        self.runner = runner
        if runner.static is not None:  # its catch-up chunks compiled too
            runner.static.chunks = True
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.failures = 0  # in a row; after MAX_FAILURES the draft is disabled
        self.disabled = False

    MAX_FAILURES = 8

    def failed(self, e: Exception) -> None:
        """A draft step failed: its pool is rebuilt (every request's draft KV is gone), and
        after ``MAX_FAILURES`` in a row the draft is switched off for good."""
        self.failures += 1
        log.warning("draft model step failed: %s: %s", type(e).__name__, e)
        if self.failures >= self.MAX_FAILURES and not self.disabled:
            self.disabled = True
            log.error("the draft model failed %d times in a row: speculation is off", self.failures)
        self.runner.reset()

    def propose(self, queries: Sequence[DraftQuery]) -> list[list[int]] | None:
        try:
            with mx.stream(self.runner.stream):
                out = self._propose(queries)
        except Exception as e:  # noqa: BLE001 - a failed draft only costs this step's proposals
            e.__traceback__ = None
            self.failed(e)
            return None
        self.failures = 0
        return out

    def feed(
        self, plan: StepPlan, inputs: mx.array
    ) -> tuple[mx.array, tuple[mx.array, list[tuple[str, list[int]]]], bool]:
        """Build the plan's draft queries (lazily, before the target's forward) and write
        their proposals into the inputs of the verify segments that name them. Returns the
        inputs, (all proposals, each proposing query's request id and indices) and whether
        the draft failed: then zeros are proposed (a verify is exact whatever it is fed)."""
        failed = False
        try:
            flat, where = self.build(plan.drafts)  # on the device while the target builds
            self.failures = 0
        except Exception as e:  # noqa: BLE001 - any proposal is exact: placeholders serve
            e.__traceback__ = None
            self.failed(e)
            where, n = [], 0
            for q in plan.drafts:
                where.append(list(range(n, n + q.k)))
                n += q.k
            flat = mx.zeros((n,), dtype=mx.int32)
            failed = True
        dst, src = [], []
        t = 0
        for seg in plan.segments:
            if seg.draft >= 0:
                idx = where[seg.draft]
                assert len(idx) == seg.num_tokens - 1
                dst += range(t + 1, t + seg.num_tokens)
                src += idx
            t += seg.num_tokens
        if dst:
            inputs[mx.array(dst, dtype=mx.int32)] = flat[mx.array(src, dtype=mx.int32)]
        proposing = [(q.request_id, w) for q, w in zip(plan.drafts, where, strict=True) if q.k]
        return inputs, (flat, proposing), failed

    def _propose(self, queries: Sequence[DraftQuery]) -> list[list[int]]:
        flat, where = self.build(queries)
        mx.eval(flat, *self.runner.pool.arrays())
        tokens = flat.tolist()
        return [[tokens[j] for j in w] for w in where]

    def build(self, queries: Sequence[DraftQuery]) -> tuple[mx.array, list[list[int]]]:
        """The lazy graph of ``queries``: every proposal in one flat (n,) int32 array, and
        each query's indices into it (its k proposals in order). Call on the step's stream."""
        runner = self.runner
        # The catch-up chunks and the first proposal of each query that proposes.
        segs = [Segment(q.request_id, q.start, len(q.tokens), q.tokens, q.pages) for q in queries]
        # (Ids past the draft's embedding table, which the target's padded vocabulary may
        # allow, read its last row: only a proposal depends on it.)
        inputs = mx.minimum(
            mx.array([t for q in queries for t in q.tokens], dtype=mx.int32), self.embed_rows - 1
        )
        ends = [sum(len(q.tokens) for q in queries[: i + 1]) - 1 for i in range(len(queries))]
        rows = [i for i, q in enumerate(queries) if q.k > 0]
        head = [ends[i] for i in rows] or [0]
        logits = runner.forward(StepPlan(0, tuple(segs), (), (), _NONE), inputs, head)
        if not rows:  # only catch-up: nothing to propose (and no argmax of zero rows)
            return mx.zeros((0,), dtype=mx.int32), [[] for _ in queries]
        tokens = self._argmax(logits[: len(rows)])
        mx.async_eval(tokens)  # the device starts while the host builds the next forward
        steps = [(rows, tokens)]
        for j in range(1, max((q.k for q in queries), default=0)):
            prev_rows, prev = steps[-1]
            alive = [n for n, i in enumerate(prev_rows) if queries[i].k > j]
            rows = [prev_rows[n] for n in alive]
            segs = [
                Segment(queries[i].request_id, queries[i].end + j - 1, 1, (0,), queries[i].pages)
                for i in rows
            ]
            inputs = prev if len(alive) == len(prev_rows) else prev[mx.array(alive)]
            plan = StepPlan(j, tuple(segs), (), (), _NONE)
            tokens = self._argmax(runner.forward(plan, inputs, list(range(len(rows)))))
            mx.async_eval(tokens)
            steps.append((rows, tokens))
        where: list[list[int]] = [[] for _ in queries]
        offset = 0
        for rows, _ in steps:
            for n, i in enumerate(rows):
                where[i].append(offset + n)
            offset += len(rows)
        parts = [t for _, t in steps]
        flat = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return flat, where

    @property
    def embed_rows(self) -> int:
        return self.runner.vocab_size

    def _argmax(self, logits: mx.array) -> mx.array:
        return mx.argmax(logits[:, : self.vocab_size], axis=-1).astype(mx.int32)
