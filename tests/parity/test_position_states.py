"""Speculative verifies that keep the recurrent state after each of their positions
(runner/positions.py: Gated DeltaNet and Mamba-2 layers), so a rejected proposal resumes from
the state after the last accepted token instead of replaying: greedy output equals mlx-lm's
``generate_step`` and the replaying path's, no replay runs, and a model whose per-position
states would resume wrongly is caught by the load check and replays instead."""

from __future__ import annotations

import random

import pytest
from test_mlx_lm_parity import greedy, reference
from test_speculative_hybrid import SPEC, oracle

from tandem import LLM
from tandem.engine.plan import Segment
from tandem.testing.families import RECURRENT

N = 30


def _prompts() -> list[list[int]]:
    rng = random.Random(21)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(5, 30))] for _ in range(5)]


def _run(path, prompts, **kw) -> tuple[LLM, list[list[int]], list[Segment]]:
    """Greedy outputs, and every segment the runner got."""
    llm = LLM(str(path), check_invariants=True, kv_page_size=4, prefix_cache=False, **SPEC, **kw)
    runner = llm.engine.loop.runner
    segments: list[Segment] = []
    forward = runner.forward

    def recording(plan, *args):
        segments.extend(plan.segments)
        return forward(plan, *args)

    runner.forward = recording
    outs = [o.token_ids for o in llm.generate(prompts, greedy(N))]
    return llm, outs, segments


@pytest.mark.parametrize("model_type", RECURRENT)
@pytest.mark.parametrize("overlap", [True, False])
def test_rejected_proposals_resume_from_the_verify_s_states(
    family_model_dir, monkeypatch, model_type, overlap
):
    path = family_model_dir(model_type)
    prompts = _prompts()
    oracle(monkeypatch, path, prompts, seed=22)
    llm, outs, segments = _run(path, prompts, overlap=overlap)
    assert llm.engine.loop.runner.state_positions
    assert outs == [reference(path, p, N) for p in prompts]
    stats = llm.engine.scheduler.stats
    assert 0 < stats.spec_accepted < stats.spec_proposed
    verifies = [s for s in segments if s.state_positions]
    assert verifies and all(len(s.state_positions) == s.num_tokens - 1 for s in verifies)
    assert not any(s.state_backup >= 0 for s in segments)
    # No prefix cache: a segment reading another slot is a resume (one token), never a
    # replay of accepted tokens.
    resumed = [s for s in segments if s.state_src >= 0]
    assert resumed and all(s.num_tokens == 1 or s.state_positions for s in resumed)
    kv = llm.engine.scheduler.kv
    assert kv.states.num_free == kv.states.num
    assert kv.positions.num_free == kv.positions.num
    # Every id the engine freed was told to the runner with the next plan: it holds only
    # those freed since the last one (the last verifies', until the engine runs again).
    held = set(llm.engine.loop.runner.state_pool.held)
    assert held and held <= set(kv.positions.take_freed())


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2"])
def test_the_same_output_as_replaying(family_model_dir, monkeypatch, model_type):
    """Per-position states off (as for a model without them): rejected proposals replay,
    and every token is the same."""
    path = family_model_dir(model_type)
    prompts = _prompts()
    oracle(monkeypatch, path, prompts, seed=23)
    _, kept, _ = _run(path, prompts)
    monkeypatch.setattr("tandem.runner.model_runner.install_positions", lambda *a: False)
    llm, replayed, segments = _run(path, prompts)
    assert not llm.engine.scheduler.config.speculation.per_position
    assert any(s.state_backup >= 0 for s in segments)
    assert kept == replayed == [reference(path, p, N) for p in prompts]


def test_per_position_states_that_resume_wrongly_are_refused_at_load(
    family_model_dir, monkeypatch, caplog
):
    """States one position late (a layer whose per-position values are read wrongly): the
    load check resumes from them against mlx-lm, turns them off, and verifies replay."""
    from tandem.runner import positions

    per_position = positions.Capture.per_position

    def late(self, new, m):
        return per_position(self, new, m + 1)[1:]

    monkeypatch.setattr(positions.Capture, "per_position", late)
    path = family_model_dir("qwen3_next")
    prompts = _prompts()[:3]
    oracle(monkeypatch, path, prompts, seed=24)
    llm, outs, segments = _run(path, prompts)
    assert not llm.engine.loop.runner.state_positions
    assert not llm.engine.scheduler.config.speculation.per_position
    assert "per-position states it disagreed with mlx-lm" in caplog.text
    assert not any(s.state_positions for s in segments)
    assert outs == [reference(path, p, N) for p in prompts]


@pytest.mark.parametrize("model_type", ["lfm2", "kimi_linear"])
def test_other_convolution_layouts_resume_too(tmp_path, monkeypatch, model_type):
    """LFM2's layers keep only a convolution window; Kimi Linear's three (q, k, v) beside
    the gated delta state: held per position the same way."""
    from tandem.testing.model_zoo import make_zoo_model

    path = make_zoo_model(tmp_path / model_type, model_type)
    prompts = _prompts()[:3]
    oracle(monkeypatch, path, prompts, seed=25)
    llm, outs, segments = _run(path, prompts)
    assert llm.engine.scheduler.config.speculation.per_position
    assert outs == [reference(path, p, N) for p in prompts]
    assert any(s.state_positions for s in segments)
    assert not any(s.state_backup >= 0 for s in segments)
    assert any(s.state_src >= 0 for s in segments)  # resumes (no prefix cache here)


def test_a_second_model_of_the_family_gets_the_recurrence_seam_too(family_model_dir, monkeypatch):
    """The seam replaces the module's gated delta function once; a second model of that
    family in the process (a benchmark's second engine, a draft of the same family) must
    see it installed, or its load check allows for the wrong summation order."""
    from mlx_lm.utils import load

    from tandem.runner import gated_delta

    monkeypatch.setattr(gated_delta, "available", lambda: True)
    path = family_model_dir("qwen3_next")
    first, _ = load(str(path))
    second, _ = load(str(path))
    try:
        assert gated_delta.install(first) and gated_delta.install(second)
    finally:
        gated_delta._kernel_on[0] = False
