"""The real scheduler and overlap loop driven by a fake runner (no MLX)."""

from __future__ import annotations

import random

import pytest

from tandem.engine.engine import Engine
from tandem.engine.scheduler import SchedulerConfig
from tandem.sampling_params import SamplingParams
from tandem.testing.fake_runner import FakeRunner, fake_token

EOS = 999


def expected_tokens(seed: int, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    seq = list(prompt)
    out: list[int] = []
    for _ in range(params.max_tokens):
        tok = fake_token(seed, seq)
        out.append(tok)
        seq.append(tok)
        if tok in params.stop_token_ids or (tok == EOS and not params.ignore_eos):
            return out, "stop"
    return out, "length"


def make_engine(overlap: bool, **cfg) -> tuple[Engine, FakeRunner]:
    runner = FakeRunner()
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_model_len": 512, **cfg})
    engine = Engine(runner, config, eos_token_ids=[EOS], overlap=overlap, check_invariants=True)
    return engine, runner


def run_random_schedule(
    overlap: bool, seed: int, num_requests: int = 60, *, max_prompt: int = 40, **cfg
):
    """Random arrivals, prompt/output lengths, stops and aborts; a third of the prompts
    extend one of a few shared prefixes and a sixth resend an earlier prompt (multi-turn
    style), so the prefix cache sees hits of every length."""
    rng = random.Random(seed)
    engine, runner = make_engine(overlap, **cfg)
    arrivals = sorted(rng.randrange(0, 200) for _ in range(num_requests))
    prefixes = [[rng.randrange(0, 900) for _ in range(rng.randint(1, 60))] for _ in range(3)]
    specs = []
    for i, step in enumerate(arrivals):
        prompt = [rng.randrange(0, 900) for _ in range(rng.randint(1, max_prompt))]
        u = rng.random()
        if u < 0.33:
            prompt = rng.choice(prefixes) + prompt[: rng.randint(0, 10)]
        elif u < 0.5 and specs:
            prompt = rng.choice(specs)[2] + prompt[: rng.randint(0, 5)]
        stop = tuple(rng.sample(range(1000), 30)) if rng.random() < 0.3 else ()
        params = SamplingParams(
            max_tokens=rng.randint(1, 30),
            seed=i,
            stop_token_ids=stop,
            ignore_eos=rng.random() < 0.5,
        )
        abort_at = step + rng.randint(0, 20) if rng.random() < 0.15 else None
        specs.append((step, f"r{i}", prompt, params, abort_at))
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    aborted: set[str] = set()
    step = 0
    while step < 400 or engine.has_unfinished():
        for s, rid, prompt, params, _ in specs:
            if s == step:
                engine.add_request(prompt, params, rid)
                tokens[rid] = []
        for _, rid, _, _, abort_at in specs:
            if abort_at == step and rid not in reasons and engine.abort(rid):
                aborted.add(rid)
        for out in engine.step():
            assert out.request_id not in reasons, "output after finish"
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
        engine.check_invariants()
        step += 1
        assert step < 5000
    for _, rid, prompt, params, _ in specs:
        want, reason = expected_tokens(int(rid[1:]), prompt, params)
        if rid in aborted:
            assert reasons[rid] == "abort"
            assert tokens[rid] == want[: len(tokens[rid])]
        else:
            assert (tokens[rid], reasons[rid]) == (want, reason), rid
    sched = engine.scheduler
    assert not sched.running and not sched.waiting
    assert sched.rows.num_free + len(sched.rows.cached) == sched.rows.num_rows
    assert set(sched.tree.row_tail) == sched.rows.cached
    return tokens, reasons, engine


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_random_schedules_give_exact_tokens_and_keep_invariants(seed, prefix_cache):
    on = run_random_schedule(True, seed, prefix_cache=prefix_cache)
    off = run_random_schedule(False, seed, prefix_cache=prefix_cache)
    assert on[1] == off[1]
    # An abort lands after a number of tokens that depends on the steps in flight.
    done = [rid for rid, reason in on[1].items() if reason != "abort"]
    assert [on[0][r] for r in done] == [off[0][r] for r in done]
    assert on[2].loop.num_chained > 0
    assert off[2].loop.num_chained == 0
    stats = on[2].scheduler.stats
    if prefix_cache:
        assert stats.hit_tokens > 0
    else:
        assert stats.hit_tokens == 0 and not on[2].scheduler.tree.row_tail


@pytest.mark.parametrize("overlap", [True, False])
def test_tiny_pool_evicts_and_retracts_hundreds_of_requests_exactly(overlap):
    """A pool of a few small rows for 300 requests with shared prefixes: cached rows are
    evicted all the time, hits are served in place and by copy, and every token is exact."""
    tokens, _, engine = run_random_schedule(
        overlap,
        5,
        num_requests=300,
        max_num_seqs=6,
        capacity_chunk=16,
        row_chunk=1,
        kv_budget_tokens=8 * 16 * 4,
        max_model_len=120,
        max_prompt=30,
    )
    stats = engine.scheduler.stats
    assert stats.evictions > 50 and stats.hit_tokens > 0
    assert stats.copied_tokens > 0 and stats.copied_tokens < stats.hit_tokens


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_growth_past_the_budget_retracts_and_resumes_exactly(overlap, prefix_cache):
    """Four rows of 32 positions fit the budget; as the requests grow the pool can hold
    fewer rows, so the top ones are retracted, resumed later, and still give exact tokens."""
    engine, _ = make_engine(
        overlap,
        capacity_chunk=16,
        row_chunk=1,
        kv_budget_tokens=4 * 32,
        prefix_cache=prefix_cache,
    )
    prompts = {f"r{i}": [i + 1] * 8 for i in range(4)}
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(prompt, SamplingParams(max_tokens=60, ignore_eos=True, seed=7), rid)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    max_running = 0
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        engine.check_invariants()
        max_running = max(max_running, len(engine.scheduler.running))
    assert max_running == 4
    assert engine.scheduler.stats.retractions >= 2
    for rid, prompt in prompts.items():
        assert got[rid] == expected_tokens(7, prompt, params)[0], rid


def test_request_that_can_never_fit_is_rejected_at_admission():
    engine, _ = make_engine(True, capacity_chunk=16, row_chunk=1, kv_budget_tokens=64)
    with pytest.raises(ValueError, match="KV budget"):
        engine.add_request([1] * 40, SamplingParams(max_tokens=30))
    engine.add_request([1] * 30, SamplingParams(max_tokens=30))


def test_small_token_budget_chunks_long_prompts_exactly():
    run_random_schedule(True, 7, max_num_batched_tokens=5)
    run_random_schedule(False, 7, max_num_batched_tokens=5)


def test_kv_budget_bounds_admission():
    tokens, _, engine = run_random_schedule(True, 11, kv_budget_tokens=2 * 256, row_chunk=1)
    assert tokens


def test_chain_keeps_two_steps_in_flight_for_pure_decode():
    engine, runner = make_engine(True)
    for i in range(4):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True, seed=i))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    chained = [p for p in runner.launched if p.chained]
    assert len(chained) >= 15
    # Every chained step advanced each live row by exactly one over its parent.
    for prev, plan in zip(runner.launched, runner.launched[1:], strict=False):
        if plan.chained:
            assert plan.positions == tuple(
                p + 1 if rid is not None else p
                for p, rid in zip(prev.positions, prev.row_request_ids, strict=True)
            )


