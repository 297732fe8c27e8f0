"""Speculative decoding inside continuous batching: n-gram (prompt lookup) proposals here, a
draft model's in engine/drafting.py (both verified the same way).

A request in speculation proposes up to K tokens from its own history: the tokens that
followed the latest earlier occurrence of its last n tokens (n from ``max_n`` down to
``min_n``). One *verify segment* feeds its last token and the K proposals and samples all
K + 1 positions in the same forward as every other row of the step; on the host, proposal i
is accepted while it equals the token sampled before it, and the first token that differs
(or the one after the last proposal) is the free extra token. Output is what plain greedy
decoding gives, token for token: each accepted token is the argmax at its position given
exactly the tokens before it.

Sampled rows speculate the same way, and stay exact too. For a proposal that is one token
(a draft distribution q that is one-hot on x), the standard rejection rule — accept x with
probability min(1, p(x) / q(x)) = p(x), else draw from norm(max(p - q, 0)), p without x — is
the same as drawing y ~ p and accepting while y == x: P(y == x) = p(x), and y given y != x is
exactly that residual. Tandem's sampler draws with noise that is a pure function of the row's
seed and position (runner/sampler.py), so a verify row draws the very token plain decoding
would draw at that position: the output is token for token the one without speculation, for
every seed (so its distribution is unchanged).

Which requests speculate (the rest decode as before, chained on the step in flight):
- every kind of row: a verify row of a penalized request counts the proposals before its
  position as output (engine/sampling_rows.py); a grammar-constrained request proposes only
  what its grammar allows, and each verify row samples under the mask after the proposals
  before it (results.grammar_masks), as plain decoding would have;
- only while the step's decode batch is at most ``max_batch`` (a larger step is no longer
  bound by weight traffic and host work, so verifying extra positions costs real compute);
- a request whose proposals keep failing backs off: after ``patience`` verify steps that
  accepted nothing it decodes plainly for ``backoff`` tokens, doubling each time;
- only while speculating steps emit at least ``min_gain`` times the tokens per second of
  plain steps at the same batch, as the engine times them (engine/spec_gain.py).

A verify segment needs its last token on the host, so a speculating request never rides a
chained step lazily. While any request speculates the loop runs one step at a time (the
scheduler builds no chained step): a chained step without the speculating requests would give
them every other step only, and a verify yields more than the overlap saves. When every
request has backed off (or the batch grew past ``max_batch``) the overlap resumes.

Rejected positions' KV stays in the request's pages as garbage past its length (attention
reads only up to each query's position, and the next write overwrites it); whole pages past
the new length go back to the pool when the verify step is finalized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.engine import recovery, spec_gain
from tandem.engine.plan import Segment
from tandem.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from tandem.engine.kv_manager import KVManager
    from tandem.engine.scheduler import Scheduler


@dataclass(frozen=True)
class SpecConfig:
    num_tokens: int = 0  # K, proposals per verify (0: speculation off)
    max_n: int = 4  # longest n-gram matched
    min_n: int = 1  # shortest
    max_batch: int = 8  # decode rows in a step above which no request speculates
    patience: int = 4  # verify steps accepting nothing before backing off
    backoff: int = 16  # plain tokens after the first back-off (doubles each time)
    # Proposals from a draft model (engine/drafting.py) instead of the n-gram index.
    draft: bool = False
    # A model with recurrent layers whose verifies keep the state after each position
    # (runner/positions.py): a rejected proposal resumes from one, instead of replaying.
    per_position: bool = False
    # Engine-wide memory: while the recent verifies of all requests accepted less than this
    # share of their proposals, a new request starts backed off (``cold_backoff`` tokens),
    # so a workload the proposer cannot predict pays for a probe now and then, not for
    # ``patience`` failed verifies per request.
    min_acceptance: float = 0.2
    cold_backoff: int = 64
    # Off for a while when speculating steps emit fewer tokens per second than this share
    # of plain steps' (engine/spec_gain.py; 0: never, the scheduler tests' default; engines
    # get EngineConfig.speculative_min_gain, 1.0).
    min_gain: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0


INDEX_PER_CALL = 2048  # ~3 ms of Python a step at most


class NgramIndex:
    """The latest start of every n-gram (``min_n <= n <= max_n``) of a growing token list,
    except those ending at its last token (so a lookup never matches the suffix itself)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this index are in ``last``

    def follow(self, prompt: list[int], output: list[int]) -> None:
        """``extend`` with a request's history, kept in the index's own list and appended
        to (its output only grows), instead of a copy of it every call: a backed-off request
        proposes on every plain token (engine/spec_shadow.py), and a 32k history is a 32k
        copy."""
        toks = self.tokens
        if not toks:
            toks = self.tokens = list(prompt)
        toks += output[len(toks) - len(prompt) :]
        self.extend(toks)

    def extend(self, tokens: list[int]) -> None:
        """Catch up with ``tokens`` (the request's whole history, which only grows), at most
        ``INDEX_PER_CALL`` positions a call: a long prompt is indexed over several steps (its
        older part first) instead of stalling one step for every stream."""
        self.tokens = tokens
        end = min(len(tokens) - 1, self._indexed + INDEX_PER_CALL)  # not the last token's
        for j in range(self._indexed, end):
            for n in range(self.min_n, self.max_n + 1):
                if j - n + 1 < 0:
                    break
                self.last[tuple(tokens[j - n + 1 : j + 1])] = j - n + 1
        self._indexed = max(self._indexed, end)

    def propose(self, k: int) -> list[int]:
        """At most ``k`` tokens copied from after the latest earlier occurrence of the longest
        suffix that occurred before ([] when none did), and at most 2^n for a suffix of n
        tokens: a one-token match is weak evidence, and each proposal is a position the
        verify computes. (The default model rewriting a file, simulated with a verify costing
        1 + 0.2 per proposal, as on this CPU: K = 8 1.71 -> 2.04x of plain, K = 4 1.87 ->
        1.94; at 0.03 a proposal, a GPU's, 3.50 -> 3.59 and unchanged.) The copy may run on
        into the tokens it is proposing (as an LZ77 match does), so a loop of period p < k
        is proposed in full."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            start = self.last.get(tuple(toks[len(toks) - n :]))
            if start is not None:
                out: list[int] = []
                for j in range(start + n, start + n + min(k, 1 << n)):
                    out.append(toks[j] if j < len(toks) else out[j - len(toks)])
                return out
        return []


@dataclass
class SpecState:
    """One request's speculation: its n-gram index, back-off and counts."""

    index: NgramIndex
    failures: int = 0  # verify steps in a row that accepted nothing
    plain_left: int = 0  # tokens to decode plainly before speculating again
    next_backoff: int = 0
    proposed: int = 0
    accepted: int = 0
    verifies: int = 0
    # A draft model's KV of this request is valid for positions [0, draft_len).
    draft_len: int = 0
    # While backed off: the n-gram proposal for output positions from ``shadow_at`` on, and
    # how many of them the plain tokens matched so far (engine/spec_shadow.py).
    shadow: list[int] = field(default_factory=list)
    shadow_at: int = 0
    shadow_hits: int = 0
    cold: bool = False  # started backed off, and not proposed since (no index yet)

    @property
    def active(self) -> bool:
        return self.plain_left <= 0

    def shadowed(self, proposed: int, accepted: int, ready: bool) -> None:
        """A shadow verify would have accepted ``accepted`` of ``proposed``: at least half
        ends the back-off where a proposal is ``ready`` (its length stays, for the next)."""
        if ready and 2 * accepted >= proposed and self.plain_left > 0:
            self.plain_left = self.failures = 0

    def record(self, cfg: SpecConfig, proposed: int, accepted: int) -> None:
        """A verify of ``proposed`` tokens accepted ``accepted`` of them."""
        self.proposed += proposed
        self.accepted += accepted
        self.verifies += 1
        self._outcome(cfg, accepted > 0)

    def no_proposal(self, cfg: SpecConfig) -> None:
        """Nothing to propose: it costs the request its place in chained steps, so it counts
        against it like a verify that accepted nothing."""
        self._outcome(cfg, False)

    def _outcome(self, cfg: SpecConfig, hit: bool) -> None:
        self.cold = False
        self.failures = 0 if hit else self.failures + 1
        if self.failures >= cfg.patience:
            self.failures = 0
            self.next_backoff = self.next_backoff * 2 if self.next_backoff else cfg.backoff
            self.plain_left = self.next_backoff

    def plain_tokens(self, n: int) -> None:
        """``n`` tokens were decoded plainly (counts down a back-off)."""
        self.plain_left = max(0, self.plain_left - n)


