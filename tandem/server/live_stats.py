"""The dashboard's time series: one point a second over the last minutes, kept in the HTTP
process from what it already sees (the engine's stats with each step's outputs, and each
token's arrival in ``Service.pieces``). Prometheus' ``/metrics`` stays the source for
scrapers; this is the short, pre-digested history a browser plots without parsing it."""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# Latency buckets for percentiles: 0.1 ms to ~100 s, 10% apart (a percentile is its bucket's
# upper bound, so within 10% of the true value).
_BOUNDS = [1e-4 * 1.1**k for k in range(146)]
WINDOW_S = 10  # the trailing seconds each point's latency percentiles cover


class LatencyWindow:
    """Per-second histograms of one latency over the last ``WINDOW_S`` seconds."""

    def __init__(self) -> None:
        self.current: dict[int, int] = {}
        self.recent: deque[dict[int, int]] = deque(maxlen=WINDOW_S)

    def observe(self, seconds: float) -> None:
        b = bisect.bisect_left(_BOUNDS, seconds)
        self.current[b] = self.current.get(b, 0) + 1

    def roll(self) -> None:
        """End the current second."""
        self.recent.append(self.current)
        self.current = {}

    def percentiles(self, qs: tuple[float, ...]) -> list[float | None]:
        """Milliseconds at each quantile over the window (None: nothing observed)."""
        merged: dict[int, int] = {}
        for h in self.recent:
            for b, n in h.items():
                merged[b] = merged.get(b, 0) + n
        total = sum(merged.values())
        if not total:
            return [None for _ in qs]
        out = []
        for q in qs:
            rank, seen = max(1, math.ceil(q * total)), 0
            for b in sorted(merged):
                seen += merged[b]
                if seen >= rank:
                    bound = _BOUNDS[b] if b < len(_BOUNDS) else _BOUNDS[-1]
                    out.append(round(bound * 1000, 3))
                    break
        return out


class LiveStats:
    """Points of ``{t, output_tps, running, waiting, kv_*, prefix_hit_rate, ttft/itl
    percentiles, ...}``, one per ``sample()`` (the app calls it every second), the last
    ``span_s`` seconds of them."""

    def __init__(self, span_s: int = 600, clock: Callable[[], float] = time.time) -> None:
        self.points: deque[dict[str, Any]] = deque(maxlen=span_s)
        self.ttft, self.itl = LatencyWindow(), LatencyWindow()
        self.clock = clock
        self.tokens = 0  # output tokens since start
        self.finished = 0  # requests ended since start
        # Time and totals at the previous point (at start: zeros, so the first point counts
        # what happened before it).
        self._last = (clock(), 0, 0, 0, 0, 0, 0)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def generated(self, n: int) -> None:
        self.tokens += n

    def request_done(self) -> None:
        self.finished += 1

    def sample(self, stats: dict[str, Any]) -> dict[str, Any]:
        """Append the point for the second that just ended, from the engine's latest
        ``stats`` and what was observed since the previous point."""
        now = self.clock()
        queried = int(stats.get("prefix_cache_queried_tokens", 0))
        hits = int(stats.get("prefix_cache_hit_tokens", 0))
        proposed = int(stats.get("spec_proposed_tokens", 0))
        accepted = int(stats.get("spec_accepted_tokens", 0))
        last = self._last
        dt = max(now - last[0], 1e-6)
        self.ttft.roll()
        self.itl.roll()
        ttft = self.ttft.percentiles((0.5, 0.99))
        itl = self.itl.percentiles((0.5, 0.99))
        pages = int(stats.get("kv_pages", 0))
        cached = int(stats.get("kv_cached_pages", 0))
        d_queried, d_hits = queried - last[2], hits - last[3]
        point: dict[str, Any] = {
            "t": round(now, 3),
            "output_tps": round((self.tokens - last[1]) / dt, 2),
            "finished_per_s": round((self.finished - last[4]) / dt, 2),
            "running": int(stats.get("running", 0)),
            "waiting": int(stats.get("waiting", 0)),
            "kv_pages": pages,
            "kv_pages_used": int(stats.get("kv_held_pages", 0)),
            "kv_pages_cached": cached,
            # Of the prompt tokens looked up in this second, the share the cache served.
            "prefix_hit_rate": round(d_hits / d_queried, 4) if d_queried > 0 else None,
            "prefix_hit_rate_total": round(hits / queried, 4) if queried else None,
            "ttft_p50_ms": ttft[0],
            "ttft_p99_ms": ttft[1],
            "itl_p50_ms": itl[0],
            "itl_p99_ms": itl[1],
        }
        if "spec_proposed_tokens" in stats:
            d_prop = proposed - last[5]
            point["spec_acceptance"] = (
                round((accepted - last[6]) / d_prop, 4) if d_prop > 0 else None
            )
        self._last = (now, self.tokens, queried, hits, self.finished, proposed, accepted)
        self.points.append(point)
        return point

    def since(self, t: float | None) -> list[dict[str, Any]]:
        """The points after time ``t`` (all of them for None)."""
        if t is None:
            return list(self.points)
        return [p for p in self.points if p["t"] > t]
