"""Speculation turns itself off while its steps emit fewer tokens per second than plain
steps at the same batch (engine/spec_gain.py), from the loop's step times."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.plan import DraftQuery, Segment
from tandem.engine.request import RequestStatus
from tandem.engine.spec_gain import PLAIN, SPEC, SpecGain, decoding, step_kind
from tandem.testing.step_clock import step_clock

G = SpecGain


class _Req:
    def __init__(self, status: RequestStatus = RequestStatus.DECODE, replaying: bool = False):
        self.status, self.replaying = status, replaying


def _decode(rid: str, n: int = 1) -> Segment:
    return Segment(rid, 10, n, (1,) * n, (0,), sample_row=0, num_samples=n)


def _chunk(rid: str) -> Segment:
    return Segment(rid, 0, 5, (1,) * 5, (0,), sample_row=-1)


def test_steps_are_plain_speculating_or_not_compared():
    running = {"a": _Req(), "b": _Req(), "p": _Req(RequestStatus.PREFILL)}
    replay = {"a": _Req(), "b": _Req(RequestStatus.PREFILL, replaying=True)}
    assert step_kind([_decode("a"), _decode("b")], [], running, False) == PLAIN
    assert step_kind([_decode("a", 5), _decode("b")], [], running, False) == SPEC
    # A rejected verify's replay: speculation's cost, at the batch size with it.
    assert step_kind([_decode("a")], [_chunk("b")], replay, False) == SPEC
    assert decoding(replay) == 2 and decoding({"b": replay["b"]}) == 1
    # One-token rows only, but built unchained because someone speculates (its proposal was
    # cut to nothing, or a draft only caught up): not a plain step either.
    assert step_kind([_decode("a"), _decode("b")], [], running, True) == SPEC
    assert step_kind([_decode("a", 5)], [_chunk("p")], running, False) == ""  # a prompt chunk
    # A draft catching up on more than a verify's worth (a new prompt, or what was decoded
    # while speculation was backed off): paid once per request or probe, not compared.
    steady = DraftQuery("a", 10, (1, 2, 3), (0,), 2)
    catch_up = DraftQuery("b", 2, (1,) * 40, (0,), 2)
    assert step_kind([_decode("a", 3)], [], running, True, [steady]) == SPEC
    both = [_decode("a", 3), _decode("b", 3)]
    assert step_kind(both, [], running, True, [steady, catch_up]) == ""


def _run(
    gain: SpecGain, steps: list[tuple[str, int, float]], rows: int = 4, start: int = 10
) -> list[bool]:
    """Time ``(kind, tokens, seconds)`` steps of ``rows`` decoding requests (each ``start``
    tokens long); whether each step after it may speculate."""
    running = {str(i): _Req() for i in range(rows)}
    allowed = []
    for i, (what, tokens, seconds) in enumerate(steps):
        n = 5 if what == SPEC else 1
        segments = [replace(_decode(r, n), start=start) for r in running]
        gain.planned(i, segments, [], running, False)
        gain.timed(i, tokens, seconds)
        allowed.append(gain.allows(rows))
    return allowed


def test_a_batch_size_needs_plain_steps_first():
    """PLAIN_SAMPLES after its first (which may have waited for compilation: not kept)."""
    gain = SpecGain(1.0)
    assert not gain.allows(4)
    warm = [(PLAIN, 4, 5.0)] + [(PLAIN, 4, 0.01)] * G.PLAIN_SAMPLES
    assert _run(gain, warm) == [False] * G.PLAIN_SAMPLES + [True]
    assert list(gain.plain[4]) == [(4, 0.01, 10.0)] * G.PLAIN_SAMPLES  # (rows 10 long)
    assert not gain.allows(3)  # another batch size: its own plain steps first
    assert SpecGain(0).allows(3)  # min_gain 0: never off


def test_losing_speculation_backs_off_doubling_and_resets_when_it_pays():
    gain = SpecGain(1.0)
    _run(gain, [(PLAIN, 4, 0.01)] * (G.PLAIN_SAMPLES + 1))
    # Verifies yielding 8 tokens in 3 plain steps' time: 0.67x.
    losing = [(SPEC, 8, 0.03)] * G.WINDOW
    assert _run(gain, losing) == [True] * (G.WINDOW - 1) + [False]
    assert gain.off_left == G.BACKOFF and gain.backoffs == 1
    # Plain steps count the back-off down (and keep measuring the plain rate).
    assert _run(gain, [(PLAIN, 4, 0.01)] * G.BACKOFF) == [False] * (G.BACKOFF - 1) + [True]
    _run(gain, losing)
    assert gain.off_left == 2 * G.BACKOFF and gain.backoffs == 2
    _run(gain, [(PLAIN, 4, 0.01)] * 2 * G.BACKOFF)
    # A probe that pays (12 tokens in 2 plain steps' time: 1.5x) keeps it on and resets the
    # next back-off to the first length.
    assert _run(gain, [(SPEC, 12, 0.02)] * (2 * G.WINDOW)) == [True] * (2 * G.WINDOW)
    assert gain.backoff == 0 and gain.gain == pytest.approx(1.5)


@pytest.mark.parametrize(("accepted", "ends"), [(4, True), (1, False)])
def test_shadow_verifies_weigh_the_losing_window_against_what_they_would_accept(accepted, ends):
    """A window of 4 rows emitting 8 tokens a step (2 a row) in 3 plain steps' time lost
    (0.67x). Shadow verifies accepting 4 of 4 (5 tokens a row) would have given 1.67x: the
    back-off ends after SHADOW_VERIFIES of them; accepting 1 (2 a row, as the window did)
    would not have paid, and it runs on."""
    gain = SpecGain(1.0)
    _run(gain, [(PLAIN, 4, 0.01)] * (G.PLAIN_SAMPLES + 1))
    _run(gain, [(SPEC, 8, 0.03)] * G.WINDOW)
    assert gain.off_left == G.BACKOFF
    for _ in range(G.SHADOW_VERIFIES - 1):
        gain.shadowed(4, accepted)
    assert gain.off_left == G.BACKOFF  # (too few to weigh)
    gain.shadowed(4, accepted)
    assert (gain.off_left == 0) is ends and gain.resumes == int(ends)
    assert gain.backoff == G.BACKOFF  # a next loss doubles it as before


def test_a_few_slow_first_steps_do_not_turn_it_off():
    """The first steps of a new shape wait for MLX to compile kernels: steps over 10x the
    window's median time are left out."""
    gain = SpecGain(1.0)
    _run(gain, [(PLAIN, 4, 0.01)] * (G.PLAIN_SAMPLES + 1))
    steps = [(SPEC, 12, 3.0)] * 3 + [(SPEC, 12, 0.02)] * (G.WINDOW - 3)
    assert all(_run(gain, steps))
    assert gain.backoffs == 0


