"""Request state. Only the scheduler mutates it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tandem.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued (or retracted), holds no KV
    PREFILL = 1  # holds pages; its known tokens (prompt, plus output if resumed) go in chunks
    DECODE = 2  # every known token is computed or in flight; each step feeds one token
    FINISHED = 3  # done; keeps its pages until no in-flight step references them


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Page table: page i holds positions [i * page_size, (i + 1) * page_size).
    pages: list[int] = field(default_factory=list)
    # Prefix-cache pages this request keeps alive without listing them (see
    # PrefixCache.insert): released with its pages.
    locked_pages: set[int] = field(default_factory=set)
    # Models with sliding-window layers (KVManager's window group): those layers' page
    # table, at the same positions (-1: freed behind the window, or not cached), and how
    # many leading entries are freed for good.
    wpages: list[int] = field(default_factory=list)
    wfree: int = 0
    state_slot: int = -1  # recurrent-state slot while running (models with recurrent layers)
    # Recurrent models: the snapshot slot a prefix hit (or a rolled-back verify's replay)
    # resumes from (until the first chunk that reads it is launched); with the prefix cache
    # the request's own checkpoint (its state at ``checkpoint_pos``, a page boundary, cached
    # when it ends) and positions where the cache wants its state kept (where prompts part).
    state_src: int = -1
    checkpoint: int = -1
    checkpoint_pos: int = 0
    snap_targets: set[int] = field(default_factory=set)
    # Positions whose KV has been (or is being, in a launched step) written.
    num_computed: int = 0
    # Launched steps that reference this request and are not finalized yet, and those of
    # them that sample a token for it.
    num_inflight: int = 0
    num_pending_samples: int = 0
    finish_reason: str | None = None
    # Prefix cache: prompt tokens served from cache at first admission.
    num_cached_tokens: int = 0
    cache_reported: bool = False
    admit_order: int = 0  # later admissions are retracted first
    num_passed: int = 0  # queued requests admitted before it while it was the head
    num_retractions: int = 0
    # Another sample of the same prompt (n > 1): admitted once that request's prompt is
    # launched, so its prefill comes from the prefix cache instead of being recomputed.
    follows: str | None = None
    prompt_logprobs: list | None = None  # filled by prefill chunks when asked for
    grammar: Any | None = None  # engine.grammar.Matcher of a guided request
    # Speculative decoding (engine.speculation.SpecState; None: this request never
    # speculates) and whether a verify segment of it is in flight.
    spec: Any | None = None
    spec_inflight: bool = False
    # Recurrent layers: the snapshot slot holding the state before the verify in flight,
    # and whether the request is replaying a rolled-back verify's tokens (engine/results.py);
    # or, where the runner keeps a verify's states per position, the slots that hold them.
    spec_backup: int = -1
    spec_positions: tuple[int, ...] = ()
    replaying: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_len(self) -> int:
        """Most KV positions this request can ever need."""
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far (what a resumed request must have in its KV)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        """The whole history, copied: O(length). A step's per-row work takes ``token_at``
        or ``token_slice`` instead."""
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, pos: int) -> int:
        """Token ``pos`` (0 <= pos < num_tokens) of prompt + output, without a copy."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output (0 <= start; clipped to what there is),
        copying only those."""
        n = len(self.prompt_token_ids)
        head = self.prompt_token_ids[start:end] if start < n else []
        return head + self.output_token_ids[max(start - n, 0) : max(end - n, 0)]

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
