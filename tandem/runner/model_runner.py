"""The model runner: turns frozen step plans into lazy MLX graphs (launch) and plain tokens
(finalize). The only engine code that touches MLX; it never sees request objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tandem.engine.grammar import words_for
from tandem.engine.plan import PrefillChunk, StepPlan, StepResult
from tandem.runner.kv import ROW_STEP, KVPool, KVShape
from tandem.runner.sampler import (
    SamplingArrays,
    advance,
    logprobs_of,
    make_sampling_arrays,
    sample,
    token_logprobs,
)


@dataclass
class Handle:
    """A launched step: only its lazy outputs, never the KV buffers (they must stay
    donatable so the next step's in-place writes don't copy them)."""

    plan: StepPlan
    tokens: mx.array | None  # None until the sampling is attached (constrained rows)
    sampling: SamplingArrays
    logprobs: tuple[mx.array, mx.array, mx.array] | None = None
    # Prompt log-probabilities of chunks that asked: (request id, k, arrays).
    prompt_logprobs: list[tuple[str, int, tuple[mx.array, mx.array, mx.array]]] | None = None
    # A forward waiting for its grammar masks: (logits, sampling arrays, positions).
    pending: tuple[mx.array, SamplingArrays, mx.array | None] | None = None


MAX_PADDING = 0.25  # padded tokens allowed per batched first-chunk forward


def group_first_chunks(chunks: list[PrefillChunk]) -> list[list[PrefillChunk]]:
    """Group chunks of similar length so right-padding wastes at most ~MAX_PADDING."""
    groups: list[list[PrefillChunk]] = []
    real = 0
    for c in sorted(chunks, key=lambda c: -len(c.token_ids)):
        n = len(c.token_ids)
        if groups:
            g = groups[-1]
            longest = len(g[0].token_ids)
            if longest * (len(g) + 1) <= (1 + MAX_PADDING) * (real + n):
                g.append(c)
                real += n
                continue
        groups.append([c])
        real = n
    return groups


def _entries(
    arrays: tuple[mx.array, mx.array, mx.array], ks: list[int]
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """(chosen, top ids, top values) → per row: (log-probability, its top ``ks[i]`` pairs)."""
    chosen, top_ids, top_lps = (a.tolist() for a in arrays)
    return [
        (c, tuple(zip(i[:k], v[:k], strict=True)))
        for c, i, v, k in zip(chosen, top_ids, top_lps, ks, strict=True)
    ]


def _chunk_logprobs(
    logits: mx.array, chunk: PrefillChunk
) -> tuple[str, int, tuple[mx.array, mx.array, mx.array]]:
    """Log-probabilities of each chunk position's next token (the chunk's own tokens shifted
    by one, then the token after it) and the top ``chunk.logprobs`` there."""
    nxt = mx.array(list(chunk.token_ids[1:]) + [chunk.next_token], dtype=mx.int32)
    return chunk.request_id, chunk.logprobs, logprobs_of(logits, nxt, chunk.logprobs)


class _ProbeCache:
    def __init__(self) -> None:
        self.offset = 0
        self.seen: tuple[tuple[int, ...], mx.Dtype] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.seen = (tuple(keys.shape), keys.dtype)
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return None


def check_supported(model: nn.Module, model_type: str) -> None:
    """Only full-attention KV models fit the row layout; say so instead of misbehaving."""
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        return
    from mlx_lm.models.cache import KVCache

    kinds = {type(c).__name__ for c in make_cache() if type(c) is not KVCache}
    if kinds:
        raise ValueError(
            f"model type {model_type!r} uses {', '.join(sorted(kinds))} caches "
            "(sliding-window or recurrent layers), which Tandem does not support yet"
        )


def probe_kv_shape(model: nn.Module) -> tuple[KVShape, int]:
    """Run one token through the model to learn the KV geometry and the vocabulary size."""
    caches = [_ProbeCache() for _ in model.layers]
    logits = model(mx.array([[0]]), cache=caches)
    seen = {c.seen for c in caches}
    if None in seen or len(seen) != 1:
        raise ValueError("model layers have differing KV shapes; not supported")
    (shape, dtype) = seen.pop()
    kv = KVShape(num_layers=len(caches), num_kv_heads=shape[1], head_dim=shape[3], dtype=dtype)
    return kv, int(logits.shape[-1])


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        *,
        max_rows: int,
        model_type: str = "",
        overlap: bool = True,
        double_buffer: bool | None = None,
        row_step: int = ROW_STEP,
    ) -> None:
        """``double_buffer``: two KV buffer sets so a step never writes what the step still in
        flight reads (runner/kv.py). None picks it where it was measured to pay: with overlap
        on the CPU backend (whole-buffer copies otherwise); on the H200 one set was faster."""
        check_supported(model, model_type)
        self.model = model
        self.stream = mx.new_stream(mx.default_device())
        with mx.stream(self.stream):
            kv_shape, self.vocab_size = probe_kv_shape(model)
        if double_buffer is None:
            double_buffer = overlap and mx.default_device() == mx.cpu
        self.kv = KVPool(kv_shape, max_rows, double_buffer=double_buffer, row_step=row_step)
        self.words = words_for(self.vocab_size)

    def launch(
        self, plan: StepPlan, parent: Handle | None, masks: np.ndarray | None = None
    ) -> Handle:
        with mx.stream(self.stream):
            needed_rows = max(
                [plan.num_rows, plan.kv_rows]
                + [c.row + 1 for c in plan.chunks]
                + [max(c.src, c.dst) + 1 for c in plan.copies]
            )
            self.kv.begin_step(needed_rows, plan.capacity)
            for c in plan.copies:
                self.kv.copy_prefix(c.src, c.dst, c.length)
            prompt_lps = self._prefill(plan.chunks)
            if plan.chained:
                assert parent is not None and parent.tokens is not None
                tokens_in, sampling = parent.tokens, parent.sampling
            else:
                tokens_in = mx.array(plan.input_tokens, dtype=mx.int32)
                sampling = make_sampling_arrays(plan.sampling, self.vocab_size)
            # Positions go to the device only when something needs them (ragged rows, noise).
            positions = (
                mx.array(plan.positions, dtype=mx.int32) if sampling.needs_positions else None
            )
            caches = self.kv.batch_caches(plan.positions, positions)
            logits = self.model(tokens_in[:, None], cache=caches)[:, -1, :]
            handle = Handle(plan, None, sampling, None, prompt_lps or None)
            if plan.sampling.constrained and masks is None:
                # Keep the device busy with the forward; the sampling follows the masks.
                handle.pending = (logits, sampling, positions)
                mx.async_eval(logits, *self.kv.arrays())
                return handle
            mx.async_eval(
                *self._sample(handle, logits, sampling, positions, masks), *self.kv.arrays()
            )
        return handle

    def complete(self, handle: Handle, masks: np.ndarray) -> None:
        """Attach the sampling of a forward launched without its grammar masks."""
        assert handle.pending is not None, "complete() of a step that is not waiting"
        logits, sampling, positions = handle.pending
        handle.pending = None
        with mx.stream(self.stream):
            mx.async_eval(*self._sample(handle, logits, sampling, positions, masks))

    def _sample(
        self,
        handle: Handle,
        logits: mx.array,
        sampling: SamplingArrays,
        positions: mx.array | None,
        masks: np.ndarray | None,
    ) -> list[mx.array]:
        """Attach the sampling graph to ``handle``; returns the arrays to evaluate."""
        grammar = None
        if masks is not None:
            rows = mx.array(handle.plan.sampling.constrained, dtype=mx.int32)
            grammar = (rows, mx.array(masks))
        tokens = sample(logits, sampling, positions, grammar)
        lps = token_logprobs(logits, sampling, tokens)
        handle.tokens, handle.sampling, handle.logprobs = tokens, advance(sampling, tokens), lps
        return [tokens, *(lps or ())]

    def _prefill(
        self, chunks: tuple[PrefillChunk, ...]
    ) -> list[tuple[str, int, tuple[mx.array, mx.array, mx.array]]]:
        """Cache-only forwards: their logits are never evaluated, so never computed — except
        for chunks that asked for prompt log-probabilities (returned, lazily).

        First chunks of several prompts share one right-padded forward; continuation chunks
        read their row's earlier KV and run one by one. Each forward is submitted on its own:
        in one shared graph a later write could be scheduled before an earlier read of the same
        buffer, and MLX would then copy the buffer instead of writing in place.
        """
        out: list[tuple[str, int, tuple[mx.array, mx.array, mx.array]]] = []
        for group in group_first_chunks([c for c in chunks if c.start == 0]):
            length = max(len(c.token_ids) for c in group)
            tokens = mx.array(
                [list(c.token_ids) + [0] * (length - len(c.token_ids)) for c in group],
                dtype=mx.int32,
            )
            logits = self.model(
                tokens, cache=self.kv.first_chunk_caches([c.row for c in group], length)
            )
            for b, c in enumerate(group):
                if c.logprobs >= 0:
                    out.append(_chunk_logprobs(logits[b, : len(c.token_ids)], c))
            mx.async_eval(*[a for _, _, arrs in out for a in arrs], *self.kv.arrays())
        for chunk in chunks:
            if chunk.start > 0:
                logits = self.model(
                    mx.array(chunk.token_ids, dtype=mx.int32)[None],
                    cache=self.kv.row_caches(chunk.row, chunk.start),
                )
                if chunk.logprobs >= 0:
                    out.append(_chunk_logprobs(logits[0], chunk))
                mx.async_eval(*[a for _, _, arrs in out for a in arrs], *self.kv.arrays())
        return out

    def finalize(self, handle: Handle) -> StepResult:
        assert handle.tokens is not None, "finalize() of a step still waiting for its masks"
        tokens = tuple(handle.tokens.tolist())
        prompt = None
        if handle.prompt_logprobs:
            prompt = {}
            for rid, k, arrays in handle.prompt_logprobs:
                prompt[rid] = prompt.get(rid, []) + _entries(arrays, [k] * arrays[0].size)
        if handle.logprobs is None:
            return StepResult(handle.plan.step_id, tokens, None, prompt)
        rows = handle.plan.sampling.logprobs
        entries = _entries(handle.logprobs, [k for _, k in rows])
        by_row = {row: e for (row, _), e in zip(rows, entries, strict=True)}
        return StepResult(handle.plan.step_id, tokens, by_row, prompt)
