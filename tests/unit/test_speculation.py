"""N-gram speculative decoding in the scheduler, with the fake runner: a verify segment's
rows, accepted runs cut at the first mismatch or stop, KV cut back and pages released, the
back-off, and — the point — output identical to plain greedy decoding under staggered
arrivals, aborts in flight, page boundaries inside accepted runs, prefix hits, page pressure
and overlap on and off, with the invariants checked every step."""

from __future__ import annotations

import random

import pytest

from tandem.engine.engine import Engine
from tandem.engine.scheduler import SchedulerConfig
from tandem.engine.speculation import NgramIndex, SpecConfig, SpecState, accepted_tokens
from tandem.sampling_params import SamplingParams
from tandem.testing.fake_runner import (
    FakeDraft,
    FakeRunner,
    copying_token,
    fake_token,
    fake_tokens,
)
from tandem.testing.step_clock import step_clock

P = 4


# ---- the proposer and the acceptance rule -------------------------------------------------
def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    idx.extend(toks)
    assert idx.propose(3) == [7, 5, 1]  # "1 2 3" last occurred at 4: then 7 5 1
    toks += [7]  # the suffix "3 7" / "2 3 7" occurred at 6..7, followed by 5 1 2
    idx.extend(toks)
    assert idx.propose(2) == [5, 1]
    assert idx.propose(6) == [5, 1, 2, 3, 7, 5]  # the copy runs on into its own proposal
    loop = NgramIndex(1, 4)
    loop.extend([9, 4, 6, 4, 6])
    assert loop.propose(5) == [4, 6, 4, 6]  # period 2: run on, up to 2^2 for a 2-token match
    loop.extend([9, 4, 6, 4, 6, 4, 6])
    assert loop.propose(5) == [4, 6, 4, 6, 4]  # a 4-token match: all five
    assert NgramIndex(1, 3).propose(4) == []
    lone = NgramIndex(1, 2)
    lone.extend([4, 5, 6])
    assert lone.propose(4) == []  # nothing repeats: the suffix never matches itself
    short = NgramIndex(2, 3)
    short.extend([8, 1, 8])
    assert short.propose(3) == []  # only a 1-gram repeats; min_n is 2


def test_accepted_tokens_stop_at_the_first_mismatch():
    assert accepted_tokens((5, 6, 7), (5, 6, 7, 8)) == [5, 6, 7, 8]  # all + the free one
    assert accepted_tokens((5, 6, 7), (5, 9, 7, 8)) == [5, 9]
    assert accepted_tokens((5, 6, 7), (4, 6, 7, 8)) == [4]
    assert accepted_tokens((), (3,)) == [3]


def test_back_off_after_failures_doubles():
    cfg = SpecConfig(num_tokens=4, patience=2, backoff=3)
    s = SpecState(NgramIndex(1, 2))
    s.record(cfg, 4, 0)
    assert s.active
    s.record(cfg, 4, 0)
    assert not s.active and s.plain_left == 3
    s.plain_tokens(3)
    assert s.active
    s.no_proposal(cfg)
    s.no_proposal(cfg)
    assert s.plain_left == 6 and s.verifies == 2
    s.plain_tokens(6)
    s.record(cfg, 4, 1)  # any acceptance resets the count
    s.record(cfg, 4, 0)
    assert s.active


def test_a_shadow_verify_that_would_have_paid_ends_the_back_off():
    cfg = SpecConfig(num_tokens=4, patience=1, backoff=16)
    s = SpecState(NgramIndex(1, 2))
    s.record(cfg, 4, 0)
    assert s.plain_left == 16
    s.shadowed(4, 1, ready=True)  # a quarter: the back-off runs on
    s.shadowed(4, 4, ready=False)  # nothing to propose next: it runs on too
    assert s.plain_left == 16
    s.shadowed(4, 2, ready=True)
    assert s.active and s.next_backoff == 16  # (the next back-off keeps its length)


