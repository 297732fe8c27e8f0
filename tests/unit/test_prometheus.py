"""/metrics exposition: engine totals are counters (rate() works), current values gauges."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tandem.server.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, Metrics

STATS = {
    "running": 2,
    "waiting": 1,
    "kv_usage": 0.25,
    "kv_pages": 64,
    "kv_cached_pages": 3,
    "kv_window_pages": 40,
    "kv_window_held_pages": 7,
    "prefix_cache_queried_tokens": 400,
    "prefix_cache_hit_tokens": 100,
    "retractions": 5,
    "engine_restarts": 1,
    "step_failures": 2,
    "oom_recoveries": 1,
    "spec_proposed_tokens": 40,
    "spec_accepted_tokens": 30,
    "spec_verify_steps": 10,
    "spec_backoffs": 1,
    "spec_resumes": 1,
    "engine_steps": 300,
    "engine_step_seconds": 1.5,
    "engine_cpu_seconds": 2.25,
}


def families(text: bytes) -> dict[str, tuple[str, dict[str, float]]]:
    return {
        f.name: (f.type, {s.name: s.value for s in f.samples})
        for f in text_string_to_metric_families(text.decode())
    }


def test_engine_totals_are_counters_ending_in_total_and_current_values_are_gauges():
    got = families(Metrics().render(STATS))
    for key, (name, _) in ENGINE_COUNTERS.items():
        assert got[name] == ("counter", {f"{name}_total": STATS[key]}), name
    for key, (name, _) in ENGINE_GAUGES.items():
        assert got[name] == ("gauge", {name: STATS[key]}), name
    assert got["tandem_prefix_cache_hit_rate"] == ("gauge", {"tandem_prefix_cache_hit_rate": 0.25})


def test_every_engine_stat_is_exported_once_and_counters_follow_each_scrape():
    assert set(ENGINE_COUNTERS).isdisjoint(ENGINE_GAUGES)
    m = Metrics()
    m.render(STATS)
    later = families(m.render({**STATS, "retractions": 9}))
    assert later["tandem_num_retractions"][1] == {"tandem_num_retractions_total": 9}
    assert families(Metrics().render({}))["tandem_engine_restarts"][1] == {
        "tandem_engine_restarts_total": 0
    }


def test_mean_acceptance_length_is_accepted_per_verify_plus_one():
    got = families(Metrics().render(STATS))
    assert got["tandem_spec_mean_acceptance_length"][1] == {
        "tandem_spec_mean_acceptance_length": 4.0
    }
    off = families(Metrics().render({"running": 0}))
    assert off["tandem_spec_mean_acceptance_length"][1] == {
        "tandem_spec_mean_acceptance_length": 0.0
    }


def test_the_http_process_reports_its_own_cpu_time():
    import time

    before = time.process_time()
    got = families(Metrics().render(STATS))["tandem_http_cpu_seconds"]
    assert got[0] == "counter"
    assert got[1]["tandem_http_cpu_seconds_total"] >= before > 0
