"""Frozen step plans (scheduler → runner) and plain step results (runner → scheduler).

A step is one forward over a flat list of tokens made of *segments*: each segment is a run of
consecutive positions of one request (a prefill chunk, a decode token, or both at once when a
prompt's last chunk samples its first output). Its K/V go to the pages of the request's page
table; attention reads only those pages. Segments that end at the request's last known token
are *sampled*: their last position's logits give one output token (one sample row each).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Segment:
    """Immutable once in a plan, by convention: not ``frozen``, whose ``__init__`` sets each
    of its 17 fields through ``object.__setattr__`` (2.5 µs a segment against 1.1 here; a
    B = 256 decode step builds 256 of them: ``scripts/sched_host_cost.py`` read schedule
    1.5 -> 1.1 ms). Nothing writes one once it is in a plan (the scheduler sets a decode's
    rarer fields just after making it); ``dataclasses.replace`` makes a changed copy."""

    request_id: str
    start: int  # first position written
    num_tokens: int
    # Host-known input tokens, or () when the one input is the parent step's sampled token
    # at ``parent_row`` (a chained decode: the token is still on the device).
    token_ids: tuple[int, ...]
    pages: tuple[int, ...]  # the request's page table, covering [0, start + num_tokens)
    parent_row: int = -1
    sample_row: int = -1  # >= 0: the last position is sampled into this output row
    # Models with sliding-window layers: those layers' page table (engine/kv_manager.py's
    # window group; -1 behind the window, never read); () where the model has none.
    wpages: tuple[int, ...] = ()
    # A speculative verify segment samples its last ``num_samples`` positions into rows
    # sample_row .. sample_row + num_samples - 1; its token_ids are the request's last
    # token and the proposed ones (engine/speculation.py).
    num_samples: int = 1
    # A verify segment whose proposals a draft model makes in this very step: the index of
    # its query in ``StepPlan.drafts`` (token_ids after the first are placeholders; the
    # runner feeds the draft's tokens, and returns them in ``StepResult.drafted``).
    draft: int = -1
    # Prompt log-probabilities: top-k to return (-1: none) and the tokens that positions
    # start .. score (each position's logits score the next token; the sampled position's
    # logits belong to the output, not the prompt).
    logprobs: int = -1
    next_tokens: tuple[int, ...] = ()
    # The request's recurrent-state slot (models with recurrent layers; -1: none), the slot
    # its state is read from instead (a prefix hit's snapshot, or a rolled-back verify's
    # backup; -1: its own), and (position, slot) pairs: after the positions before
    # ``position`` the state is also copied to ``slot`` (page boundaries in (start, end],
    # ascending).
    state_slot: int = -1
    state_src: int = -1
    snapshots: tuple[tuple[int, int], ...] = ()
    # A verify segment of a model with recurrent layers: the snapshot slot that keeps the
    # state it starts from (a rejected proposal is rolled back by replaying from there).
    state_backup: int = -1
    # Or, where the runner keeps the state after each position (runner/positions.py): the
    # slots that get the states after its positions start .. end - 2 (then a rejected
    # proposal resumes from one; the state after the last is the request's own slot).
    state_positions: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def lazy(self) -> bool:
        return self.parent_row >= 0

    @property
    def state_read(self) -> int:
        """The slot this segment's recurrent state is read from: ``state_src`` where set
        (a prefix hit's snapshot, a rolled-back verify's backup), else its own slot."""
        return self.state_src if self.state_src >= 0 else self.state_slot

    @property
    def later_rows(self) -> range:
        """A verify segment's sample rows after its first: row ``sample_row + i`` samples
        after the first ``i`` proposals (empty for any other segment)."""
        if self.num_samples <= 1:
            return range(0)
        return range(self.sample_row + 1, self.sample_row + self.num_samples)

    @property
    def sample_positions(self) -> range:
        """The positions whose logits are sampled (empty for a chunk that samples none)."""
        if self.sample_row < 0:
            return range(0)
        return range(self.end - self.num_samples, self.end)


@dataclass(frozen=True)
class RowSampling:
    """Per-sample-row sampling parameters (temperature 0 = greedy)."""

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
    # Penalized rows: (row, presence, frequency, repetition, prompt ids, output ids the host
    # has; a lazily fed row's newest output is still on the device and added there).
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
    segments: tuple[Segment, ...]
    # One entry per sample row: the request and the position whose logits are sampled.
    sample_request_ids: tuple[str, ...]
    sample_positions: tuple[int, ...]
    sampling: RowSampling
    # Chained on the in-flight step ``parent_step`` (0: none): lazy segments read its tokens.
    parent_step: int = 0
    # The parent's sampling state (advanced on the device) serves this step unchanged: the
    # same requests in the same sample rows, every one fed lazily.
    reuse_sampling: bool = False
    # Draft-model queries run in this step before the forward (engine/drafting.py): their
    # proposals feed verify segments on the device, with no wait for the host between.
    drafts: tuple[DraftQuery, ...] = ()
    # Per-position state ids freed since the plan before (engine/state_slots.py's
    # PositionSlots): the runner lets go of the states they held.
    released_states: tuple[int, ...] = ()

    @property
    def chained(self) -> bool:
        return self.parent_step > 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    @property
    def num_rows(self) -> int:
        return len(self.sample_request_ids)

    @property
    def request_ids(self) -> frozenset[str]:
        return frozenset(s.request_id for s in self.segments)


@dataclass(frozen=True)
class DraftQuery:
    """One request's turn in a draft model's proposal (engine/drafting.py): feed ``tokens``
    at positions ``start ..`` (the draft's catch-up on what it has not seen, ending with the
    request's last token), then propose ``k`` tokens greedily (0: catch up only). KV goes to
    the draft's pool at the request's own page table."""

    request_id: str
    start: int
    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    k: int

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


# A sampled token's log-probability and the top-k (token, log-probability) pairs.
TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class StepResult:
    step_id: int
    tokens: tuple[int, ...]  # one per sample row of the plan
    logprobs: dict[int, TokenLogprobs] | None = None  # by sample row, for rows that asked
    # Prompt log-probabilities of segments that asked: request id -> one entry per scored
    # position.
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None
    # The proposals of the plan's draft queries that proposed, by request id, and whether
    # the draft failed (its proposals are placeholders, and its KV is gone).
    drafted: dict[str, tuple[int, ...]] | None = None
    draft_failed: bool = False


def is_oom(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    text = str(e).lower()
    return "out of memory" in text or "unable to allocate" in text or "malloc" in text
