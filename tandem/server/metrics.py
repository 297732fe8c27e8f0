"""Prometheus metrics of the HTTP process (one registry per app)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from tandem.server.live_stats import LiveStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# Engine stats that are current values: stats key -> (metric name, help).
ENGINE_GAUGES = {
    "running": ("tandem_num_requests_running", "Requests owning KV"),
    "waiting": ("tandem_num_requests_waiting", "Queued requests"),
    "kv_usage": (
        "tandem_kv_cache_usage_ratio",
        "Share of the KV budget held by live requests (cached prefixes not counted)",
    ),
    "kv_pages": ("tandem_kv_pages", "Pages in the KV pool"),
    "kv_cached_pages": ("tandem_kv_cached_pages", "KV pages only the prefix cache holds"),
    "kv_window_pages": (
        "tandem_kv_window_pages",
        "Pages of the sliding-window layers' own group, freed behind the window (0: none)",
    ),
    "kv_window_held_pages": (
        "tandem_kv_window_held_pages",
        "Sliding-window group pages live requests hold",
    ),
}

# Engine stats that only grow (totals since the engine started): exported as counters, so
# rate() works; the exposition adds "_total" to each name.
ENGINE_COUNTERS = {
    "prefix_cache_queried_tokens": (
        "tandem_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache",
    ),
    "prefix_cache_hit_tokens": (
        "tandem_prefix_cache_hit_tokens",
        "Prompt tokens served from the prefix cache",
    ),
    "retractions": (
        "tandem_num_retractions",
        "Requests retracted (preempted) to fit the KV budget",
    ),
    "engine_restarts": (
        "tandem_engine_restarts",
        "Engine processes restarted after one died",
    ),
    "step_failures": (
        "tandem_engine_step_failures",
        "Engine steps that raised; their requests were retried or failed",
    ),
    "spec_proposed_tokens": (
        "tandem_spec_proposed_tokens",
        "Speculative tokens proposed and verified",
    ),
    "spec_accepted_tokens": (
        "tandem_spec_accepted_tokens",
        "Speculative tokens accepted",
    ),
    "spec_verify_steps": (
        "tandem_spec_verify_steps",
        "Verify segments (each yields its accepted tokens plus one)",
    ),
    "spec_backoffs": (
        "tandem_spec_backoffs",
        "Times speculation turned itself off for a while: its steps emitted fewer tokens per "
        "second than plain decoding's at the same batch",
    ),
    "spec_resumes": (
        "tandem_spec_resumes",
        "Times speculation came back before its back-off ran out: proposals made meanwhile "
        "would have been accepted enough to pay",
    ),
    "oom_recoveries": (
        "tandem_engine_oom_recoveries",
        "Steps that ran out of device memory and were retried smaller",
    ),
    "engine_steps": ("tandem_engine_steps", "Engine steps run"),
    "engine_step_seconds": (
        "tandem_engine_step_seconds",
        "Wall time inside engine steps (over tandem_engine_steps: the mean step time)",
    ),
    "engine_cpu_seconds": (
        "tandem_engine_cpu_seconds",
        "CPU time of the engine process (all threads)",
    ),
}


class EngineTotals(Collector):
    """The engine's running totals as counters. The engine keeps them, so they are read at
    each scrape (``stats``, set by ``Metrics.render``), not counted here; beside them this
    process's own CPU time. The engine's counters restart from zero with a restarted engine (rate()
    treats that as a counter reset); its CPU time includes loading the model."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=self.stats.get(key, 0))
        # This process's own CPU (HTTP, tokenizing, detokenizing), beside the engine's.
        yield CounterMetricFamily(
            "tandem_http_cpu_seconds",
            "CPU time of the HTTP process (all threads)",
            value=time.process_time(),
        )


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "tandem_requests", "Finished requests", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "tandem_inter_token_latency_seconds",
            "Time between outputs",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds",
            "End-to-end latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Engine stats mirrored one to one: gauges for current values, counters for totals.
        self.engine = {
            key: Gauge(name, doc, registry=r) for key, (name, doc) in ENGINE_GAUGES.items()
        }
        self.engine_totals = EngineTotals()
        r.register(self.engine_totals)
        self.prefix_hit_rate = Gauge(
            "tandem_prefix_cache_hit_rate",
            "Share of prompt tokens served from the prefix cache (since start)",
            registry=r,
        )

        self.spec_mean_length = Gauge(
            "tandem_spec_mean_acceptance_length",
            "Tokens a verify yields on average (accepted + 1; 0 before any verify)",
            registry=r,
        )
        self.live = LiveStats()  # the dashboard's per-second history

    def token_arrived(self, seconds: float, *, first: bool) -> None:
        """A request's output advanced ``seconds`` after its start (first) or last output."""
        (self.ttft if first else self.itl).observe(seconds)
        (self.live.first_token if first else self.live.next_token)(seconds)

    def generated(self, n: int) -> None:
        self.generation_tokens.inc(n)
        self.live.generated(n)

    def request_ended(self, seconds: float) -> None:
        self.e2e.observe(seconds)
        self.live.request_done()

    def render(self, stats: dict) -> bytes:
        for key, gauge in self.engine.items():
            gauge.set(stats.get(key, 0))
        self.engine_totals.stats = stats
        verifies = stats.get("spec_verify_steps", 0)
        accepted = stats.get("spec_accepted_tokens", 0)
        self.spec_mean_length.set(1 + accepted / verifies if verifies else 0.0)
        queried = stats.get("prefix_cache_queried_tokens", 0)
        hits = stats.get("prefix_cache_hit_tokens", 0)
        self.prefix_hit_rate.set(hits / queried if queried else 0.0)
        return generate_latest(self.registry)