def test_steps_that_met_a_new_shape_are_left_out():
    """A first run meets new shapes for a while, plain and speculating steps alike, each a
    few times a warm step's time (under ``OUTLIER``): judged on them, a paying speculation
    would back off. Steps whose launch traced (``fresh``) are not kept."""
    gain = SpecGain(1.0)
    running = {str(i): _Req() for i in range(4)}

    def step(i: int, what: str, tokens: int, seconds: float, fresh: bool) -> None:
        n = 5 if what == SPEC else 1
        gain.planned(i, [_decode(r, n) for r in running], [], running, False)
        gain.timed(i, tokens, seconds, fresh=fresh)

    for i in range(G.PLAIN_SAMPLES + 1):  # warm plain steps, the first not kept
        step(i, PLAIN, 4, 0.01, False)
    step(10, PLAIN, 4, 0.05, True)  # a fresh plain step: not a reference
    assert [s for _, s, _ in gain.plain[4]] == [0.01] * G.PLAIN_SAMPLES
    # Verifies emitting 12 tokens: 0.04 s while meeting shapes (0.4x plain), 0.02 warm.
    for i in range(G.WINDOW):
        step(20 + i, SPEC, 12, 0.04, True)
    assert not gain.spec and gain.backoffs == 0
    for i in range(G.WINDOW):
        step(40 + i, SPEC, 12, 0.02, i % 2 == 0)
    assert len(gain.spec) == G.WINDOW // 2 and gain.backoffs == 0
    assert gain.gain == pytest.approx(1.5)
    # Unmarked, the same slow steps are judged (under OUTLIER x the median: kept).
    for i in range(G.WINDOW):
        step(60 + i, SPEC, 12, 0.04, False)
    assert gain.backoffs == 1


