"""A launched step's lazy outputs (``ModelRunner.launch``) and their plain-Python result
(``ModelRunner.finalize``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from tandem.engine.plan import StepPlan, StepResult
from tandem.runner.sampler import LogprobArrays, SamplingArrays, logprob_entries


@dataclass
class Handle:
    """A launched step: only its lazy outputs, never the KV buffers (they must stay
    donatable so the next step's in-place writes don't copy them) — except while it is held
    back unsubmitted (``unsubmitted``): from its build to its submission at the next step,
    before which no other step is built."""

    plan: StepPlan
    tokens: mx.array | None  # None until the sampling is attached (constrained rows)
    sampling: SamplingArrays
    logprobs: LogprobArrays | None = None
    # Prompt log-probabilities of segments that asked: (request id, k, arrays).
    prompt_logprobs: list[tuple[str, int, LogprobArrays]] | None = None
    # A forward waiting for its grammar masks: (logits, sampling arrays, positions).
    pending: tuple[mx.array, SamplingArrays, mx.array | None] | None = None
    # The plan's draft proposals: all in one array, and each proposing query's indices.
    drafted: tuple[mx.array, list[tuple[str, list[int]]]] | None = None
    draft_failed: bool = False
    # Built and held back (``launch(submit=False)``): what ``submit`` evaluates (a hybrid's
    # model calls already went on the CPU, its sampling not: recurrent_step.submit_call).
    unsubmitted: list[Any] | None = None

    def result(self) -> StepResult:
        """Block on the step's outputs; plain Python values."""
        assert self.tokens is not None, "finalize() of a step still waiting for its masks"
        assert self.unsubmitted is None, "finalize() of a step never submitted"
        tokens = tuple(self.tokens.tolist())
        prompt = None
        if self.prompt_logprobs:
            prompt = {}
            for rid, k, arrays in self.prompt_logprobs:
                prompt[rid] = prompt.get(rid, []) + logprob_entries(arrays, [k] * arrays[0].size)
        drafted, failed = None, self.draft_failed
        if self.drafted is not None:
            flat = self.drafted[0].tolist()
            drafted = {rid: tuple(flat[j] for j in w) for rid, w in self.drafted[1]}
        by_row = None
        if self.logprobs is not None:
            rows = self.plan.sampling.logprobs
            entries = logprob_entries(self.logprobs, [k for _, k in rows])
            by_row = {row: e for (row, _), e in zip(rows, entries, strict=True)}
        return StepResult(self.plan.step_id, tokens, by_row, prompt, drafted, failed)
