"""Sampling rows: the per-row parameters of a step's sampled positions, built from request
state (one row per sampled segment, in the plan's sample-row order)."""

from __future__ import annotations

from tandem.engine.plan import RowSampling
from tandem.engine.request import Request


def row_sampling(
    reqs: list[Request], drafted: dict[int, tuple[int, ...]] | None = None
) -> RowSampling:
    """``drafted``: rows of verify segments (engine/speculation.py) whose position comes
    after proposed tokens; a penalty counts those as output already."""
    drafted = drafted or {}
    temps, ks, ps, seeds, min_ps, min_pos = [], [], [], [], [], []
    bias: list[tuple[int, int, float]] = []
    suppress: list[tuple[int, int]] = []
    pens: list[tuple[int, float, float, float, tuple[int, ...], tuple[int, ...]]] = []
    lps: list[tuple[int, int]] = []
    constrained: list[int] = []
    for row, req in enumerate(reqs):
        p = req.params
        temps.append(p.temperature)
        ks.append(p.top_k)
        ps.append(p.top_p)
        seeds.append(req.seed)
        min_ps.append(p.min_p)
        limit = 0
        bias.extend((row, t, b) for t, b in p.logit_bias)
        if p.logprobs is not None:
            lps.append((row, p.logprobs))
        if req.grammar is not None:
            constrained.append(row)
        if p.penalized:
            pens.append(
                (
                    row,
                    p.presence_penalty,
                    p.frequency_penalty,
                    p.repetition_penalty,
                    tuple(req.prompt_token_ids) if p.repetition_penalty != 1 else (),
                    tuple(req.output_token_ids) + drafted.get(row, ()),
                )
            )
        if p.min_tokens and req.stop_ids:
            # Output i is sampled at position prompt_len - 1 + i.
            limit = req.num_prompt_tokens - 1 + p.min_tokens
            suppress.extend((row, t) for t in sorted(req.stop_ids))
        min_pos.append(limit)
    return RowSampling(
        tuple(temps),
        tuple(ks),
        tuple(ps),
        tuple(seeds),
        min_p=tuple(min_ps) if any(min_ps) else (),
        logit_bias=tuple(bias),
        min_position=tuple(min_pos) if suppress else (),
        suppress=tuple(suppress),
        penalties=tuple(pens),
        logprobs=tuple(lps),
        constrained=tuple(constrained),
    )
