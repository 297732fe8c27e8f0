"""Serving-benchmark arithmetic on hand-made records."""

from __future__ import annotations

import math

import pytest

from tandem.bench.serve_metrics import SLO, RequestRecord, compute, percentile


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile(list(range(101)), 99) == 99
    assert math.isnan(percentile([], 50))


def test_metrics_from_known_timings():
    # Two requests: TTFT 0.1 / 0.3 s, 5 tokens in 3 chunks, latency 0.5 / 0.7 s.
    a = RequestRecord(
        True, prompt_tokens=10, output_tokens=5, ttft=0.1, latency=0.5, chunk_times=[0.1, 0.3, 0.5]
    )
    b = RequestRecord(
        True, prompt_tokens=20, output_tokens=5, ttft=0.3, latency=0.7, chunk_times=[0.3, 0.4, 0.7]
    )
    bad = RequestRecord(False, error="HTTP 500")
    r = compute([a, b, bad], duration=2.0, slo=SLO(ttft=0.2))
    assert (r["completed"], r["failed"], r["errors"]) == (2, 1, {"HTTP 500": 1})
    assert r["request_throughput"] == 1.0
    assert r["output_throughput"] == 5.0 and r["total_token_throughput"] == 20.0
    assert r["ttft_s"]["mean"] == pytest.approx(0.2)
    assert r["tpot_s"]["median"] == pytest.approx(0.1)  # (0.5-0.1)/4 and (0.7-0.3)/4
    assert sorted(r["itl_s"].values())[0] == pytest.approx(0.2, abs=0.11)
    assert r["itl_s"]["median"] == pytest.approx(0.2)  # gaps 0.2, 0.2, 0.1, 0.3
    assert r["e2e_latency_s"]["p99"] == pytest.approx(0.698)
    assert r["goodput"] == 0.5  # only `a` meets TTFT <= 0.2 s


def test_outputs_shorter_than_requested_are_flagged():
    r = compute(
        [
            RequestRecord(
                True,
                output_tokens=3,
                expected_output_tokens=8,
                ttft=0.1,
                latency=0.2,
                chunk_times=[0.1],
            )
        ],
        duration=1.0,
    )
    assert r["outputs_with_unexpected_length"] == 1