def test_no_step_is_wasted_past_max_tokens():
    engine, runner = make_engine(True)
    engine.add_request([5], SamplingParams(max_tokens=6, ignore_eos=True, seed=1))
    while engine.has_unfinished():
        engine.step()
    assert len(runner.launched) == 6


def test_request_finishing_mid_chain_releases_late():
    engine, runner = make_engine(True)
    seed = 3
    want, _ = expected_tokens(seed, [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    stop_tok = want[4]  # fifth output token
    engine.add_request(
        [1, 2, 3], SamplingParams(max_tokens=50, seed=seed, stop_token_ids=(stop_tok,))
    )
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, seed=4, ignore_eos=True))
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.check_invariants()
    assert got["req-0"][-1] == stop_tok and len(got["req-0"]) <= 5
    assert len(got["req-1"]) == 50


def test_prompt_over_context_is_rejected_with_both_numbers():
    engine, _ = make_engine(True, max_model_len=64)
    with pytest.raises(ValueError, match="60.*10.*64"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=10))


def test_empty_prompt_is_rejected():
    engine, _ = make_engine(True)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([], SamplingParams())


def test_abort_of_waiting_request_reports_abort():
    engine, _ = make_engine(True, max_num_seqs=1)
    engine.add_request([1], SamplingParams(max_tokens=5, ignore_eos=True), "a")
    engine.add_request([1], SamplingParams(max_tokens=5, ignore_eos=True), "b")
    engine.step()
    assert engine.abort("b")
    reasons = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
    assert reasons == {"a": "length", "b": "abort"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -3),
        ("seed", -1),
        ("stop_token_ids", (-1,)),
        ("temperature", float("nan")),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_prefill_chunks_shrink_while_streams_decode():
    engine, runner = make_engine(True, max_num_batched_tokens=64, prefill_chunk_while_decoding=8)
    engine.add_request([1] * 100, SamplingParams(max_tokens=40, ignore_eos=True), "a")
    engine.step()
    first = [len(c.token_ids) for p in runner.launched for c in p.chunks]
    assert first[0] == 64  # nothing decodes yet: the whole budget
    while engine.scheduler.running["a"].status.name != "DECODE":
        engine.step()
    engine.add_request([2] * 100, SamplingParams(max_tokens=5, ignore_eos=True), "b")
    before = len(runner.launched)
    while engine.has_unfinished():
        engine.step()
    later = [len(c.token_ids) for p in runner.launched[before:] for c in p.chunks]
    assert later and max(later) <= 8 and sum(later) == 99


