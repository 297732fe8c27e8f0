"""Whether speculation pays, from the engine's own step times.

A request backs off when its verifies accept nothing (engine/speculation.py), but verifies
that accept a little can still emit fewer tokens per second than plain decoding of the same
batch: each costs more than a decode step (K + 1 positions, a draft's forwards, recurrent
states per position, no overlap while anyone speculates), and how much more depends on the
machine and the model. Measured before this existed: a random Qwen3.5-2B shape in bf16 on an
H100, 4 streams, 27% of proposals accepted, ran at 0.47x of speculation off; a draft at 4
streams on the CPU at 0.89x. So the engine times its steps and compares:

- a **plain** step (every segment a one-token decode) while B requests decode: the tokens
  the last ``WINDOW`` per B emitted over their seconds (sums: a chained step's time is the
  interval between finalizes, and a late finalize makes one interval long and the next a
  fraction of a millisecond, which a median of per-step rates would read as the norm);
- a **speculating** step (a verify segment, or the replay of a rejected one; no prompt
  chunk) while B requests decode: the tokens it emitted, against those plain steps would
  have emitted in its time (its seconds x that median);
- steps with prompt chunks are not compared, nor steps where a draft model catches up on
  more than a verify's worth of tokens (``DraftQuery.tokens`` past ``k + 1``): its prefill
  of a new request's prompt, or of the tokens decoded while speculation was backed off. Such
  a step is paid once per request or per probe, not per verify, and counted it weighs on
  every probe's window of ``WINDOW`` steps (CPU, a 12-layer target and its 3-layer draft,
  one stream: the first step of a probe fed the draft 34-70 tokens in 41-44 ms, against
  22-30 ms for a verify).

A step built unchained because someone speculates counts as speculating even where it
verifies nothing (a proposal cut to nothing, a draft only catching up): its lost overlap is
speculation's cost. B counts requests decoding or replaying. Speculation needs
``PLAIN_SAMPLES`` plain steps at a batch size after its first (which may have waited for
kernels to compile, and is not kept) before it runs there. Once
``WINDOW`` speculating steps are timed, while the last ``WINDOW``'s tokens are below
``min_gain`` x those plain steps would have emitted in their time, speculation is off
engine-wide for a back-off of plain steps (``BACKOFF``, then doubling while the probes after
it keep losing, up to ``MAX_BACKOFF``; back to ``BACKOFF`` once a probe pays). Sums, not a
median of per-step ratios: a verify step's time varies little while its tokens vary a lot
(one step accepts everything, the next nothing), and throughput is the sum. Steps over
``OUTLIER`` x the window's median time are left out: the few that first meet a new shape wait
for MLX to compile its kernels (seconds, against milliseconds), while a recurring cost (a
draft catching up, a long replay) is within a few times the median and counts. Every token
stays exact either way: this only decides how fast.

Steps that meet a new shape are left out, plain and speculating alike (``fresh``: the
runner met a compiled step shape for the first time while launching it, or while launching
the step chained onto it, inside its interval; a shape traced again after the runner
dropped it is a recurring cost and counts, within ``OUTLIER``). The first run of a batch
meets many: rows grow past table widths and work-list sizes, a verify's rows and a draft's
catch-ups are shapes of their own. On an H100 (8B shape, its first 4 layers drafting, 8
streams) the first run took 21-105 ms a launch to submit against 9-20 ms warm, for plain
and speculating steps alike; the windows judged on them backed speculation off through runs
where it paid 1.33-1.39x; with them left out, 8 streams ran 1.57x of plain
(docs/benchmarks.md). Small pages (``kv_page_size`` 4) widen the tables, a new shape, every
32 tokens: there more steps are left out.

A step's seconds run from its launch (or the previous step's finalize, if later: a chained
step's time is the interval between finalizes) to its own finalize (engine/loop.py).

Like is compared with like: a step's cost grows with its rows' lengths, and while
speculation runs no plain steps are timed at its batch size, so the plain reference can be
from much shorter sequences (the first steps after the prompts, after a long winning
stretch; CPU, a 12-layer width-256 target, 8 streams of 64-token prompts: plain steps right
after the prompts took 19 ms, the average over 96 tokens 25 ms). A losing verdict whose
every step ran over ``STALE`` x the mean length of the plain steps it was judged against
does not back off: it drops those batch sizes' plain steps, so that speculation pauses for
``PLAIN_SAMPLES`` plain steps at today's lengths and is judged again. A window's own growth
past a fresh reference is judged as it is.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import TYPE_CHECKING

from tandem.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tandem.engine.plan import DraftQuery, Segment

log = logging.getLogger("tandem")

PLAIN, SPEC = "plain", "spec"


def decoding(running: dict[str, Request]) -> int:
    """The batch size speculation is judged at: requests decoding, or replaying the tokens a
    rejected verify accepted (they decode again right after)."""
    return sum(r.status is RequestStatus.DECODE or r.replaying for r in running.values())


def step_kind(
    segments: list[Segment],
    chunks: list[Segment],
    running: dict[str, Request],
    spec_mode: bool,
    drafts: Sequence[DraftQuery] = (),
) -> str:
    """A step's kind for the comparison (before ``_launch`` advances its requests): PLAIN,
    SPEC, or "" (prompt chunks, or a draft's catch-up past a verify's worth: not compared).
    ``spec_mode``: built while someone speculates, so not chained to the step before, whether
    or not it verifies anything (a proposal cut to nothing, a draft only catching up): a
    cost of speculating, not a plain step."""
    prompt = [s for s in chunks if not running[s.request_id].replaying]
    if prompt or any(len(q.tokens) > q.k + 1 for q in drafts):
        return ""
    if spec_mode or len(chunks) or any(s.num_samples > 1 for s in segments):
        return SPEC
    return PLAIN


class SpecGain:
    PLAIN_SAMPLES = 3  # after the first at a batch size, which may wait for compilation
    WINDOW = 8
    OUTLIER = 10.0
    STALE = 1.25
    BACKOFF = 32
    MAX_BACKOFF = 1024
    SHADOW_VERIFIES = 4  # shadow verifies before a back-off may end early
    SHADOW_MARGIN = 1.1

    def __init__(self, min_gain: float) -> None:
        self.min_gain = min_gain
        # B -> (tokens, seconds, its rows' mean length) of recent plain steps
        self.plain: dict[int, deque[tuple[int, float, float]]] = {}
        # (tokens, seconds, plain tokens/s at its B, its length over those plain steps', B)
        # of recent speculating steps
        self.spec: deque[tuple[int, float, float, float, int]] = deque(maxlen=self.WINDOW)
        self.off_left = 0  # plain steps before speculating again
        self.backoff = 0  # the last back-off's length (0: none since it last paid)
        self.backoffs = 0  # times speculation was turned off
        # step id -> (kind, rows, its rows' mean length), until timed
        self._steps: dict[int, tuple[str, int, float]] = {}
        self._first: set[int] = set()  # batch sizes whose first plain step was seen
        # The last losing window's gain and tokens per row a step, and the tokens the latest
        # shadow verifies since would have accepted (engine/spec_shadow.py)
        self.lost = (0.0, 1.0)
        self.shadow: deque[int] = deque(maxlen=self.SHADOW_VERIFIES)
        self.resumes = 0  # back-offs the shadow verifies ended early
        self.paid = False  # the last window judged paid

    @classmethod
    def rate(cls, steps: deque[tuple[int, float, float]]) -> float:
        """Tokens per second of plain ``steps`` (tokens, seconds, length), those over
        ``OUTLIER`` x the median time left out."""
        cap = cls.OUTLIER * statistics.median(s for _, s, _ in steps)
        kept = [(t, s) for t, s, _ in steps if s <= cap]
        return sum(t for t, _ in kept) / sum(s for _, s in kept)

    @property
    def gain(self) -> float | None:
        """The recent speculating steps' tokens over those plain steps would have emitted in
        their time (None: none timed yet). Steps over ``OUTLIER`` x the median's time are
        left out: the steps that first meet a new shape wait for MLX to compile kernels
        (seconds, against milliseconds); a recurring cost is within a few times the median."""
        if not self.spec:
            return None
        cap = self.OUTLIER * statistics.median(s for _, s, *_ in self.spec)
        kept = [(t, s, rate) for t, s, rate, *_ in self.spec if s <= cap]
        return sum(t for t, _, _ in kept) / sum(s * rate for _, s, rate in kept)

    @property
    def paying(self) -> bool:
        """Whether the last window judged paid (or the engine does not judge): a request's
        own back-off may end early then (engine/spec_shadow.py). Not before a first window
        paid: a verify costing 12 plain steps on the fake runner, requests resumed by their
        shadow verifies ran 11-31% longer than waiting out their back-offs."""
        return self.min_gain <= 0 or self.paid

    def shadowed(self, proposed: int, accepted: int) -> None:
        """A request decoding plainly during a back-off would have had ``accepted`` of the
        ``proposed`` tokens of a verify accepted (engine/spec_shadow.py). Over the last
        ``SHADOW_VERIFIES`` (the output's latest stretch: a rewrite's preamble fails, the
        copy after it does not): a verify costs the same whatever it accepts, so the losing
        window's gain, scaled by the tokens a row they would have emitted over its own, is
        what speculating now would give; where that clears ``min_gain`` by
        ``SHADOW_MARGIN``, the back-off ends."""
        if self.off_left <= 0:
            return
        self.shadow.append(accepted)
        if len(self.shadow) < self.SHADOW_VERIFIES:
            return
        gain, per_row = self.lost
        tokens = 1 + sum(self.shadow) / len(self.shadow)
        now = gain * tokens / per_row
        if now >= self.min_gain * self.SHADOW_MARGIN:
            self.off_left = 0
            self.resumes += 1
            log.info(
                "speculation back on after a back-off: proposals made meanwhile would have "
                "emitted %.2f tokens a verify (the losing window's steps %.2f a row)",
                tokens,
                per_row,
            )

    def allows(self, rows: int) -> bool:
        """Whether a step may speculate while ``rows`` requests decode (``decoding``)."""
        if self.min_gain <= 0:
            return True
        return self.off_left <= 0 and len(self.plain.get(rows, ())) >= self.PLAIN_SAMPLES

    def planned(
        self,
        step_id: int,
        segments: list[Segment],
        chunks: list[Segment],
        running: dict[str, Request],
        spec_mode: bool,
        drafts: Sequence[DraftQuery] = (),
    ) -> None:
        """A step about to launch (before it advances its requests' state); ``spec_mode``:
        built unchained because someone speculates; ``drafts``: its draft model queries."""
        if self.min_gain <= 0:
            return
        rows = decoding(running)
        what = step_kind(segments, chunks, running, spec_mode, drafts)
        if what and rows:
            length = sum(s.start for s in segments) / max(1, len(segments))
            self._steps[step_id] = (what, rows, length)

    def forget(self) -> None:
        """The steps in flight were dropped (a failure): none of them will be timed."""
        self._steps.clear()

    def timed(self, step_id: int, tokens: int, seconds: float, fresh: bool = False) -> None:
        """A step finalized after ``seconds``, emitting ``tokens``; ``fresh``: its time holds
        the tracing of a new shape (engine/loop.py), so it is not kept."""
        step = self._steps.pop(step_id, None)
        if step is None or seconds <= 0 or tokens <= 0:
            return
        what, rows, length = step
        if what == PLAIN:
            self.off_left = max(0, self.off_left - 1)
            if fresh:
                return
            if rows not in self._first:
                self._first.add(rows)  # (it may have waited for kernels to compile)
                return
            plain_steps = self.plain.setdefault(rows, deque(maxlen=self.WINDOW))
            plain_steps.append((tokens, seconds, length))
            return
        plain = self.plain.get(rows)
        if not plain or fresh:
            return
        ref = statistics.mean(n for _, _, n in plain)
        self.spec.append((tokens, seconds, self.rate(plain), length / ref if ref else 1.0, rows))
        if len(self.spec) < self.WINDOW:
            return
        gain = self.gain
        assert gain is not None
        # Stale where even the window's first steps (its least grown) ran over ``STALE`` x
        # longer sequences than their reference: the window's own growth is not staleness.
        if gain < self.min_gain and min(r for *_, r, _ in self.spec) > self.STALE:
            for b in {b for *_, b in self.spec}:
                self.plain.pop(b, None)  # (``allows`` waits for fresh ones)
            self.spec.clear()
            log.info(
                "speculation paused for plain steps at today's lengths: its steps emitted "
                "%.2fx the tokens per second of plain steps over shorter sequences",
                gain,
            )
        elif gain < self.min_gain:
            self.backoff = min(self.MAX_BACKOFF, 2 * self.backoff if self.backoff else self.BACKOFF)
            self.off_left = self.backoff
            self.backoffs += 1
            self.paid = False
            # Its tokens per decoding row a step, for the shadow verifies to be weighed against
            self.lost = (gain, sum(t for t, *_ in self.spec) / sum(b for *_, b in self.spec))
            self.shadow.clear()
            self.spec.clear()  # the next probe is judged on its own steps
            log.info(
                "speculation off for %d steps: its steps emitted %.2fx the tokens per second "
                "of plain decoding",
                self.backoff,
                gain,
            )
        else:
            self.backoff = 0
            self.paid = gain > self.min_gain  # (steps that verified nothing read 1.0)