# ---- the engine on the fake runner --------------------------------------------------------
def engine_for(overlap: bool, k: int = 4, **cfg) -> tuple[Engine, FakeRunner]:
    base = {
        "max_num_seqs": 8,
        "max_model_len": 4096,
        "page_size": P,
        "max_num_batched_tokens": 32,
        "speculation": SpecConfig(num_tokens=k, max_batch=8, patience=3, backoff=4),
    }
    config = SchedulerConfig(**{**base, **cfg})
    runner = FakeRunner(config.num_pages, config.page_size, token_fn=copying_token)
    return Engine(runner, config, overlap=overlap, check_invariants=True), runner


def params(n: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, seed=seed, temperature=0, ignore_eos=True, **kw)


def drive(engine: Engine, arrivals: dict[int, list[tuple]], aborts: dict[int, str] | None = None):
    """Step the engine, adding (rid, prompt, seed, max_tokens) at their step and aborting
    ids at theirs; returns each request's tokens and finish reason."""
    aborts = aborts or {}
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while engine.has_unfinished() or any(s >= step for s in arrivals):
        for rid, prompt, seed, n in arrivals.get(step, []):
            engine.add_request(prompt, params(n, seed), rid)
            got[rid] = []
        if step in aborts:
            engine.abort(aborts[step])
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            got[out.request_id] += out.new_token_ids
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
        engine.check_invariants()
        step += 1
    return got, reasons


def staggered(rng: random.Random) -> tuple[dict[int, list[tuple]], dict[str, tuple]]:
    """18 requests arriving over 40 steps, a third of them on a shared 13-token prefix:
    ``drive``'s arrivals, and each request's (prompt, seed, max_tokens)."""
    shared = [rng.randrange(1000) for _ in range(13)]
    arrivals: dict[int, list[tuple]] = {}
    want: dict[str, tuple[list[int], int, int]] = {}
    for i in range(18):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1000) for _ in range(1 + i % 9)]
        seed, n = rng.randrange(100), rng.randrange(5, 60)
        arrivals.setdefault(rng.randrange(40), []).append((f"r{i}", prompt, seed, n))
        want[f"r{i}"] = (prompt, seed, n)
    return arrivals, want


def check_staggered(got: dict, reasons: dict, want: dict) -> None:
    """Every request of ``staggered`` produced its expected tokens (a prefix if aborted)."""
    for rid, (prompt, seed, n) in want.items():
        full = expected(seed, prompt, n)
        if reasons[rid] == "abort":
            assert got[rid] == full[: len(got[rid])], rid
        else:
            assert got[rid] == full and reasons[rid] == "length", rid


def expected(seed: int, prompt: list[int], n: int) -> list[int]:
    return fake_tokens(seed, prompt, n, copying_token)


@pytest.mark.parametrize("overlap", [True, False])
def test_single_stream_is_exact_and_accepts_runs(overlap):
    engine, runner = engine_for(overlap)
    prompt = [7, 3, 9, 1, 4, 4, 2]
    got, reasons = drive(engine, {0: [("a", prompt, 2, 120)]})
    assert got["a"] == expected(2, prompt, 120) and reasons["a"] == "length"
    stats = engine.scheduler.stats
    assert stats.spec_verifies > 5 and stats.spec_accepted > 40
    # Fewer steps than tokens: accepted runs came several tokens a step.
    assert len(runner.launched) < 120 * 0.7
    verify = [s for p in runner.launched for s in p.segments if s.num_samples > 1]
    assert verify and all(s.num_tokens == s.num_samples <= 5 for s in verify)


