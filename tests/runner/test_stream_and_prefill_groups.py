"""Streaming API abort and the batched first-chunk grouping."""

from __future__ import annotations

from tandem import LLM, SamplingParams
from tandem.engine.plan import PrefillChunk
from tandem.runner.model_runner import group_first_chunks


def test_closing_a_stream_aborts_the_request_and_frees_its_row(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), check_invariants=True)
    full = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[
        0
    ]
    stream = llm.stream([5, 6, 7], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    seen = []
    for out in stream:
        seen = out.token_ids
        if len(seen) >= 3:
            break
    stream.close()
    assert seen == full.token_ids[: len(seen)]
    sched = llm.engine.scheduler
    assert not llm.engine.has_unfinished()
    assert sched.rows.num_owned == 0 and not sched.running


def chunk(n: int, row: int) -> PrefillChunk:
    return PrefillChunk(f"r{row}", row, 0, tuple(range(n)))


def test_first_chunks_are_grouped_with_bounded_padding():
    groups = group_first_chunks([chunk(n, i) for i, n in enumerate([100, 98, 95, 10, 9, 500])])
    sizes = [[len(c.token_ids) for c in g] for g in groups]
    assert sizes == [[500], [100, 98, 95], [10, 9]]
    for g in groups:
        longest = len(g[0].token_ids)
        assert longest * len(g) <= 1.25 * sum(len(c.token_ids) for c in g)
