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


def make_engine(
    overlap: bool, host_thread: bool | None = False, **cfg
) -> tuple[Engine, FakeRunner]:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_model_len": 512, **cfg})
    runner = FakeRunner(config.num_pages, config.page_size)
    engine = Engine(
        runner,
        config,
        eos_token_ids=[EOS],
        overlap=overlap,
        check_invariants=True,
        host_thread=host_thread,
    )
    return engine, runner


def run_random_schedule(
    overlap: bool,
    seed: int,
    num_requests: int = 60,
    *,
    max_prompt: int = 40,
    host_thread: bool | None = False,
    **cfg,
):
    """Random arrivals, prompt/output lengths, stops and aborts; a third of the prompts
    extend one of a few shared prefixes and a sixth resend an earlier prompt (multi-turn
    style), so the prefix cache sees hits of every length."""
    rng = random.Random(seed)
    engine, runner = make_engine(overlap, host_thread, **cfg)
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
    assert sched.kv.num_held == 0
    sched.kv.alloc.check()
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
        assert stats.hit_tokens == 0 and on[2].scheduler.kv.tree is None


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_host_work_beside_the_submission_keeps_tokens_exact(seed, prefix_cache):
    """Every chained step with its host work on the helper thread (engine/loop.py): each
    request's tokens are exact (checked against its own sequence inside), invariants hold
    after every step with a step held back, and nothing is lost. Arrivals join a step later
    than in the plain order, so aborts land elsewhere: compare the requests both finished."""
    on = run_random_schedule(True, seed, prefix_cache=prefix_cache, host_thread=True)
    off = run_random_schedule(False, seed, prefix_cache=prefix_cache)
    loop = on[2].loop
    assert loop.num_threaded > loop.num_steps // 3, (loop.num_threaded, loop.num_steps)
    done = [r for r, why in on[1].items() if why != "abort" and off[1][r] != "abort"]
    assert len(done) > 40
    assert [on[0][r] for r in done] == [off[0][r] for r in done]


@pytest.mark.parametrize("overlap", [True, False])
def test_tiny_pool_evicts_and_retracts_hundreds_of_requests_exactly(overlap):
    """Ten pages of 16 for 300 requests with shared prefixes: cached pages are evicted all
    the time, decodes run out of pages and retract, hits share pages, and every token is
    exact."""
    tokens, _, engine = run_random_schedule(
        overlap,
        5,
        num_requests=300,
        max_num_seqs=6,
        kv_budget_tokens=10 * 16,
        max_model_len=120,
        max_prompt=30,
    )
    sched = engine.scheduler
    assert sched.kv.evicted_pages > 50 and sched.stats.hit_tokens > 0
    assert sched.stats.retractions > 0


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_decodes_outgrowing_the_pool_retract_and_resume_exactly(overlap, prefix_cache):
    """Four requests of 68 tokens need 20 pages; the pool has 12. All four start (their
    prompts fit), then the decodes' page demand retracts the latest admitted, which resume
    later and still give exact tokens."""
    engine, _ = make_engine(overlap, kv_budget_tokens=12 * 16, prefix_cache=prefix_cache)
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
    engine, _ = make_engine(True, kv_budget_tokens=64)
    with pytest.raises(ValueError, match="KV pool"):
        engine.add_request([1] * 40, SamplingParams(max_tokens=30))
    engine.add_request([1] * 30, SamplingParams(max_tokens=30))


def test_small_token_budget_chunks_long_prompts_exactly():
    run_random_schedule(True, 7, max_num_batched_tokens=5)
    run_random_schedule(False, 7, max_num_batched_tokens=5)


class PeakRunner(FakeRunner):
    """Records the most pages live requests held at any launch."""

    peak: int = 0
    sched = None

    def launch(self, plan, parent, masks=None, **kw):
        self.peak = max(self.peak, self.sched.kv.num_held)
        return super().launch(plan, parent, masks, **kw)