@pytest.mark.parametrize("overlap", [True, False])
def test_off_and_on_give_the_same_tokens(overlap):
    base_engine, _ = engine_for(overlap, speculation=SpecConfig())
    arrivals = {0: [("a", [5, 6, 7, 5, 6, 7], 4, 50), ("b", [1, 2, 3], 1, 40)]}
    plain, _ = drive(base_engine, arrivals)
    engine, _ = engine_for(overlap)
    spec, _ = drive(engine, arrivals)
    assert spec == plain
    assert engine.scheduler.stats.spec_accepted > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_staggered_load_with_hits_aborts_and_page_pressure_is_exact(overlap):
    arrivals, want = staggered(random.Random(5))
    aborts = {12: "r4", 25: "r9"}
    # A small pool: verify pages and retractions compete (48 pages of 4 positions).
    engine, _ = engine_for(overlap, kv_budget_tokens=48 * P, max_num_seqs=6)
    got, reasons = drive(engine, arrivals, aborts)
    check_staggered(got, reasons, want)
    stats = engine.scheduler.stats
    assert stats.spec_accepted > 0 and stats.hit_tokens > 0
    # Everything went back: no page held once all ended.
    assert engine.scheduler.kv.num_held == 0


def test_stop_token_inside_an_accepted_run_ends_there():
    engine, runner = engine_for(False)
    prompt = [7, 3, 9, 1, 4, 4, 2]
    full = expected(2, prompt, 120)
    # A stop token that appears after speculation has started accepting runs.
    stop = full[60]
    first = full.index(stop)
    engine.add_request(
        prompt, SamplingParams(max_tokens=120, seed=2, temperature=0, stop_token_ids=[stop]), "a"
    )
    out: list[int] = []
    reason = None
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
            reason = o.finish_reason or reason
        engine.check_invariants()
    assert out == full[: first + 1] and reason == "stop"


def test_max_tokens_caps_the_proposal():
    engine, runner = engine_for(False, k=8)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    got, reasons = drive(engine, {0: [("a", prompt, 0, 9)]})
    assert got["a"] == expected(0, prompt, 9) and reasons["a"] == "length"
    for plan in runner.launched:
        for seg in plan.segments:
            # The verify never proposes past the 9th output token.
            assert seg.end <= len(prompt) + 9


def test_speculation_waits_until_the_batch_is_small_enough():
    """Four decode (more than max_batch 2): plain chained steps; as they finish, the last
    two speculate."""
    engine, runner = engine_for(True, speculation=SpecConfig(num_tokens=4, max_batch=2))
    lengths = [10, 20, 60, 70]
    prompt = [1, 2, 3, 1, 2, 3]
    got, _ = drive(engine, {0: [(f"r{i}", prompt, i, n) for i, n in enumerate(lengths)]})
    assert all(got[f"r{i}"] == expected(i, prompt, n) for i, n in enumerate(lengths))
    verify_plans = [p for p in runner.launched if any(s.num_samples > 1 for s in p.segments)]
    assert verify_plans
    for plan in verify_plans:  # only once at most two requests were left decoding
        assert len(plan.request_ids) <= 2 and plan.request_ids <= {"r2", "r3"}
    full = [p for p in runner.launched if len(p.request_ids) == 4]
    assert full and all(s.num_samples == 1 for p in full for s in p.segments)
    assert engine.loop.num_chained > 0


def test_verify_rows_count_the_proposals_before_them_as_output():
    engine, runner = engine_for(False)
    params = SamplingParams(max_tokens=40, seed=2, temperature=0, presence_penalty=0.5)
    prompt = [7, 3, 9, 1, 4, 4, 2]
    engine.add_request(prompt, params, "p")
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
        engine.check_invariants()
    verify = [p for p in runner.launched if any(s.num_samples > 1 for s in p.segments)]
    assert verify
    for plan in verify:
        seg = next(s for s in plan.segments if s.num_samples > 1)
        pens = {row: ids for row, *_, ids in plan.sampling.penalties}
        base = pens[seg.sample_row]
        for i in range(1, seg.num_samples):
            assert pens[seg.sample_row + i] == base + seg.token_ids[1 : 1 + i]
    assert out == expected(2, prompt, 40)


