"""Request state. Only the scheduler mutates it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued, holds no KV
    PREFILL = 1  # owns a row; prompt[:-1] is being written in chunks
    DECODE = 2  # owns a row; each step feeds one token
    FINISHED = 3  # done; keeps its row until no in-flight step references it


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    row: int | None = None
    # Positions whose KV has been (or is being, in a launched step) written.
    num_computed: int = 0
    # Launched steps that reference this request and are not finalized yet.
    num_inflight: int = 0
    finish_reason: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_len(self) -> int:
        """Most KV positions this request can ever need."""
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