def test_the_pool_bounds_admission_and_is_used_to_the_full():
    """24 pages for 8 sequences of up to ~70 tokens: the pool, not max_num_seqs, limits
    what runs. Tokens stay exact (an over-committed page would corrupt them), pages held
    never pass the pool, and the pool is really full at the peak."""
    config = SchedulerConfig(max_num_seqs=8, max_model_len=512, kv_budget_tokens=24 * 16)
    runner = PeakRunner(config.num_pages, config.page_size)
    engine = Engine(runner, config, eos_token_ids=[EOS], check_invariants=True)
    runner.sched = engine.scheduler
    rng = random.Random(3)
    specs = []
    for i in range(40):
        prompt = [rng.randrange(0, 900) for _ in range(rng.randint(20, 40))]
        params = SamplingParams(max_tokens=rng.randint(10, 30), seed=i, ignore_eos=True)
        specs.append((f"r{i}", prompt, params))
        engine.add_request(prompt, params, f"r{i}")
    got: dict[str, list[int]] = {rid: [] for rid, _, _ in specs}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            got[out.request_id] += out.new_token_ids
        engine.check_invariants()
    for rid, prompt, params in specs:
        assert got[rid] == expected_tokens(int(rid[1:]), prompt, params)[0], rid
    assert 21 <= runner.peak <= 24


def test_every_step_after_the_first_is_chained_and_advances_by_one():
    engine, runner = make_engine(True)
    for i in range(4):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True, seed=i))
    while engine.has_unfinished():
        engine.step()
    assert all(p.chained for p in runner.launched[1:])
    # Each chained step's lazy segments continue right after the parent's.
    for prev, plan in zip(runner.launched, runner.launched[1:], strict=False):
        ends = {s.request_id: s.end for s in prev.segments}
        for seg in plan.segments:
            assert seg.lazy and seg.start == ends[seg.request_id]
            assert prev.sample_request_ids[seg.parent_row] == seg.request_id


def test_arrivals_join_chained_steps_beside_lazy_decodes():
    """Steady arrivals: new prompts' chunks ride in steps chained on the in-flight one,
    next to decodes fed by its lazy tokens (no pipeline drain per arrival)."""
    engine, runner = make_engine(True, max_num_batched_tokens=32)
    want, got = {}, {}
    for i in range(12):
        prompt = [i + 1] * (5 + 7 * i)
        params = SamplingParams(max_tokens=25, ignore_eos=True, seed=i)
        engine.add_request(prompt, params, f"a{i}")
        want[f"a{i}"], got[f"a{i}"] = expected_tokens(i, prompt, params)[0], []
        for _ in range(3):
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
            engine.check_invariants()
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    mixed = [
        p
        for p in runner.launched
        if p.chained
        and any(s.lazy for s in p.segments)
        and any(s.num_tokens > 1 for s in p.segments)
    ]
    assert len(mixed) >= 10
    assert sum(not p.chained for p in runner.launched) <= 2
    assert got == want


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
    assert runner.launched[0].segments[0].num_tokens == 64  # nothing decodes: whole budget
    while engine.scheduler.running["a"].status.name != "DECODE":
        engine.step()
    engine.add_request([2] * 100, SamplingParams(max_tokens=5, ignore_eos=True), "b")
    before = len(runner.launched)
    while engine.has_unfinished():
        engine.step()
    later = [
        s.num_tokens
        for p in runner.launched[before:]
        for s in p.segments
        if s.request_id == "b" and s.start < 100
    ]
    assert later and max(later) <= 8 and sum(later) == 100