def test_the_loop_runs_unchained_while_anyone_speculates():
    """No request is left out of a step for its verify to land: while requests speculate
    every step is fresh and carries all of them; once they back off the chain resumes."""
    cfg = SpecConfig(num_tokens=4, max_batch=8, patience=1000, backoff=4)
    engine, runner = engine_for(True, speculation=cfg)
    arrivals = {0: [(f"r{i}", [3 + i, 5, 7, 3 + i, 5, 7], i, 40) for i in range(3)]}
    got, _ = drive(engine, arrivals)
    assert all(got[f"r{i}"] == expected(i, [3 + i, 5, 7, 3 + i, 5, 7], 40) for i in range(3))
    decodes = [p for p in runner.launched if all(s.sample_row >= 0 for s in p.segments)]
    assert decodes and not any(p.chained for p in decodes)
    assert all(len(p.segments) == 3 for p in decodes[:5])  # everyone, every step
    # Back-off: the same load with patience 1 soon chains again.
    engine, runner = engine_for(True, speculation=SpecConfig(num_tokens=4, patience=1))
    got, _ = drive(engine, {0: [("x", [1, 2, 3, 4, 5, 6, 7, 8], 3, 60)]})
    assert got["x"] == expected(3, [1, 2, 3, 4, 5, 6, 7, 8], 60)
    assert engine.loop.num_chained > 0 and engine.scheduler.stats.spec_verifies > 0


def test_a_long_history_is_indexed_a_slice_per_call():
    from tandem.engine.speculation import INDEX_PER_CALL

    toks = [7, 8, 9] + list(range(100, 100 + 3 * INDEX_PER_CALL)) + [7, 8]
    idx = NgramIndex(1, 3)
    idx.extend(toks)  # the oldest INDEX_PER_CALL positions only: "7 8" at 0 is in
    assert idx._indexed == INDEX_PER_CALL and idx.propose(2) == [9, 100]
    toks = toks + [9, 100, 101]  # the rest is indexed over the next calls
    idx.extend(toks)
    assert idx._indexed == 2 * INDEX_PER_CALL
    for _ in range(3):
        idx.extend(toks)
    assert idx._indexed == len(toks) - 1
    assert idx.propose(2) == [102, 103]


# ---- draft-model proposals (engine/drafting.py) --------------------------------------------
def draft_engine(overlap: bool, fail_calls=(), **cfg) -> tuple[Engine, FakeDraft]:
    """A perfect fake draft (the target's own token function): every proposal is accepted
    iff the scheduler fed the draft the request's true history."""
    base = {"max_num_seqs": 8, "page_size": P, "max_num_batched_tokens": 32}
    config = SchedulerConfig(
        **{**base, **cfg}, speculation=SpecConfig(num_tokens=4, max_batch=8, draft=True)
    )
    runner = FakeRunner(config.num_pages, config.page_size, token_fn=copying_token)
    seeds: dict[str, int] = {}
    draft = FakeDraft(
        config.num_pages, P, seeds.__getitem__, copying_token, fail_calls=frozenset(fail_calls)
    )
    runner.draft = draft
    engine = Engine(runner, config, overlap=overlap, check_invariants=True, proposer=draft)
    add = engine.add_request

    def add_request(prompt, params, rid):
        seeds[rid] = params.seed
        return add(prompt, params, rid)

    engine.add_request = add_request
    return engine, draft


@pytest.mark.parametrize("overlap", [True, False])
def test_a_perfect_draft_is_always_accepted_under_staggered_load(overlap):
    """Staggered arrivals, prefix hits, aborts and a small pool (retractions): exact output,
    and every proposal accepted, so the draft's KV was each request's history every time
    (catch-up after prefills, plain stretches, partial accepts and retractions)."""
    arrivals, want = staggered(random.Random(11))
    engine, draft = draft_engine(overlap, kv_budget_tokens=28 * P, max_num_seqs=6)
    got, reasons = drive(engine, arrivals, {12: "r4", 25: "r9"})
    check_staggered(got, reasons, want)
    stats = engine.scheduler.stats
    assert stats.spec_proposed > 100 and stats.spec_accepted == stats.spec_proposed
    assert stats.hit_tokens > 0 and stats.retractions > 0
    assert engine.scheduler.kv.num_held == 0


