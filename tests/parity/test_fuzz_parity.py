"""CI-sized fuzzed schedule parity (tandem/testing/fuzz_parity.py has the long run)."""

from __future__ import annotations

import pytest

from tandem.testing.fuzz_parity import run


@pytest.mark.parametrize(("overlap", "seed", "n"), [(True, 1, 200), (False, 2, 100)])
def test_fuzzed_schedule_is_token_exact_with_mlx_lm(tiny_model_dir, overlap, seed, n):
    report = run(str(tiny_model_dir("qwen3")), n, seed, overlap=overlap)
    assert report.mismatches == []
    assert report.aborted > 0 and report.stopped_early > 0 and report.hit_tokens > 0
    assert report.evictions > 0
