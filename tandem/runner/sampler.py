"""In-graph batched sampling: greedy, temperature, top-k, top-p, min-p with per-row seeds, and
sparse logit edits (logit_bias; stop tokens masked until min_tokens).

Everything is an MLX op on the step's logits, so a chained step samples without the host.
Randomness is a counter-based hash of (row seed, position, vocab index) fed to Gumbel-max:
a row's tokens depend only on its own seed and inputs, never on its batchmates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from tandem.engine.plan import RowSampling

# (chosen, top ids, top values) of the rows that asked for log-probabilities.
LogprobArrays = tuple[mx.array, mx.array, mx.array]


def logprob_entries(arrays: LogprobArrays, ks: list[int]) -> list[tuple[float, tuple]]:
    """(chosen, top ids, top values) → per row: (log-probability, its top ``ks[i]`` pairs)."""
    chosen, top_ids, top_lps = (a.tolist() for a in arrays)
    return [
        (c, tuple(zip(i[:k], v[:k], strict=True)))
        for c, i, v, k in zip(chosen, top_ids, top_lps, ks, strict=True)
    ]


_GOLDEN = 0x9E3779B1
CANDIDATES_MAX = 1024


@dataclass(frozen=True)
class SamplingArrays:
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    # The S sampled rows, and their parameters (S, 1).
    sampled_rows: mx.array | None = None
    num_rows: int = 0
    candidates: int = 0  # > 0: draw among each row's top-`candidates` tokens only
    inv_temperature: mx.array | None = None
    top_k: mx.array | None = None  # int32, vocab size when disabled
    top_p: mx.array | None = None
    seed: mx.array | None = None  # uint32
    log_min_p: mx.array | None = None  # -inf where min_p is 0
    # Sparse edits: flat indices row * V + token into the (R, V) logits.
    bias_index: mx.array | None = None
    bias_value: mx.array | None = None
    suppress_index: mx.array | None = None
    suppress_row: mx.array | None = None
    min_position: mx.array | None = None  # (R,)
    # Penalized rows (P of them): their batch rows, parameters (P, 1), output token counts
    # (P, V) and the prompt's tokens (P, V) bool. Counts advance in the graph with each
    # sampled token, so a chained step penalizes its parent's token without the host.
    pen_rows: mx.array | None = None
    presence: mx.array | None = None
    frequency: mx.array | None = None
    repetition: mx.array | None = None
    counts: mx.array | None = None
    prompt_seen: mx.array | None = None
    # Rows that return log-probabilities, and the largest top-k among them.
    lp_rows: mx.array | None = None
    lp_k: int = 0

    @property
    def edits(self) -> bool:
        return (  # logit changes (log-probability rows only read the logits)
            self.bias_index is not None
            or self.suppress_index is not None
            or self.pen_rows is not None
        )

    @property
    def needs_positions(self) -> bool:
        return not self.all_greedy or self.suppress_index is not None


def _edits(s: RowSampling, vocab_size: int) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    bias = [(r * vocab_size + t, b) for r, t, b in s.logit_bias if t < vocab_size]
    if bias:
        out["bias_index"] = mx.array([i for i, _ in bias], dtype=mx.int32)
        out["bias_value"] = mx.array([b for _, b in bias], dtype=mx.float32)
    sup = [(r, t) for r, t in s.suppress if t < vocab_size]
    if sup:
        out["suppress_index"] = mx.array([r * vocab_size + t for r, t in sup], dtype=mx.int32)
        out["suppress_row"] = mx.array([r for r, _ in sup], dtype=mx.int32)
        out["min_position"] = mx.array(s.min_position, dtype=mx.int32)
    if s.logprobs:
        out["lp_rows"] = mx.array([r for r, _ in s.logprobs], dtype=mx.int32)
    if s.penalties:
        n = len(s.penalties)
        counts = np.zeros((n, vocab_size), dtype=np.float32)
        seen = np.zeros((n, vocab_size), dtype=bool)
        for i, (_, _, _, _, prompt, output) in enumerate(s.penalties):
            ids = np.asarray([t for t in output if t < vocab_size], dtype=np.int64)
            np.add.at(counts[i], ids, 1.0)
            seen[i, [t for t in prompt if t < vocab_size]] = True
        col = [(p[1], p[2], p[3]) for p in s.penalties]
        out["pen_rows"] = mx.array([p[0] for p in s.penalties], dtype=mx.int32)
        out["presence"] = mx.array([c[0] for c in col], dtype=mx.float32)[:, None]
        out["frequency"] = mx.array([c[1] for c in col], dtype=mx.float32)[:, None]
        out["repetition"] = mx.array([c[2] for c in col], dtype=mx.float32)[:, None]
        out["counts"] = mx.array(counts)
        out["prompt_seen"] = mx.array(seen)
    return out


def make_sampling_arrays(s: RowSampling, vocab_size: int) -> SamplingArrays:
    edits = _edits(s, vocab_size) if s.edits_logits or s.logprobs else {}
    if s.logprobs:
        edits["lp_k"] = min(max(k for _, k in s.logprobs), vocab_size)
    if s.all_greedy:
        return SamplingArrays(True, False, False, **edits)
    # Only the sampled rows are filtered and drawn from; greedy rows just take the argmax.
    rows = [i for i, t in enumerate(s.temperature) if t > 0]
    ks = [s.top_k[i] if 0 < s.top_k[i] < vocab_size else vocab_size for i in rows]
    ps = [s.top_p[i] for i in rows]
    min_ps = [s.min_p[i] for i in rows] if s.min_p else [0.0] * len(rows)
    # With every sampled row under a small top-k, filter and draw among the top-k candidates
    # only (same tokens as over the whole vocabulary: the same set and per-column noise).
    cand = max(ks) if max(ks) <= CANDIDATES_MAX and max(ks) < vocab_size else 0
    return SamplingArrays(
        all_greedy=False,
        any_top_k=any(k < vocab_size for k in ks),
        any_top_p=any(p < 1.0 for p in ps),
        sampled_rows=mx.array(rows, dtype=mx.int32),
        num_rows=len(s.temperature),
        candidates=cand,
        inv_temperature=mx.array([1.0 / s.temperature[i] for i in rows])[:, None],
        top_k=mx.array(ks, dtype=mx.int32)[:, None],
        top_p=mx.array(ps, dtype=mx.float32)[:, None],
        seed=mx.array([s.seed[i] & 0xFFFFFFFF for i in rows], dtype=mx.uint32)[:, None],
        log_min_p=(
            mx.array([math.log(p) if p > 0 else -math.inf for p in min_ps])[:, None]
            if any(p > 0 for p in min_ps)
            else None
        ),
        **edits,
    )


def count_lazy_outputs(
    s: SamplingArrays,
    rows: RowSampling,
    lazy_rows: dict[int, int],
    inputs: mx.array,
    vocab_size: int,
) -> SamplingArrays:
    """Penalized rows fed lazily (``lazy_rows``: sample row -> input index): their newest
    output is on the device only, so it is counted from the step's inputs there."""
    if s.counts is None:
        return s
    pen = [(j, lazy_rows[p[0]]) for j, p in enumerate(rows.penalties) if p[0] in lazy_rows]
    if not pen:
        return s
    idx = mx.array([j for j, _ in pen], dtype=mx.int32)
    toks = inputs[mx.array([t for _, t in pen], dtype=mx.int32)]
    one_hot = (mx.arange(vocab_size)[None] == toks[:, None]).astype(mx.float32)
    return replace(s, counts=s.counts.at[idx].add(one_hot))