def test_an_imperfect_draft_is_exact_and_its_cache_follows_partial_accepts():
    """A draft that is the fake model only most of the time (the copying model's rule, not
    its exceptions): partial accepts cut the draft's valid length back; output exact."""
    engine, draft = draft_engine(True)
    draft.token_fn = lambda seed, h: copying_token(seed, h) if len(h) % 5 else 0
    prompt = [7, 3, 9, 1, 4, 4, 2]
    got, _ = drive(engine, {0: [("a", prompt, 2, 150)]})
    assert got["a"] == expected(2, prompt, 150)
    stats = engine.scheduler.stats
    assert 0 < stats.spec_accepted < stats.spec_proposed
    # Catch-up fed the prompt once and otherwise only what verifies left unseen.
    assert draft.fed < len(prompt) + 150 + stats.spec_verifies


def test_a_failing_draft_in_a_step_costs_proposals_not_tokens():
    """A draft that fails inside a step proposes placeholders (verified like any proposal)
    and loses its KV: every request's draft catches up from 0, the output stays exact."""
    engine, draft = draft_engine(True, fail_calls={3, 9})
    prompt = [5, 6, 7, 5, 6, 7, 1]
    got, _ = drive(engine, {0: [("a", prompt, 4, 80), ("b", [1, 2, 3], 1, 60)]})
    assert got == {"a": expected(4, prompt, 80), "b": expected(1, [1, 2, 3], 60)}
    stats = engine.scheduler.stats
    # The placeholders' verifies count as no proposal, not as rejected proposals.
    assert stats.step_failures == 0 and draft.resets == 2
    assert stats.spec_accepted == stats.spec_proposed > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_penalized_requests_draft_before_the_step(overlap):
    """A penalty counts proposals as output when the step is built, so a penalized request's
    draft runs during scheduling (its own call, trimmed like n-gram proposals); a failure
    there costs that step's proposals only, not the step."""
    engine, draft = draft_engine(overlap, fail_calls={4})
    prompt = [5, 6, 7, 5, 6, 7, 1]
    pen = SamplingParams(max_tokens=70, seed=4, temperature=0, ignore_eos=True, presence_penalty=1)
    engine.add_request(prompt, pen, "a")
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.new_token_ids
        engine.check_invariants()
    assert got == expected(4, prompt, 70)  # (the fake model ignores penalties)
    stats = engine.scheduler.stats
    assert draft.resets == 1 and stats.step_failures == 0
    assert not any(p.drafts for p in engine.loop.runner.launched)  # none rode a step
    assert stats.spec_accepted == stats.spec_proposed > 0


def test_draft_catch_up_is_bounded_per_call():
    """A long prompt is fed to the draft a budget at a time; meanwhile it decodes plainly."""
    engine, draft = draft_engine(True)
    draft.max_tokens = 16
    prompt = list(range(100, 190))
    got, _ = drive(engine, {0: [("a", prompt, 3, 40)]})
    assert got["a"] == expected(3, prompt, 40)
    assert engine.scheduler.stats.spec_accepted > 0
    assert draft.calls > len(prompt) // 16  # several catch-up calls before the first proposal


def test_a_useless_proposer_makes_new_requests_start_backed_off():
    """A draft that never agrees: the first requests fail their way into back-off, and once
    the engine-wide acceptance is low, later requests start backed off (a probe of
    ``patience`` verifies per ``cold_backoff`` tokens instead of per request)."""
    engine, draft = draft_engine(False)
    draft.token_fn = lambda seed, h: 999 - copying_token(seed, h) % 7  # never the target's
    sched = engine.scheduler
    verifies = []
    for i in range(6):  # (verifies per request read [8, 8, 0, 8, 0, 0] when written)
        before = sched.stats.spec_verifies
        prompt = [3 + i, 4, 5, 6]
        got, _ = drive(engine, {0: [(f"r{i}", prompt, i, 40)]})
        assert got[f"r{i}"] == expected(i, prompt, 40)
        verifies.append(sched.stats.spec_verifies - before)
    assert sched.stats.spec_accepted == 0
    # Later requests mostly start backed off; now and then one probes.
    assert verifies[0] >= 3 and verifies[2:].count(0) >= 2, verifies
    assert sched.acceptance.rate < sched.config.speculation.min_acceptance
    # The draft turns good: requests too short to outlast the cold back-off still bring
    # speculation back (the rate drifts up with each cold start until one probes).
    draft.token_fn = copying_token
    for i in range(6, 30):
        prompt = [3 + i, 4, 5, 6]
        got, _ = drive(engine, {0: [(f"r{i}", prompt, i, 40)]})
        assert got[f"r{i}"] == expected(i, prompt, 40)
    assert sched.stats.spec_accepted > 0
    assert sched.acceptance.rate > sched.config.speculation.min_acceptance