def test_one_request_takes_at_most_its_chunk_of_a_step_the_rest_go_to_others():
    engine, runner = make_engine(True, max_num_batched_tokens=64, max_prefill_chunk=24)
    prompts = {"long": list(range(1, 51)), **{f"short{i}": [7, i] * 10 for i in range(3)}}
    params = {
        rid: SamplingParams(max_tokens=3, ignore_eos=True, seed=i) for i, rid in enumerate(prompts)
    }
    for rid, prompt in prompts.items():
        engine.add_request(prompt, params[rid], rid)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    first = {s.request_id: s.num_tokens for s in runner.launched[0].segments}
    # 24 + 20 + 20 = 64: the long prompt's chunk is capped, the budget goes on to the others
    assert first == {"long": 24, "short0": 20, "short1": 20}
    chunks = [s.num_tokens for p in runner.launched for s in p.segments if s.request_id == "long"]
    assert chunks[:3] == [24, 24, 2]
    for i, (rid, prompt) in enumerate(prompts.items()):
        assert tokens[rid] == expected_tokens(i, prompt, params[rid])[0], rid


def test_random_schedules_with_a_prefill_chunk_cap_stay_exact():
    run_random_schedule(True, 11, max_num_batched_tokens=24, max_prefill_chunk=7)


def test_a_queue_blocked_on_sequences_does_not_break_chains():
    engine, runner = make_engine(True, max_num_seqs=4)
    for i in range(5):
        engine.add_request([1, 2, i], SamplingParams(max_tokens=40, ignore_eos=True, seed=i))
    for _ in range(30):
        engine.step()
    assert len(engine.scheduler.waiting) == 1  # the fifth waits for a slot...
    assert sum(p.chained for p in runner.launched[-20:]) >= 15  # ...without stopping chains
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()


def test_automatic_host_thread_follows_who_sets_the_pace():
    """host_thread=None: the loop hands its host work to the helper only while finalizes
    find their steps done and that work is worth a hand-over; a device that sets the pace
    again (long waits) turns it back, with a back-off; exact tokens throughout."""
    from tandem.engine import loop as loop_mod

    now = [0.0]
    engine, runner = make_engine(True, host_thread=None, max_num_seqs=8)
    runner.host_thread_auto = True  # (a GPU runner's; the CPU's and the fake's are False)
    loop = engine.loop
    loop.clock = lambda: now[0]
    cost = {"finalize": 0.0, "update": 0.0}
    real_finalize, real_update = runner.finalize, engine.scheduler.update

    def finalize(handle):
        now[0] += cost["finalize"]
        return real_finalize(handle)

    def update(plan, result):
        now[0] += cost["update"]
        return real_update(plan, result)

    runner.finalize, engine.scheduler.update = finalize, update
    params = [SamplingParams(max_tokens=400, seed=i, ignore_eos=True) for i in range(8)]
    prompts = {f"r{i}": [3 + i, 40, 7 * i % 50 + 1] for i in range(8)}
    for (rid, prompt), p in zip(prompts.items(), params, strict=True):
        engine.add_request(prompt, p, rid)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}

    def run(steps: int) -> int:
        before = loop.num_threaded
        for _ in range(steps):
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
            engine.check_invariants()
        return loop.num_threaded - before

    assert run(30) == 0  # host work too small to be worth a thread
    cost["update"] = 2 * loop_mod.HOST_WORK_MIN
    runner.host_thread_auto = False
    assert run(30) == 0  # a runner whose device shares the host's cores
    runner.host_thread_auto = True
    assert run(30) > 20  # the host sets the pace, with work to hide
    cost["finalize"] = 4 * cost["update"]  # now the device does
    assert run(30) <= 1
    cost["finalize"] = 0.0
    assert run(loop_mod.HOST_BACKOFF_STEPS // 2) == 0  # backing off
    assert run(2 * loop_mod.HOST_BACKOFF_STEPS) > 0
    while engine.has_unfinished():
        run(1)
    for i, (rid, prompt) in enumerate(prompts.items()):
        assert (got[rid], "length") == expected_tokens(i, prompt, params[i]), rid


def test_drain_with_a_step_held_back():
    """A pause drains the loop (core_process): with host_thread a step may be held back
    unsubmitted; drain submits and finalizes it, nothing is lost, and the engine resumes."""
    engine, runner = make_engine(True, host_thread=True)
    params = [SamplingParams(max_tokens=40, seed=i, ignore_eos=True) for i in range(6)]
    prompts = [[5 + i, 9, 14] * (i + 1) for i in range(6)]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, f"r{i}")
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(6)}
    held = 0
    for k in range(60):
        outs = engine.step()
        if k % 7 == 6:
            held += engine.loop.pending is not None
            outs += engine.loop.drain()
            assert engine.loop.pending is None and engine.loop.curr is None
            engine.check_invariants()
        for out in outs:
            got[out.request_id] += out.new_token_ids
        if not engine.has_unfinished():
            break
    assert held > 0 and not engine.has_unfinished()
    for i, prompt in enumerate(prompts):
        assert (got[f"r{i}"], "length") == expected_tokens(i, prompt, params[i])