def test_copy_source_is_not_evicted_by_a_later_admission_in_the_same_step():
    """A hits a cached row (copied: it sits above the batch); B's admission then needs a
    bigger capacity and evicts top cached rows, which must not include A's copy source."""
    engine, _ = make_engine(
        False,
        max_num_seqs=4,
        num_rows=4,
        max_model_len=64,
        capacity_chunk=16,
        row_chunk=1,
        kv_budget_tokens=160,
    )
    prompts = {i: [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4] for i in range(4)}
    for i, p in prompts.items():
        engine.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True, seed=i), f"w{i}")
    while engine.has_unfinished():
        engine.step()
    a = prompts[3] + [500, 501]
    b = list(range(100, 130))
    engine.add_request(a, SamplingParams(max_tokens=2, ignore_eos=True, seed=9), "A")
    engine.add_request(b, SamplingParams(max_tokens=10, ignore_eos=True, seed=8), "B")
    got: dict[str, list[int]] = {"A": [], "B": []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        engine.check_invariants()
    assert got["A"] == expected_tokens(9, a, SamplingParams(max_tokens=2))[0]
    assert got["B"] == expected_tokens(8, b, SamplingParams(max_tokens=10))[0]


def test_a_queue_blocked_on_rows_does_not_break_chains():
    engine, runner = make_engine(True, max_num_seqs=4)
    for i in range(5):
        engine.add_request([1, 2, i], SamplingParams(max_tokens=40, ignore_eos=True, seed=i))
    for _ in range(30):
        engine.step()
    assert len(engine.scheduler.waiting) == 1  # the fifth waits for a row...
    assert sum(p.chained for p in runner.launched[-20:]) >= 15  # ...without stopping chains
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()


def test_a_cached_row_at_full_capacity_inside_the_batch_does_not_stop_chains():
    engine, runner = make_engine(True, max_num_seqs=4, capacity_chunk=16, row_chunk=1)
    # Q fills its whole capacity and leaves a cached row at length capacity - 1 at row 0.
    engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=8, ignore_eos=True), "q")
    engine.add_request([7, 7], SamplingParams(max_tokens=12, ignore_eos=True), "b")
    while "q" in engine.scheduler.running:
        engine.step()
    before = len(runner.launched)
    while engine.has_unfinished():
        engine.step()
    assert sum(p.chained for p in runner.launched[before:]) >= 2


def test_cached_row_in_the_way_is_evicted_when_moving_it_would_overflow_the_budget():
    engine, _ = make_engine(
        True,
        max_num_seqs=4,
        num_rows=8,
        max_model_len=128,
        capacity_chunk=16,
        row_chunk=1,
        kv_budget_tokens=3 * 128,
    )
    engine.add_request([1] * 8, SamplingParams(max_tokens=3, ignore_eos=True), "A")
    engine.add_request([2] * 8, SamplingParams(max_tokens=3, ignore_eos=True), "X")
    engine.add_request([3] * 100, SamplingParams(max_tokens=20, ignore_eos=True), "B")
    sched = engine.scheduler
    for _ in range(6):
        engine.step()
    assert sched.rows.cached == {0, 1} and sched.running["B"].row == 2
    engine.add_request([4] * 8, SamplingParams(max_tokens=3, ignore_eos=True), "N")
    engine.step()
    engine.step()
    assert all(r.request_id != "N" for r in sched.waiting)  # not stuck behind B
    assert "B" in sched.running
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