PREAMBLE, PROMPT = 30, 40


def preamble_then_copy(seed: int, history) -> int:
    """A rewrite: ``PREAMBLE`` tokens the ``PROMPT``-token prompt does not hold, then the
    prompt copied from its start."""
    j = len(history) - PROMPT  # the output position
    return history[(j - PREAMBLE) % PROMPT] if j >= PREAMBLE else fake_token(seed, history)


def preamble_or_loop(seed: int, history) -> int:
    """Seed 0 repeats its last 5 tokens from the start (always accepted); others rewrite."""
    return history[-5] if seed == 0 else preamble_then_copy(seed, history)


def _prompt(seed: int) -> list[int]:
    return [random.Random(seed).randrange(1, 1000) for _ in range(PROMPT)]


def _with_and_without_shadow(monkeypatch, overlap: bool, cfg: SpecConfig, token_fn):
    """(shadow, engine, runner): an engine with shadow proposals, then one without."""
    from tandem.engine import spec_shadow

    for shadow in (True, False):
        if not shadow:
            monkeypatch.setattr(spec_shadow, "observe", lambda *a: None)
        engine, runner = engine_for(overlap, speculation=cfg)
        runner.token_fn = token_fn
        yield shadow, engine, runner


@pytest.mark.parametrize("overlap", [True, False])
def test_shadow_proposals_end_a_back_off_where_the_output_starts_copying(overlap, monkeypatch):
    """The preamble's failed verifies back the rewriting request off (doubling); once its
    output copies its prompt, the n-gram proposals made meanwhile (shadow verifies) would be
    accepted in full, which ends the back-off: fewer steps than waiting it out, the same
    tokens. Beside it a request speculates all along (a verify's five rows and the plain
    row make six sampled rows, over ``max_batch``: the step still counts two requests)."""
    steps = {}
    cfg = SpecConfig(num_tokens=4, max_batch=4, patience=2, backoff=8)
    for shadow, engine, runner in _with_and_without_shadow(
        monkeypatch, overlap, cfg, preamble_or_loop
    ):
        n = PREAMBLE + 90
        got, _ = drive(engine, {0: [("loop", _prompt(0), 0, n), ("a", _prompt(1), 1, n)]})
        for i, rid in enumerate(("loop", "a")):
            assert got[rid] == fake_tokens(i, _prompt(i), n, preamble_or_loop), rid
        steps[shadow] = len(runner.launched)
    assert steps[True] < steps[False] - 10, steps


@pytest.mark.parametrize("overlap", [True, False])
def test_shadow_verifies_end_the_engines_back_off(overlap, monkeypatch):
    """A verify step costs two plain steps on the loop's clock: the preamble's verifies lose
    the first window and speculation is off engine-wide; the copy that follows would be
    accepted in full, and the shadow verifies end the back-off early (requests never back
    off on their own here). Less time than waiting it out, the same tokens."""
    took = {}
    cfg = SpecConfig(num_tokens=4, max_batch=8, patience=1000, min_gain=1.0)
    for shadow, engine, _ in _with_and_without_shadow(
        monkeypatch, overlap, cfg, preamble_then_copy
    ):
        now = step_clock(engine.loop, plain=1.0, verify=2.0)
        n = PREAMBLE + 120
        got, _ = drive(engine, {0: [("a", _prompt(1), 1, n)]})
        assert got["a"] == fake_tokens(1, _prompt(1), n, preamble_then_copy)
        gain = engine.scheduler.gain
        assert gain.backoffs >= 1
        assert gain.resumes == (gain.backoffs if shadow else 0) >= int(shadow)
        took[shadow] = now[0]
    assert took[True] < took[False], took