def test_plain_steps_are_rated_by_their_sums():
    """A late finalize makes one chained step's interval long and the next's a fraction of
    a millisecond: pairs of 19.5 and 0.5 ms (4 tokens each) are 400 tokens/s, where a median
    of per-step rates would read 4,100 and take verifies of 1.5x for a loss."""
    gain = SpecGain(1.0)
    _run(gain, [(PLAIN, 4, 0.01)] + [(PLAIN, 4, 0.0195), (PLAIN, 4, 0.0005)] * G.WINDOW)
    assert G.rate(gain.plain[4]) == pytest.approx(400.0)
    assert all(_run(gain, [(SPEC, 12, 0.02)] * G.WINDOW))
    assert gain.backoffs == 0 and gain.gain == pytest.approx(1.5)


def test_a_recurring_cost_is_not_taken_for_compilation():
    """Steps a few times the median's time (a draft catching up, a long replay) count in
    full: 6 verifies of 8 tokens at 1.5 plain steps' time and 2 of 0.09 s (9 plain steps)
    emit 64 tokens where plain steps would have emitted 36 + 72 = 108 (0.59x; without those
    two, 1.33x: left out as compilation they would keep a losing speculation on)."""
    gain = SpecGain(1.0)
    _run(gain, [(PLAIN, 4, 0.01)] * (G.PLAIN_SAMPLES + 1))
    _run(gain, [(SPEC, 8, 0.015)] * 6 + [(SPEC, 8, 0.09)] * 2)
    assert gain.backoffs == 1


def test_a_verdict_against_plain_steps_over_shorter_sequences_takes_fresh_ones():
    """Plain steps timed at rows 100 long, verifies at 200 (over ``STALE`` x): a losing
    verdict drops the plain steps instead of backing off, speculation waits for plain steps
    at today's lengths, and is judged against them; there it pays. Where verifies lose
    against plain steps as long as theirs, it backs off."""
    gain = SpecGain(1.0)
    _run(gain, [(PLAIN, 4, 0.01)] * (G.PLAIN_SAMPLES + 1), start=100)
    # 8 tokens in 3 short plain steps' time: 0.67x, judged against stale ones.
    assert _run(gain, [(SPEC, 8, 0.03)] * G.WINDOW, start=200)[-1] is False
    assert gain.backoffs == 0 and gain.off_left == 0 and 4 not in gain.plain
    # Plain steps at 200 take twice as long: speculation runs again after enough of them.
    fresh = _run(gain, [(PLAIN, 4, 0.02)] * G.PLAIN_SAMPLES, start=200)
    assert fresh == [False] * (G.PLAIN_SAMPLES - 1) + [True]
    assert all(_run(gain, [(SPEC, 8, 0.03)] * G.WINDOW, start=210))  # 1.33x: stays on
    assert gain.backoffs == 0 and gain.gain == pytest.approx(8 / 6)
    # Losing against plain steps of its own lengths: a back-off, as before.
    _run(gain, [(SPEC, 8, 0.06)] * G.WINDOW, start=220)
    assert gain.backoffs == 1 and gain.off_left == G.BACKOFF
    # A window growing past STALE x from a reference close to its first steps (its own
    # tokens, not a stale reference): judged, and backed off.
    gain = SpecGain(1.0)
    _run(gain, [(PLAIN, 4, 0.01)] * (G.PLAIN_SAMPLES + 1), start=100)
    for i in range(G.WINDOW):
        _run(gain, [(SPEC, 8, 0.03)], start=110 + 20 * i)
    assert gain.backoffs == 1 and 4 in gain.plain


