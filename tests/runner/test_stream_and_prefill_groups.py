"""Streaming API abort and the grouping of decode attention by length."""

from __future__ import annotations

from tandem import LLM, SamplingParams
from tandem.runner.step_groups import group_decodes


def test_closing_a_stream_aborts_the_request_and_frees_its_pages(tiny_model_dir):
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
    assert sched.kv.num_held == 0 and not sched.running


def test_decodes_are_grouped_with_bounded_padding():
    lengths = [100, 98, 95, 10, 9, 500]
    groups = group_decodes(lengths)
    sizes = [[lengths[i] for i in g] for g in groups]
    assert sizes == [[500], [100, 98, 95], [10, 9]]
    for g in groups:
        longest = lengths[g[0]]
        assert longest * len(g) <= 1.25 * sum(lengths[i] for i in g)
