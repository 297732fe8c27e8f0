"""The dashboard's per-second points, on a fake clock."""

from __future__ import annotations

import pytest

from tandem.server.live_stats import WINDOW_S, LatencyWindow, LiveStats


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_percentiles_are_within_a_bucket_of_the_truth():
    w = LatencyWindow()
    for ms in range(1, 101):  # 1..100 ms
        w.observe(ms / 1000)
    w.roll()
    p50, p99, p100 = w.percentiles((0.5, 0.99, 1.0))
    assert 50 <= p50 <= 55 and 99 <= p99 <= 109 and 100 <= p100 <= 110
    assert LatencyWindow().percentiles((0.5,)) == [None]


def test_latency_window_forgets_after_its_seconds():
    w = LatencyWindow()
    w.observe(0.5)
    w.roll()
    for _ in range(WINDOW_S - 1):
        w.roll()
    assert w.percentiles((0.5,))[0] == pytest.approx(500, rel=0.1)
    w.roll()
    assert w.percentiles((0.5,)) == [None]


def test_points_are_rates_and_shares_of_each_second():
    clock = Clock()
    live = LiveStats(span_s=3, clock=clock)
    stats = {
        "running": 2,
        "waiting": 1,
        "kv_pages": 100,
        "kv_held_pages": 30,
        "kv_cached_pages": 5,
        "prefix_cache_queried_tokens": 0,
        "prefix_cache_hit_tokens": 0,
    }
    first = live.sample(stats)
    assert first["output_tps"] == 0 and first["prefix_hit_rate"] is None
    clock.now += 2.0
    live.generated(50)
    live.first_token(0.2)
    live.next_token(0.01)
    live.request_done()
    stats = {**stats, "prefix_cache_queried_tokens": 100, "prefix_cache_hit_tokens": 25}
    p = live.sample(stats)
    assert p["output_tps"] == 25.0 and p["finished_per_s"] == 0.5
    assert p["prefix_hit_rate"] == 0.25 and p["prefix_hit_rate_total"] == 0.25
    assert (p["running"], p["waiting"], p["kv_pages_used"], p["kv_pages_cached"]) == (2, 1, 30, 5)
    assert p["ttft_p50_ms"] == pytest.approx(200, rel=0.1)
    assert p["itl_p99_ms"] == pytest.approx(10, rel=0.1)
    assert "spec_acceptance" not in p
    # The next second: nothing looked up, so no hit rate for it; the total stays.
    clock.now += 1.0
    p = live.sample(stats)
    assert p["prefix_hit_rate"] is None and p["prefix_hit_rate_total"] == 0.25
    assert p["output_tps"] == 0
    # Only span_s points are kept; since() filters by time.
    clock.now += 1.0
    live.sample(stats)
    assert len(live.since(None)) == 3
    assert [q["t"] for q in live.since(1002.0)] == [1003.0, 1004.0]


def test_speculative_acceptance_only_when_the_engine_reports_it():
    clock = Clock()
    live = LiveStats(clock=clock)
    live.sample({"spec_proposed_tokens": 0, "spec_accepted_tokens": 0})
    clock.now += 1
    p = live.sample({"spec_proposed_tokens": 40, "spec_accepted_tokens": 30})
    assert p["spec_acceptance"] == 0.75
