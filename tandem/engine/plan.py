"""Frozen step plans (scheduler → runner) and plain step results (runner → scheduler).

A step is one forward over the KV rows ``0 .. num_rows-1`` (one token each: the decode part)
preceded by cache-only prefill chunks on single rows. Rows without a decoding request are
holes: they compute a throw-away token at a harmless position.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillChunk:
    """Write KV for ``token_ids`` at positions ``start ..`` of ``row``; no logits."""

    request_id: str
    row: int
    start: int
    token_ids: tuple[int, ...]
    # Prompt log-probabilities: top-k to return (-1: none) and the token after the chunk
    # (each position's logits score the next token).
    logprobs: int = -1
    next_token: int = 0


@dataclass(frozen=True)
class RowCopy:
    """Copy KV positions ``[0, length)`` of ``src`` into ``dst`` (a prefix-cache hit on a row
    that another request owns). Runs before the step's prefill chunks."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling parameters (temperature 0 = greedy)."""

    temperature: tuple[float, ...]
    top_k: tuple[int, ...]
    top_p: tuple[float, ...]
    seed: tuple[int, ...]
    min_p: tuple[float, ...] = ()  # empty: 0 for every row
    # Sparse per-row logit edits: (row, token, bias) added to the logits; (row, token) pairs
    # masked while the row's position is below min_position[row] (min_tokens).
    logit_bias: tuple[tuple[int, int, float], ...] = ()
    min_position: tuple[int, ...] = ()
    suppress: tuple[tuple[int, int], ...] = ()
    # Penalized rows: (row, presence, frequency, repetition, prompt ids, output ids so far).
    penalties: tuple[tuple[int, float, float, float, tuple[int, ...], tuple[int, ...]], ...] = ()
    # (row, k): return the sampled token's log-probability and the top k at its position.
    logprobs: tuple[tuple[int, int], ...] = ()
    # Grammar-constrained rows: sampling waits for their allowed-token masks, computed on the
    # host from each row's previous token (the forward before it does not wait).
    constrained: tuple[int, ...] = ()

    @property
    def all_greedy(self) -> bool:
        return all(t == 0 for t in self.temperature)

    @property
    def edits_logits(self) -> bool:
        """Whether any row changes its logits before sampling (greedy rows included)."""
        return bool(self.logit_bias or self.suppress or self.penalties)


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    # Decode part: one entry per row 0..num_rows-1 (None = hole).
    row_request_ids: tuple[str | None, ...]
    positions: tuple[int, ...]
    # Host-known input tokens; None for a chained step (the parent's lazy tokens feed it).
    input_tokens: tuple[int, ...] | None
    sampling: RowSampling
    chunks: tuple[PrefillChunk, ...] = ()
    # KV sequence capacity every row buffer must have before this step runs.
    capacity: int = 0
    chained: bool = False
    copies: tuple[RowCopy, ...] = ()
    # Rows whose KV must survive this step (owned or cached): the pool keeps at least these.
    kv_rows: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.row_request_ids)

    @property
    def is_decode(self) -> bool:
        """A pure decode step: the only kind that may seed a chain."""
        return not self.chunks and self.num_rows > 0

    @property
    def request_ids(self) -> frozenset[str]:
        ids = {r for r in self.row_request_ids if r is not None}
        ids.update(c.request_id for c in self.chunks)
        return frozenset(ids)


# A sampled token's log-probability and the top-k (token, log-probability) pairs.
TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class StepResult:
    step_id: int
    tokens: tuple[int, ...]  # one per row of the plan
    logprobs: dict[int, TokenLogprobs] | None = None  # by row, for rows that asked
    # Prompt log-probabilities of chunks that asked: request id -> one entry per chunk token
    # (scoring the token after it).
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None


class KVOutOfMemory(RuntimeError):
    """The device could not allocate a larger pool. The pool is now empty; ``held`` and
    ``wanted`` are its sizes (rows x positions) before and in the failed growth."""

    def __init__(self, held: int, wanted: int, reason: str) -> None:
        super().__init__(f"KV pool growth to {wanted} tokens failed: {reason}")
        self.held, self.wanted = held, wanted
