"""Draft-model speculative decoding on real tiny models: greedy output equal to mlx-lm's
``generate_step`` with a draft of another architecture (which proposes poorly: the rejection
path) and with the target as its own draft (which proposes perfectly: every proposal must
be accepted, which checks the draft's paged KV), under staggered arrivals, prefix hits, stop
tokens, aborts and 4-position pages, overlap on and off; sampled and guided rows; a draft
with another tokenizer refused at load."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from test_mlx_lm_parity import greedy, reference, run_staggered
from test_speculative import guided_exact, penalized

from tandem import LLM, SamplingParams
from tandem.runner.static_decode import cpu_compiler


def draft_llm(target, draft, **options) -> LLM:
    return LLM(
        str(target),
        speculative="draft",
        draft_model=str(draft),
        num_speculative_tokens=4,
        check_invariants=True,
        speculative_min_gain=0,  # from the first decode step on, whatever the times say
        **options,
    )


@pytest.mark.parametrize("overlap", [True, False])
def test_self_draft_is_accepted_and_staggered_requests_match_mlx_lm(tiny_model_dir, overlap):
    path = tiny_model_dir("llama")
    llm = draft_llm(path, path, overlap=overlap, kv_page_size=4, max_num_seqs=32)
    run_staggered(llm, path, random.Random(f"draft{overlap}"))
    stats = llm.engine.scheduler.stats
    # The target drafting for itself: every proposal its own greedy token, unless a
    # request's draft KV were not its history (float32 rounding may part a near-tie).
    assert stats.spec_proposed > 50
    assert stats.spec_accepted >= 0.97 * stats.spec_proposed


def test_another_architecture_drafts_exactly(tiny_model_dir):
    target, draft = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    results = []
    for overlap in (True, False):
        llm = draft_llm(target, draft, overlap=overlap, max_num_seqs=32)
        results.append(run_staggered(llm, target, random.Random("cross")))
        assert llm.engine.scheduler.stats.spec_proposed > 0
    assert results[0] == results[1]


def test_long_accepted_runs_cross_pages(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(7)] * 3 for _ in range(3)]
    llm = draft_llm(path, path, kv_page_size=4, compile_decode=16)
    outs = llm.generate(prompts, greedy(64))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(path, prompt, 64)
    assert llm.engine.loop.num_steps < 3 * 64 / 3  # about K + 1 tokens a step
    # The draft's proposals after the first are single-token steps, and its catch-up chunks
    # (the accepted tokens, then the first proposal) a row per position, compiled where MLX
    # compiles (runner/static_decode.py): most replay a trace.
    static = llm.engine.loop.runner.draft.runner.static
    if cpu_compiler():  # (where MLX compiles; a failed compiled step would turn it off)
        assert static is not None
        assert static.replays > 2 * static.traces
        assert static.verifies > 5
        # Steps that met a new shape of either model are not timed (spec_gain): a few of
        # them, each marking itself and at most the step in flight.
        loop = llm.engine.loop
        assert loop.runner.shapes == len(loop.runner.static.shapes) + len(static.shapes)
        assert 0 < loop.num_fresh <= min(2 * loop.runner.shapes, loop.num_steps)


def test_sampled_rows_draw_what_plain_decoding_draws(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompt = [21, 22, 23, 24, 25] * 3
    params = [
        SamplingParams(
            max_tokens=20,
            temperature=(0.5, 1.0)[s % 2],
            top_p=(1.0, 0.9)[s % 2],
            seed=s,
            ignore_eos=True,
        )
        for s in range(12)
    ]
    plain = LLM(str(path)).generate([prompt] * 12, params)
    llm = draft_llm(path, path, speculative_max_batch=16)
    spec = llm.generate([prompt] * 12, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.engine.scheduler.stats
    assert 0 < stats.spec_accepted < stats.spec_proposed  # greedy drafts, sampled targets


def test_guided_requests_draft_valid_and_exact(tiny_model_dir):

    path = tiny_model_dir("llama")
    guided_exact(LLM(str(path)), draft_llm(path, path, speculative_max_batch=64), seed=5)


def test_a_draft_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    other = tmp_path / "other"
    shutil.copytree(path, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        draft_llm(path, other)


def test_draft_model_and_method_go_together(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="go together"):
        LLM(path, speculative="draft")
    with pytest.raises(ValueError, match="go together"):
        LLM(path, speculative="ngram", draft_model=path)


def test_hybrid_draft_is_refused(tiny_model_dir, family_model_dir):
    with pytest.raises(ValueError, match="recurrent layers"):
        draft_llm(tiny_model_dir("llama"), family_model_dir("qwen3_next"))


def test_penalized_rows_draft_before_the_step_and_match(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompt = [31, 32, 33, 34] * 4
    params = penalized(6, 24)
    plain = LLM(str(path)).generate([prompt] * 6, params)
    llm = draft_llm(path, path)
    spec = llm.generate([prompt] * 6, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.scheduler.stats.spec_accepted > 0


def test_a_failing_draft_costs_proposals_not_tokens(tiny_model_dir, monkeypatch):
    """The draft's graph fails to build in some steps: zeros are verified instead, the
    draft's pool is rebuilt, and the output is still exact."""
    from tandem.runner.draft import DraftModel

    path = tiny_model_dir("llama")
    prompts = [[41, 42, 43, 44, 45] * 3, [7, 8, 9] * 5]
    plain = LLM(str(path)).generate(prompts, greedy(40))
    build, calls = DraftModel.build, []

    def flaky(self, queries):
        calls.append(1)
        if len(calls) in (2, 5):
            raise RuntimeError("injected draft failure")
        return build(self, queries)

    monkeypatch.setattr(DraftModel, "build", flaky)
    llm = draft_llm(path, path)
    spec = llm.generate(prompts, greedy(40))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.engine.scheduler.stats
    assert len(calls) >= 5 and stats.step_failures == 0 and stats.spec_accepted > 0
    assert llm.engine.loop.runner.draft.failures == 0  # back to working after each


def test_long_prompts_catch_up_over_several_steps_and_retract(tiny_model_dir):
    """Prompts longer than a step's token budget: the draft catches up a budget at a time
    (steps whose draft queries only catch up), and a small pool retracts requests (their
    draft KV starts over); exact, and the target drafting for itself is accepted."""
    path = tiny_model_dir("llama")
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(60, 110))] for _ in range(6)]
    llm = draft_llm(path, path, max_num_batched_tokens=32, kv_budget_tokens=400, kv_page_size=4)
    outs = llm.generate(prompts, greedy(40))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(path, prompt, 40)
    stats = llm.engine.scheduler.stats
    assert stats.retractions > 0
    assert stats.spec_proposed > 50 and stats.spec_accepted >= 0.97 * stats.spec_proposed
    assert llm.engine.loop.runner.draft.failures == 0
