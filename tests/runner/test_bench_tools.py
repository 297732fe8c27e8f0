"""The engine benchmarks' own tools run and report what they claim: the step profiler's
phases add up to the step, and the plain-loop ceiling decodes the greedy tokens mlx-lm does."""

from __future__ import annotations

from mlx_lm.utils import load

from tandem.bench import offline, step_profile
from tests.parity.test_mlx_lm_parity import reference


def test_step_profile_phases_add_up_and_count_graph_nodes(tiny_model_dir):
    path = tiny_model_dir("llama")
    for overlap in (False, True):
        r = step_profile.profile(path, 4, 16, 12, overlap, count_nodes=not overlap)
        assert r["steady_steps"] >= 8
        parts = sum(r[k] for k in ("schedule", "build", "submit", "wait", "update", "other"))
        # Medians of parts need not sum to the median step exactly; they are close.
        assert 0.5 * r["step"] < parts < 2 * r["step"]
        assert r["tok_s"] > 0
        assert (r.get("nodes", 0) > 50) == (not overlap)


def test_plain_loop_ceiling_decodes_mlx_lms_greedy_tokens(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = [[5 + (7 * i + j) % 300 for j in range(16)] for i in range(3)]
    tokens, _ = offline.plain_decode(load(str(path))[0], prompts, 10)
    for p, t in zip(prompts, tokens, strict=True):
        assert t == reference(path, p, 10)
    assert offline.plain_loop(path, 2, 16, 8, 1, 400, prefill=True) > 0