def token_logprobs(
    logits: mx.array, s: SamplingArrays, tokens: mx.array
) -> tuple[mx.array, mx.array, mx.array] | None:
    """For the rows that asked: the sampled token's log-probability under the raw logits,
    and the top ``lp_k`` (ids, log-probabilities), best first."""
    if s.lp_rows is None:
        return None
    return logprobs_of(logits[s.lp_rows], tokens[s.lp_rows], s.lp_k)


def logprobs_of(logits: mx.array, tokens: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """Log-softmax of (N, V) logits: each row's ``tokens`` entry and its top ``k`` (ids and
    values, best first; at least one is computed). The (N, V) log-softmax itself is never
    formed: only the picked entries are shifted by the row's log-sum-exp, and the top is
    chosen on the logits (the same order), by argmax when one is wanted. On the CPU backend
    this is 2.5x faster for prompt log-probabilities, where N is the prompt length."""
    x = logits.astype(mx.float32)
    lse = mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(x, tokens.astype(mx.int32)[:, None], axis=-1) - lse
    if k <= 1:
        top = mx.argmax(x, axis=-1, keepdims=True).astype(mx.uint32)
        return chosen[:, 0], top, mx.take_along_axis(x, top, axis=-1) - lse
    top = mx.argpartition(x, x.shape[-1] - k, axis=-1)[:, -k:]
    top_lps = mx.take_along_axis(x, top, axis=-1) - lse
    order = mx.argsort(-top_lps, axis=-1)
    return (
        chosen[:, 0],
        mx.take_along_axis(top, order, axis=-1),
        mx.take_along_axis(top_lps, order, axis=-1),
    )


def advance(s: SamplingArrays, tokens: mx.array) -> SamplingArrays:
    """The sampling state of the next (chained) step: penalized rows count their new token."""
    if s.pen_rows is None:
        return s
    assert s.counts is not None
    n = s.counts.shape[0]
    one_hot = mx.arange(s.counts.shape[1])[None] == tokens[s.pen_rows][:, None]
    assert one_hot.shape[0] == n
    return replace(s, counts=s.counts + one_hot.astype(mx.float32))


def apply_edits(logits: mx.array, s: SamplingArrays, positions: mx.array | None) -> mx.array:
    """Add each row's logit_bias; mask its stop tokens while it is below min_tokens."""
    if not s.edits:
        return logits
    rows, vocab = logits.shape
    logits = logits.astype(mx.float32)
    if s.pen_rows is not None:
        assert s.counts is not None and s.prompt_seen is not None
        old = logits[s.pen_rows]
        seen = s.prompt_seen | (s.counts > 0)
        rep = s.repetition
        new = mx.where(seen, mx.where(old > 0, old / rep, old * rep), old)
        new = new - s.frequency * s.counts - s.presence * (s.counts > 0)
        # Scatter into zeros (exact) and select: the input array stays as it is.
        placed = mx.zeros_like(logits).at[s.pen_rows].add(new)
        is_pen = mx.zeros((rows, 1), dtype=mx.float32).at[s.pen_rows].add(1.0) > 0
        logits = mx.where(is_pen, placed, logits)
    flat = logits.reshape(-1)
    if s.bias_index is not None:
        flat = flat.at[s.bias_index].add(s.bias_value)
    if s.suppress_index is not None:
        assert positions is not None and s.min_position is not None
        early = (positions < s.min_position)[s.suppress_row]
        flat = flat.at[s.suppress_index].add(mx.where(early, -mx.inf, 0.0))
    return flat.reshape(rows, vocab)


def _mix(x: mx.array) -> mx.array:
    """A 32-bit avalanche hash (murmur3's finalizer)."""
    x = x ^ (x >> 16)
    x = x * mx.array(0x85EBCA6B, dtype=mx.uint32)
    x = x ^ (x >> 13)
    x = x * mx.array(0xC2B2AE35, dtype=mx.uint32)
    return x ^ (x >> 16)


def uniform_noise(
    seed: mx.array, positions: mx.array, vocab_size: int, cols: mx.array | None = None
) -> mx.array:
    """(R, V) — or (R, K) at ``cols`` — floats in (0, 1), a pure function of (seed, position,
    column)."""
    row_key = _mix(seed ^ _mix(positions.astype(mx.uint32)[:, None] * _GOLDEN + 1))
    if cols is None:
        cols = mx.arange(vocab_size, dtype=mx.uint32)[None]
    bits = _mix(row_key + cols.astype(mx.uint32) * mx.array(_GOLDEN, dtype=mx.uint32))
    return ((bits >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))


def apply_grammar(logits: mx.array, rows: mx.array, masks: mx.array) -> mx.array:
    """-inf outside each constrained row's allowed tokens. ``masks`` (C, W) int32 bitmasks
    (bit b of word w allows token 32 w + b) for the logits rows ``rows`` (C,)."""
    vocab = logits.shape[-1]
    shifts = mx.arange(32, dtype=mx.uint32)
    bits = (masks.astype(mx.uint32)[:, :, None] >> shifts) & 1
    allowed = bits.reshape(masks.shape[0], -1)[:, :vocab] > 0
    # Select, never add: a disallowed logit that an edit made +inf must still end up -inf.
    out = mx.array(logits)  # a new array: the caller's logits stay as they are
    out[rows] = mx.where(allowed, logits[rows], -mx.inf)
    return out


def sample(
    logits: mx.array,
    s: SamplingArrays,
    positions: mx.array | None,
    grammar: tuple[mx.array, mx.array] | None = None,
) -> mx.array:
    """logits (R, V) → tokens (R,) uint32. ``positions`` may be None when
    ``s.needs_positions`` is False (all greedy, no min_tokens). ``grammar``: (rows, bitmasks)
    of constrained rows (apply_grammar), applied after every other edit."""
    logits = apply_edits(logits, s, positions)
    if grammar is not None:
        logits = apply_grammar(logits, *grammar)
    greedy_tokens = mx.argmax(logits, axis=-1)
    if s.all_greedy:
        return greedy_tokens
    assert positions is not None and s.sampled_rows is not None
    rows = s.sampled_rows
    x = logits[rows].astype(mx.float32) * s.inv_temperature
    pos = positions[rows]
    draw = _draw_candidates if s.candidates else _draw_full
    sampled = draw(x, s, pos)
    if s.num_rows == x.shape[0]:
        return sampled.astype(greedy_tokens.dtype)
    n = s.num_rows
    placed = mx.zeros((n,), dtype=mx.int32).at[rows].add(sampled.astype(mx.int32))
    is_sampled = mx.zeros((n,), dtype=mx.int32).at[rows].add(1) > 0
    return mx.where(is_sampled, placed.astype(greedy_tokens.dtype), greedy_tokens)


def _filter_sorted(desc: mx.array, s: SamplingArrays) -> mx.array:
    """Top-k then top-p on descending (already min-p filtered) logits: -inf outside."""
    if s.any_top_k:
        ranks = mx.arange(desc.shape[-1], dtype=mx.int32)[None]
        desc = mx.where(ranks < s.top_k, desc, -mx.inf)
    if s.any_top_p:
        probs = mx.softmax(desc, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        before = mx.cumsum(probs, axis=-1) - probs
        keep = mx.sum(before < s.top_p, axis=-1, keepdims=True)
        cutoff = mx.take_along_axis(desc, keep - 1, axis=-1)
        desc = mx.where(desc >= cutoff, desc, -mx.inf)
    return desc


def _draw_full(x: mx.array, s: SamplingArrays, pos: mx.array) -> mx.array:
    vocab = x.shape[-1]
    if s.log_min_p is not None:
        # p >= min_p * p_max  <=>  x >= x_max + log(min_p)   (x already divided by T)
        x = mx.where(x >= mx.max(x, axis=-1, keepdims=True) + s.log_min_p, x, -mx.inf)
    if s.any_top_k or s.any_top_p:
        desc = -mx.sort(-x, axis=-1)
        if s.any_top_k:
            kth = mx.take_along_axis(desc, s.top_k - 1, axis=-1)
            x = mx.where(x >= kth, x, -mx.inf)
        if s.any_top_p:
            filtered = _filter_sorted(desc, s)
            cutoff = mx.min(mx.where(filtered > -mx.inf, filtered, mx.inf), axis=-1, keepdims=True)
            x = mx.where(x >= cutoff, x, -mx.inf)
    u = uniform_noise(s.seed, pos, vocab)
    return mx.argmax(x - mx.log(-mx.log(u)), axis=-1)


def _draw_candidates(x: mx.array, s: SamplingArrays, pos: mx.array) -> mx.array:
    k = s.candidates
    idx = mx.argpartition(-x, k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(x, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    idx = mx.take_along_axis(idx, order, axis=-1)
    desc = mx.take_along_axis(vals, order, axis=-1)
    if s.log_min_p is not None:
        desc = mx.where(desc >= desc[:, :1] + s.log_min_p, desc, -mx.inf)
    desc = _filter_sorted(desc, s)
    u = uniform_noise(s.seed, pos, x.shape[-1], cols=idx)
    choice = mx.argmax(desc - mx.log(-mx.log(u)), axis=-1)
    return mx.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]