def test_a_failed_step_is_never_timed():
    gain = SpecGain(1.0)
    running = {"a": _Req()}
    gain.planned(1, [_decode("a")], [], running, False)
    gain.forget()
    gain.timed(1, 1, 0.01)
    assert not gain.plain


@pytest.mark.parametrize(("spec_cost", "turned_off"), [(12.0, True), (1.0, False)])
def test_the_engine_turns_speculation_off_where_it_loses(tiny_model_dir, spec_cost, turned_off):
    """A random model falls into loops that the n-gram proposer predicts: a verify step
    costing 12 plain steps loses; one costing what a plain step does never loses (it emits at
    least a token per row) and pays once proposals are accepted. The output is the same
    either way."""
    path = str(tiny_model_dir("llama"))
    prompts = [[5, 9, 14, 3, 27, 7, 8, 11, 2, 40 + i] for i in range(2)]
    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(path).generate(prompts, params)]
    llm = LLM(path, speculative="ngram", num_speculative_tokens=4, speculative_min_gain=1.0)
    step_clock(llm.engine.loop, plain=1.0, verify=spec_cost)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    sched = llm.engine.scheduler
    assert sched.stats.spec_accepted > 0
    assert (sched.gain.backoffs > 0) == turned_off
    if turned_off:
        assert sched.gain.gain is None or sched.gain.gain < 1.0
        # Verifies stopped at the first window's end, then probed again after back-offs.
        assert sched.stats.spec_verifies < 0.5 * 160
    else:
        assert sched.gain.gain > 1.0


@pytest.mark.parametrize("overlap", [True, False])
def test_the_loop_times_each_step_once_and_not_the_idle_time(overlap):
    """A chained step's time is the interval between finalizes, a fresh one's runs from its
    launch: with every step costing one unit of the fake runner's finalize, every timed
    step reads one unit, overlap on and off, and an idle minute between two requests is in
    neither's time."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_speculation import drive, engine_for

    from tandem.engine.speculation import SpecConfig

    engine, runner = engine_for(overlap, speculation=SpecConfig(num_tokens=4, min_gain=1.0))
    now = [0.0]
    finalize = runner.finalize

    def finalizing(handle):
        now[0] += 1.0
        return finalize(handle)

    runner.finalize = finalizing
    engine.loop.clock = lambda: now[0]
    seconds: list[float] = []
    timed = engine.scheduler.gain.timed
    gain = engine.scheduler.gain
    gain.timed = lambda sid, tokens, s, fresh: (seconds.append(s), timed(sid, tokens, s, fresh))
    drive(engine, {0: [("a", [3, 5, 7, 9], 1, 12)]})
    now[0] += 60.0  # idle
    drive(engine, {0: [("b", [4, 6, 8, 10], 2, 12)]})
    assert len(seconds) >= 10 and set(seconds) == {1.0}
    assert engine.loop.num_chained > 0 if overlap else engine.loop.num_chained == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_the_loop_marks_the_steps_a_trace_falls_in(overlap):
    """A launch that meets a new shape (the runner's ``shapes`` count moves) makes its own
    step fresh, and, chained, the step in flight too: that step's interval ends at its
    finalize, after the child's launch."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_speculation import drive, engine_for

    from tandem.engine.speculation import SpecConfig

    engine, runner = engine_for(overlap, speculation=SpecConfig())  # (plain steps chain)
    tracing = {5, 9}
    runner.new_shape_fn = lambda plan: plan.step_id in tracing
    marked: dict[int, bool] = {}
    timed = engine.scheduler.gain.timed

    def record(sid, tokens, s, fresh):
        marked[sid] = fresh
        timed(sid, tokens, s, fresh)

    engine.scheduler.gain.timed = record
    drive(engine, {0: [("a", [3, 5, 7, 9], 1, 16), ("b", [4, 6, 8], 2, 16)]})
    assert runner.shapes == 2
    fresh = {sid for sid, f in marked.items() if f}
    chained = {p.step_id: p.parent_step for p in runner.launched if p.chained}
    want = tracing | {chained[s] for s in tracing if s in chained}
    assert fresh == want and engine.loop.num_fresh == len(want)
    assert (len(want) == 4) == overlap