def accepted_tokens(proposal: tuple[int, ...], sampled: tuple[int, ...]) -> list[int]:
    """The tokens a verify yields: ``sampled[i]`` is the token drawn after the request's
    tokens and ``proposal[:i]``; it stands while every proposal before it matched."""
    assert len(sampled) == len(proposal) + 1
    out = []
    for i, token in enumerate(sampled):
        out.append(token)
        if i == len(proposal) or token != proposal[i]:
            break
    return out


class Acceptance:
    """The engine-wide acceptance rate of recent verifies (an exponential moving average;
    optimistic at start)."""

    WEIGHT = 0.1  # of each verify
    DRIFT = 0.05  # back towards 1 with each request that starts backed off

    def __init__(self) -> None:
        self.rate = 1.0

    def record(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.rate += self.WEIGHT * (accepted / proposed - self.rate)

    def cold_start(self) -> None:
        """A request starts backed off. Requests shorter than the back-off never verify, so
        the rate drifts back up on its own, and one in a few requests probes again."""
        self.rate += self.DRIFT * (1 - self.rate)


def new_state(cfg: SpecConfig, recent: Acceptance | None = None) -> SpecState:
    state = SpecState(NgramIndex(cfg.min_n, cfg.max_n))
    if recent is not None and recent.rate < cfg.min_acceptance:
        # Backed off from the start, and one failed verify (not ``patience``) after it
        # backs off again: a probe costs one verify while nothing is being accepted.
        state.plain_left = state.next_backoff = cfg.cold_backoff
        state.cold = True
        state.failures = cfg.patience - 1
        recent.cold_start()
    return state


def propose(req, cfg: SpecConfig) -> list[int]:
    """The request's next proposal: at most K tokens, and never past its max_tokens (the
    verify yields one token more than it accepts)."""
    room = req.params.max_tokens - len(req.output_token_ids) - 1
    k = min(cfg.num_tokens, room)
    if k <= 0:
        return []
    if cfg.draft:  # placeholders: the draft fills them in once pages are allocated
        return [0] * k
    req.spec.index.follow(req.prompt_token_ids, req.output_token_ids)
    return trim(req, req.spec.index.propose(k))


def trim(req, proposal: list[int]) -> list[int]:
    """A proposal cut after a stop token (before it, for a grammar-constrained request) and
    to what the request's grammar allows."""
    for i, t in enumerate(proposal):
        if t in req.stop_ids:  # nothing after an end is worth verifying
            proposal = proposal[: i if req.grammar is not None else i + 1]
            break
    if req.grammar is not None and proposal:
        # Only what the grammar allows: each verify row gets the mask after the proposals
        # before it (results.grammar_masks), which needs them to be valid.
        proposal = proposal[: req.grammar.valid_prefix(proposal)]
    return proposal


# ---- the scheduler's side ------------------------------------------------------------------
def speculating(sched: Scheduler) -> bool:
    """Whether requests speculate this step: on, and the decode batch small enough."""
    spec = sched.config.speculation
    if not spec.enabled or (sched.proposer is not None and sched.proposer.disabled):
        return False
    rows = spec_gain.decoding(sched.running)
    return rows <= spec.max_batch and sched.gain.allows(rows)


def anyone_speculating(sched: Scheduler) -> bool:
    return any(
        r.status is RequestStatus.DECODE and r.spec is not None and r.spec.active
        for r in sched.running.values()
    )


def fit_proposals(
    sched: Scheduler,
    decodes: list[tuple[Request, int]],
    proposals: dict[str, list[int]],
    budget: int,
    need: int,
    wneed: int = 0,
) -> dict[str, list[int]]:
    """Proposals cut to the step's token budget and the pages left after the plain
    decodes' (``need``, and ``wneed`` of the window group) and the waiting queue head's; a
    request left with none decodes one token."""
    kv = sched.kv
    budget -= len(decodes)
    pages = kv.available() - need
    wpages = kv.window_available() - wneed
    if sched.waiting:  # proposals are optional; the queue's head is not
        pages -= kv.pages_for(min(sched.waiting[0].num_tokens, recovery.prefill_cap(sched)))
    out: dict[str, list[int]] = {}
    for req, _ in decodes:
        proposal = proposals.get(req.request_id)
        if proposal is None:
            continue
        if not proposal:  # nothing to propose counts against it; a cut for room doesn't
            req.spec.no_proposal(sched.config.speculation)
            continue
        proposal = proposal[: max(0, budget)]
        full, win = _proposal_pages(kv, req, len(proposal))
        while proposal and (full > pages or win > wpages):
            proposal.pop()
            full, win = _proposal_pages(kv, req, len(proposal))
        if not proposal:
            continue
        budget -= len(proposal)
        pages -= full
        wpages -= win
        out[req.request_id] = proposal
    return out


def _proposal_pages(kv: KVManager, req: Request, k: int) -> tuple[int, int]:
    """Pages (full, window group) ``k`` proposals of ``req`` need beyond its plain decode."""
    end = req.num_computed + 1
    full = kv.pages_for(end + k) - max(len(req.pages), kv.pages_for(end))
    return full, kv.window_need(req, end + k) - kv.window_need(req, end)


def extra_pages(
    kv: KVManager, decodes: list[tuple[Request, int]], proposals: dict[str, list[int]]
) -> int:
    """Pages the proposals need beyond their requests' plain decode."""
    return sum(_proposal_pages(kv, r, len(proposals.get(r.request_id, ())))[0] for r, _ in decodes)


def draft_lost(sched: Scheduler) -> None:
    """The draft model's pool was reset: no request's draft KV is left."""
    for req in sched.running.values():
        if req.spec is not None:
            req.spec.draft_len = 0


def drafted_rows(segments: list[Segment]) -> dict[int, tuple[int, ...]]:
    """Each verify row after the first: the proposals before its position (a penalty counts
    them as output)."""
    return {
        row: seg.token_ids[1 : 1 + row - seg.sample_row]
        for seg in segments
        if seg.draft < 0  # (a draft's proposals are never penalized)
        for row in seg.later_rows
    }


def fit_slots(kv: KVManager, req: Request, n: int) -> None:
    """A request's verify of ``n`` tokens keeps only the state slots that many need: its
    backup only if n > 1, states per position for its first n - 1 (n = 0: none at all)."""
    if n <= 1 and req.spec_backup >= 0:
        kv.drop_snapshot(req.spec_backup)
        req.spec_backup = -1
    for slot in req.spec_positions[max(n - 1, 0) :]:
        kv.drop_snapshot(slot)
    req.spec_positions = req.spec_positions[: max(n - 1, 0)]


def back_up(sched: Scheduler, proposals: dict[str, list[int]]) -> dict[str, list[int]]:
    """A model with recurrent layers: each verify first copies the state it starts from to a
    snapshot slot, from which a rejected proposal is replayed (results.py), or, where the
    runner keeps them per position, the states after each of its positions but the last to
    one slot each (as many proposals as it got slots). A request that gets no slot decodes
    plainly this step."""
    kept: dict[str, list[int]] = {}
    per_position = sched.config.speculation.per_position
    for rid, proposal in proposals.items():
        req = sched.running[rid]
        assert req.spec_backup < 0 and not req.spec_positions
        if proposal and per_position:
            got: list[int] = []
            positions = sched.kv.positions
            assert positions is not None
            while len(got) < len(proposal) and (slot := positions.allocate()) >= 0:
                got.append(slot)
            if not got:
                continue
            req.spec_positions = tuple(got)
            proposal = proposal[: len(got)]
        elif proposal:
            req.spec_backup = sched.kv.new_snapshot()
            if req.spec_backup < 0:
                continue
        kept[rid] = proposal
    return kept
