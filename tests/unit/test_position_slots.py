"""Verifies of a model with recurrent layers that keep the state after each position
(engine/state_slots.py's PositionSlots, runner/positions.py), on the fake recurrent runner:
it holds each id's state outside the pool until a plan releases the id, and trips on a read
of an id that holds nothing, so a rejected proposal must resume from exactly the state after
its last accepted token, and no id may be released early, twice, or never."""

from __future__ import annotations

import random

import pytest
from test_pages import Faults
from test_speculation import P, check_staggered, drive, expected, staggered

from tandem.engine.engine import Engine
from tandem.engine.scheduler import SchedulerConfig
from tandem.engine.speculation import SpecConfig
from tandem.testing.fake_runner import FakeRecurrentRunner, copying_token

K = 4


def engine_for(overlap: bool, **cfg) -> tuple[Engine, FakeRecurrentRunner]:
    base = {
        "max_num_seqs": 8,
        "max_model_len": 4096,
        "page_size": P,
        "max_num_batched_tokens": 32,
        "speculation": SpecConfig(
            num_tokens=K, max_batch=8, patience=3, backoff=4, per_position=True
        ),
        "state_slots": 8,
        "state_snapshots": 16,
        "state_positions": (K + 1) * 8,
    }
    config = SchedulerConfig(**{**base, **cfg})
    runner = FakeRecurrentRunner(config.num_pages, config.page_size, token_fn=copying_token)
    return Engine(runner, config, overlap=overlap, check_invariants=True), runner


def all_given_back(engine: Engine, runner: FakeRecurrentRunner) -> None:
    kv = engine.scheduler.kv
    assert kv.positions.num_free == kv.positions.num
    # The runner holds only what was freed since the last plan.
    assert set(runner.held) <= set(kv.positions.take_freed())


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_rejected_proposals_resume_from_the_state_after_the_last_accepted_token(
    overlap, prefix_cache
):
    engine, runner = engine_for(overlap, prefix_cache=prefix_cache)
    prompt = [7, 3, 9, 1, 4, 4, 2]
    got, _ = drive(engine, {0: [("a", prompt, 2, 120), ("b", [5, 5, 1], 9, 90)]})
    assert got["a"] == expected(2, prompt, 120) and got["b"] == expected(9, [5, 5, 1], 90)
    stats = engine.scheduler.stats
    assert 0 < stats.spec_accepted < stats.spec_proposed
    assert runner.backups_taken == runner.replays == 0
    assert 0 < runner.resumes < stats.spec_verifies  # some verifies accepted everything
    assert len(runner.launched) < 120 * 0.8
    all_given_back(engine, runner)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("ids", [3, (K + 1) * 8])
def test_staggered_load_with_hits_aborts_and_page_pressure_is_exact(overlap, ids):
    """With 3 ids a verify gets fewer than K (its proposal is cut to them) or none (it
    decodes plainly)."""
    arrivals, want = staggered(random.Random(5))
    engine, runner = engine_for(
        overlap, kv_budget_tokens=48 * P, max_num_seqs=6, state_positions=ids
    )
    got, reasons = drive(engine, arrivals, {12: "r4", 25: "r9", 31: "r2"})
    check_staggered(got, reasons, want)
    stats = engine.scheduler.stats
    assert stats.spec_accepted > 0 and stats.hit_tokens > 0 and runner.resumes > 0
    assert engine.scheduler.kv.num_held == 0
    all_given_back(engine, runner)


@pytest.mark.parametrize("phase", ["launch", "finalize"])
@pytest.mark.parametrize("overlap", [True, False])
def test_failed_steps_retract_and_resume_exact(phase, overlap):
    """A step out of memory loses every held state (the runner resets): every id is free
    again and the retracted requests come out token-exact."""
    arrivals, want = staggered(random.Random(8))
    engine, runner = engine_for(overlap, kv_budget_tokens=48 * P, max_num_seqs=6)
    runner.fault = Faults({7, 19, 33}, phase, RuntimeError("[malloc] out of memory"))
    got, reasons = drive(engine, arrivals)
    check_staggered(got, reasons, want)
    assert runner.fault.hits == 3 and runner.resumes > 0
    all_given_back(engine, runner)