# ---- models with recurrent layers: a verify's backup and the replay -------------------------
def recurrent_engine(overlap: bool, **cfg):
    """The n-gram engine on the fake recurrent runner: each segment's state must be exactly
    its history, so a state advanced over a rejected proposal and not rolled back trips it."""
    from tandem.testing.fake_runner import FakeRecurrentRunner

    base = {
        "max_num_seqs": 8,
        "max_model_len": 4096,
        "page_size": P,
        "max_num_batched_tokens": 32,
        "speculation": SpecConfig(num_tokens=4, max_batch=8, patience=3, backoff=4),
        "state_slots": 8,
        "state_snapshots": 16,  # 8 for the prefix cache, 8 for verifies' backups
    }
    config = SchedulerConfig(**{**base, **cfg})
    runner = FakeRecurrentRunner(config.num_pages, config.page_size, token_fn=copying_token)
    return Engine(runner, config, overlap=overlap, check_invariants=True), runner


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_recurrent_verifies_roll_back_rejected_proposals_by_replay(overlap, prefix_cache):
    """Accepted runs keep the state the verify left; a rejection resumes from the state
    before the verify and replays the accepted tokens. Exact, with or without the prefix
    cache (its snapshot slots double as the backups; without it they are backups only)."""
    engine, runner = recurrent_engine(overlap, prefix_cache=prefix_cache, state_snapshots=8)
    prompt = [7, 3, 9, 1, 4, 4, 2]
    got, reasons = drive(engine, {0: [("a", prompt, 2, 120), ("b", [5, 5, 1], 9, 90)]})
    assert got["a"] == expected(2, prompt, 120) and got["b"] == expected(9, [5, 5, 1], 90)
    stats = engine.scheduler.stats
    assert 0 < stats.spec_accepted < stats.spec_proposed
    assert runner.backups_taken == stats.spec_verifies > 5
    assert 0 < runner.replays < stats.spec_verifies  # some verifies accepted everything
    assert runner.replay_snapshots == 0  # mid-output states: not for the prefix cache
    assert len(runner.launched) < 120 * 0.8
    kv = engine.scheduler.kv
    held = len(kv.tree.snapshot_refs()) if prefix_cache else 0
    assert kv.states.num_free == kv.states.num - held  # every backup given back


@pytest.mark.parametrize("overlap", [True, False])
def test_recurrent_staggered_load_with_hits_aborts_and_page_pressure_is_exact(overlap):
    arrivals, want = staggered(random.Random(5))
    engine, runner = recurrent_engine(overlap, kv_budget_tokens=48 * P, max_num_seqs=6)
    got, reasons = drive(engine, arrivals, {12: "r4", 25: "r9"})
    check_staggered(got, reasons, want)
    stats = engine.scheduler.stats
    assert stats.spec_accepted > 0 and stats.hit_tokens > 0 and runner.replays > 0
    assert engine.scheduler.kv.num_held == 0


def test_a_verify_without_a_free_backup_slot_decodes_plainly():
    """One snapshot slot, no prefix cache: while one request's verify holds it as its
    backup, the other decodes one token instead of speculating."""
    engine, runner = recurrent_engine(False, prefix_cache=False, state_snapshots=1)
    got, _ = drive(engine, {0: [("a", [7, 3, 9, 1], 2, 40), ("b", [5, 5, 1], 9, 40)]})
    assert got["a"] == expected(2, [7, 3, 9, 1], 40) and got["b"] == expected(9, [5, 5, 1], 40)
    verifies = [[s for s in p.segments if s.num_samples > 1] for p in runner.launched]
    assert max(len(v) for v in verifies) == 1  # one slot: one verify a step
    assert engine.scheduler.stats.spec_accepted > 0