def test_a_failure_in_the_helpers_update_fails_that_steps_requests():
    """host_thread=True: ``Scheduler.update`` raising on the helper thread is attributed to
    the step it was applying (exactly its unfinished requests fail with the error); the
    others resume token-exact and the engine keeps serving."""
    import threading

    engine, runner = make_engine(True, host_thread=True)
    sched = engine.scheduler
    params = [SamplingParams(max_tokens=12 + 4 * i, seed=i, ignore_eos=True) for i in range(6)]
    prompts = [[9 + i, 4, 2] * 3 for i in range(6)]
    real, calls, blamed = sched.update, [0], set()

    def update(plan, result):
        calls[0] += 1
        if calls[0] == 6:
            assert threading.current_thread().name.startswith("tandem-host")
            blamed.update(r for r in plan.request_ids if not sched.running[r].finished)
            raise ValueError("update exploded")
        return real(plan, result)

    sched.update = update
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(6)}
    ends: dict[str, object] = {}
    step = 0
    while step < 18 or engine.has_unfinished():
        if step < 18 and step % 3 == 0:  # staggered: the failing step holds some of them
            i = step // 3
            engine.add_request(prompts[i], params[i], f"r{i}")
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finish_reason:
                ends[out.request_id] = out
        engine.check_invariants()
        step += 1
    failed = {r for r, o in ends.items() if o.finish_reason == "error"}
    assert failed == blamed and 0 < len(failed) < 6
    assert all("update exploded" in ends[r].error for r in failed)
    for i, prompt in enumerate(prompts):
        if f"r{i}" not in failed:
            assert (got[f"r{i}"], "length") == expected_tokens(i, prompt, params[i])
    del sched.update
    engine.add_request([1, 2, 3], params[0], "after")
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert (out, "length") == expected_tokens(0, [1, 2, 3], params[0])


@pytest.mark.parametrize("overlap", [False, True])
def test_close_mid_run_aborts_everything_and_frees_the_runner(overlap):
    """``Engine.close`` with steps in flight (one may be held back by the host thread): they are
    finalized before the runner lets go of its memory, every unfinished request ends
    "abort", and nothing is accepted after."""
    engine, runner = make_engine(overlap, host_thread=True, max_num_seqs=4)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    for i in range(6):  # (two wait for a sequence)
        engine.add_request([5 + i, 9, 14] * (i + 1), sp, f"r{i}")
    ended: dict[str, str] = {}
    for _ in range(12):
        ended.update((o.request_id, o.finish_reason) for o in engine.step() if o.finished)
    assert not ended and engine.loop.inflight and engine.scheduler.waiting
    ended.update((o.request_id, o.finish_reason) for o in engine.close() if o.finished)
    assert ended == {f"r{i}": "abort" for i in range(6)}
    assert runner.closed and not engine.has_unfinished()
    with pytest.raises(RuntimeError, match="closed"):
        engine.add_request([1, 2], sp)
