"""Plain results handed from the engine to its callers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineOutput:
    """Tokens a request gained in one finalized step (``finish_reason`` set on its last)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    # On a request's first output: prompt tokens whose KV came from the prefix cache.
    cached_tokens: int | None = None

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
