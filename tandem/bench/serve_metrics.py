"""Serving-benchmark arithmetic (pure Python): per-request records → the usual metric set
(request/token throughput, TTFT, TPOT, ITL, end-to-end latency, goodput)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """What the client saw of one request. Times in seconds from the request's start."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0  # from the server's usage
    expected_output_tokens: int | None = None
    ttft: float = 0.0
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    error: str = ""
    turn: int = 0  # multi-turn: which turn of its conversation (0: the first)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    return {
        "mean": sum(values) / len(values),
        "median": percentile(values, 50),
        "p99": percentile(values, 99),
    }


@dataclass(frozen=True)
class SLO:
    ttft: float | None = None  # seconds
    tpot: float | None = None
    e2e: float | None = None

    def met(self, r: RequestRecord) -> bool:
        tpot = r.tpot if r.tpot is not None else 0.0
        return (
            r.ok
            and (self.ttft is None or r.ttft <= self.ttft)
            and (self.tpot is None or tpot <= self.tpot)
            and (self.e2e is None or r.latency <= self.e2e)
        )


def compute(records: list[RequestRecord], duration: float, slo: SLO | None = None) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    short = [
        r
        for r in ok
        if r.expected_output_tokens is not None and r.output_tokens != r.expected_output_tokens
    ]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    result = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else math.nan,
        "output_throughput": out_tokens / duration if duration else math.nan,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else math.nan,
        "ttft_s": summary([r.ttft for r in ok]),
        "tpot_s": summary([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": summary([g for r in ok for g in r.itl]),
        "e2e_latency_s": summary([r.latency for r in ok]),
        "outputs_with_unexpected_length": len(short),
    }
    if any(r.turn for r in ok):
        result["per_turn"] = per_turn(ok)
    if slo is not None:
        result["goodput"] = sum(slo.met(r) for r in records) / duration if duration else math.nan
    return result


def per_turn(records: list[RequestRecord]) -> list[dict]:
    """Multi-turn conversations, by turn: prompt tokens and the share the server reported
    as read from its prefix cache (None: it reports none), and the median TTFT."""
    out = []
    for turn in sorted({r.turn for r in records}):
        rs = [r for r in records if r.turn == turn]
        cached = [r.cached_tokens for r in rs if r.cached_tokens is not None]
        prompt = sum(r.prompt_tokens for r in rs)
        out.append(
            {
                "turn": turn + 1,
                "requests": len(rs),
                "prompt_tokens_mean": prompt / len(rs),
                "cached_tokens_mean": sum(cached) / len(cached) if cached else None,
                "cached_share": sum(cached) / prompt if cached and prompt else None,
                "ttft_ms_median": percentile([r.ttft for r in rs], 50) * 1e3,
            }
        )
    return out
