"""Plain results handed from the engine to its callers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineOutput:
    """Tokens a request gained in one finalized step (``finish_reason`` set on its last).
    Immutable by convention, not ``frozen`` (one a row a step: see ``plan.Segment``)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    # Whose fault an error is: "request" (the client's: 400), "resource" (out of device
    # memory: 503) or "internal" (an engine bug: 500).
    error_kind: str = "request"
    # On a request's first output: prompt tokens whose KV came from the prefix cache.
    cached_tokens: int | None = None
    # One (token log-probability, top-k pairs) per new token, when the request asked.
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None
    # On the first output, when asked: one entry per prompt token after the first.
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A finished (or, when streaming, growing) completion of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # Per generated token: (its log-probability, top-k (token, log-probability) pairs).
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
    # Prompt tokens whose KV (and recurrent state) came from the prefix cache.
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
