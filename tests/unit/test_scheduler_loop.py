"""The real scheduler and overlap loop driven by a fake runner (no MLX)."""

from __future__ import annotations

import random

import pytest

from tandem.engine.engine import Engine
from tandem.engine.scheduler import SchedulerConfig
from tandem.sampling_params import SamplingParams
from tandem.testing.fake_runner import FakeRunner, fake_token

EOS = 999


def expected_tokens(seed: int, prompt_len: int, params: SamplingParams) -> tuple[list[int], str]:
    out: list[int] = []
    for i in range(params.max_tokens):
        tok = fake_token(seed, prompt_len - 1 + i)
        out.append(tok)
        if tok in params.stop_token_ids or (tok == EOS and not params.ignore_eos):
            return out, "stop"
    return out, "length"


def make_engine(overlap: bool, **cfg) -> tuple[Engine, FakeRunner]:
    runner = FakeRunner()
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_model_len": 512, **cfg})
    engine = Engine(runner, config, eos_token_ids=[EOS], overlap=overlap, check_invariants=True)
    return engine, runner


def run_random_schedule(overlap: bool, seed: int, num_requests: int = 60, **cfg):
    rng = random.Random(seed)
    engine, runner = make_engine(overlap, **cfg)
    arrivals = sorted(rng.randrange(0, 200) for _ in range(num_requests))
    specs = []
    for i, step in enumerate(arrivals):
        prompt = [rng.randrange(0, 900) for _ in range(rng.randint(1, 40))]
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
        want, reason = expected_tokens(int(rid[1:]), len(prompt), params)
        if rid in aborted:
            assert reasons[rid] == "abort"
            assert tokens[rid] == want[: len(tokens[rid])]
        else:
            assert (tokens[rid], reasons[rid]) == (want, reason), rid
    assert engine.scheduler.rows.num_free == engine.scheduler.config.max_num_seqs
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return tokens, reasons, engine


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_schedules_give_exact_tokens_and_keep_invariants(seed):
    on = run_random_schedule(True, seed)
    off = run_random_schedule(False, seed)
    assert on[0] == off[0] and on[1] == off[1]
    assert on[2].loop.num_chained > 0
    assert off[2].loop.num_chained == 0


def test_small_token_budget_chunks_long_prompts_exactly():
    run_random_schedule(True, 7, max_num_batched_tokens=5)
    run_random_schedule(False, 7, max_num_batched_tokens=5)


def test_kv_budget_bounds_admission():
    tokens, _, engine = run_random_schedule(True, 11, kv_budget_tokens=2 * 256)
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
    # Every chained step advanced positions by exactly one over its parent.
    for prev, plan in zip(runner.launched, runner.launched[1:], strict=False):
        if plan.chained:
            assert plan.positions == tuple(p + 1 for p in prev.positions)


def test_no_step_is_wasted_past_max_tokens():
    engine, runner = make_engine(True)
    engine.add_request([5], SamplingParams(max_tokens=6, ignore_eos=True, seed=1))
    while engine.has_unfinished():
        engine.step()
    assert len(runner.launched) == 6


def test_request_finishing_mid_chain_releases_late():
    engine, runner = make_engine(True)
    seed = 3
    stop_tok = fake_token(seed, 2 + 4)  # fifth output token
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
