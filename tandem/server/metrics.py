"""Prometheus metrics of the HTTP process (one registry per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


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
        self.running = Gauge("tandem_num_requests_running", "Requests owning KV", registry=r)
        self.waiting = Gauge("tandem_num_requests_waiting", "Queued requests", registry=r)
        self.kv_usage = Gauge(
            "tandem_kv_cache_usage_ratio",
            "Share of the KV budget held by live requests (cached prefixes not counted)",
            registry=r,
        )
        self.prefix_queried = Gauge(
            "tandem_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache (since start)",
            registry=r,
        )
        self.prefix_hits = Gauge(
            "tandem_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache (since start)",
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "tandem_prefix_cache_hit_rate",
            "Share of prompt tokens served from the prefix cache (since start)",
            registry=r,
        )
        self.retractions = Gauge(
            "tandem_num_retractions",
            "Requests retracted (preempted) to fit the KV budget (since start)",
            registry=r,
        )

        self.engine_restarts = Gauge(
            "tandem_engine_restarts",
            "Engine processes restarted after one died (since start)",
            registry=r,
        )
        self.step_failures = Gauge(
            "tandem_engine_step_failures",
            "Engine steps that raised; their requests were retried or failed (since start)",
            registry=r,
        )
        self.oom_recoveries = Gauge(
            "tandem_engine_oom_recoveries",
            "Steps that ran out of device memory and were retried smaller (since start)",
            registry=r,
        )
        self.kv_pages = Gauge("tandem_kv_pages", "Pages in the KV pool", registry=r)
        self.kv_cached_pages = Gauge(
            "tandem_kv_cached_pages", "KV pages only the prefix cache holds", registry=r
        )

    def render(self, stats: dict) -> bytes:
        self.running.set(stats.get("running", 0))
        self.waiting.set(stats.get("waiting", 0))
        self.kv_usage.set(stats.get("kv_usage", 0.0))
        queried = stats.get("prefix_cache_queried_tokens", 0)
        hits = stats.get("prefix_cache_hit_tokens", 0)
        self.prefix_queried.set(queried)
        self.prefix_hits.set(hits)
        self.prefix_hit_rate.set(hits / queried if queried else 0.0)
        self.retractions.set(stats.get("retractions", 0))
        self.engine_restarts.set(stats.get("engine_restarts", 0))
        self.step_failures.set(stats.get("step_failures", 0))
        self.oom_recoveries.set(stats.get("oom_recoveries", 0))
        self.kv_pages.set(stats.get("kv_pages", 0))
        self.kv_cached_pages.set(stats.get("kv_cached_pages", 0))
        return generate_latest(self.registry)
