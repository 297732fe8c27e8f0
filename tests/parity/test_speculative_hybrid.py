"""Speculative decoding on models with recurrent layers (Gated DeltaNet beside attention,
Mamba-2 alone and beside attention in one layer): a verify advances the state over every
token it feeds, so each keeps the state after each of its positions (runner/positions.py)
or, where the runner cannot see them, the state it starts from in a snapshot slot, and a
rejected proposal resumes from the state after its last accepted token or is rolled back
by replaying the accepted tokens from the backup. Greedy output equals
mlx-lm's ``generate_step`` whatever was accepted: an oracle proposer (mlx-lm's own
continuation, corrupted at a random position half the time) makes verifies that accept
everything, some or nothing; the n-gram proposer runs too."""

from __future__ import annotations

import random

import pytest
from test_mlx_lm_parity import greedy, reference

from tandem import LLM
from tandem.engine import speculation
from tandem.testing.families import RECURRENT

# Several requests speculating at once (the default for these models is one at a time).
# (Speculating from the first decode step on, whatever the step times say.)
SPEC = {
    "speculative": "ngram",
    "num_speculative_tokens": 4,
    "speculative_max_batch": 8,
    "speculative_min_gain": 0,
}
N = 30


def prompts_for(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(3, 40))] for _ in range(6)]


def oracle(monkeypatch, path, prompts: list[list[int]], seed: int) -> None:
    """Proposals of mlx-lm's continuation; half of them wrong from a random position on."""
    from tandem.bench.speculative import oracle as make

    refs = [reference(path, p, N) for p in prompts]
    monkeypatch.setattr(speculation, "propose", make(prompts, refs, 0.5, 500, seed))


def replaying(monkeypatch) -> None:
    """Rejected proposals replay, as for layers whose states per position the runner cannot
    see (runner/positions.py)."""
    monkeypatch.setattr("tandem.runner.model_runner.install_positions", lambda *a: False)


@pytest.mark.parametrize("model_type", RECURRENT)
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("per_position", [True, False])
def test_verifies_accepting_all_some_or_none_match_mlx_lm(
    family_model_dir, monkeypatch, model_type, overlap, per_position
):
    path = family_model_dir(model_type)
    prompts = prompts_for(1)
    oracle(monkeypatch, path, prompts, seed=2)
    if not per_position:
        replaying(monkeypatch)
    llm = LLM(str(path), overlap=overlap, check_invariants=True, kv_page_size=4, **SPEC)
    assert llm.engine.scheduler.config.speculation.per_position == per_position
    outs = llm.generate(prompts, greedy(N))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference(path, p, N)
    stats = llm.engine.scheduler.stats
    assert 0 < stats.spec_accepted < stats.spec_proposed
    # Fewer steps than one token a step per request would take.
    assert llm.engine.loop.num_steps < N
    kv = llm.engine.scheduler.kv
    assert kv.states.num_free == kv.states.num - len(kv.tree.snapshot_refs())


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("per_position", [True, False])
def test_hits_on_cached_states_and_aborts_with_speculation(
    family_model_dir, monkeypatch, prefix_cache, per_position
):
    """A second turn resuming from the first's cached state, requests sharing a prefix,
    one aborted mid-run; with the prefix cache off the snapshot slots are backups only."""
    if not per_position:
        replaying(monkeypatch)
    path = family_model_dir("qwen3_next")
    base = prompts_for(3)[0] + [7] * 9
    prompts = [base, base + [11, 12], base[:20] + [13]]
    first = reference(path, base, N)
    prompts.append(base + first + [9, 10])
    oracle(monkeypatch, path, prompts, seed=4)
    llm = LLM(
        str(path),
        check_invariants=True,
        kv_page_size=4,
        max_num_batched_tokens=16,
        prefix_cache=prefix_cache,
        **SPEC,
    )
    assert llm.generate([base], greedy(N))[0].token_ids == first
    engine = llm.engine
    ids = [engine.add_request(p, greedy(N)) for p in prompts]
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            got[out.request_id] += out.new_token_ids
        steps += 1
        if steps == 6:
            engine.abort(ids[1])
    for rid, p in zip(ids, prompts, strict=True):
        want = reference(path, p, N)
        assert got[rid] == (want[: len(got[rid])] if rid == ids[1] else want), rid
    stats = engine.scheduler.stats
    assert stats.spec_accepted > 0
    assert (stats.hit_tokens > 0) == prefix_cache


def test_ngram_proposals_on_a_hybrid_model_match_mlx_lm(family_model_dir):
    """The real proposer: on a random model most of its proposals are rejected (replays)."""
    path = family_model_dir("qwen3_next")
    prompts = [p * 3 for p in prompts_for(5)]
    llm = LLM(str(path), check_invariants=True, kv_page_size=4, **SPEC)
    outs = llm.generate(prompts, greedy(N))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference(path, p, N)
    assert llm.engine.scheduler.stats.spec_verifies > 0


def test_recurrent_models_speculate_in_batches_by_default(family_model_dir, tiny_model_dir):
    """Verifies of one length run as one (B, K + 1) call, so up to 8 decoding requests
    speculate by default as on other models. Their backup slots (two per speculating
    request) come on top of the prefix cache's, and --state-snapshots 0 still means no
    prefix cache. Where verifies keep their states per position, K + 1 ids per speculating
    request come after those (ids only: the runner holds those states, no pool memory)."""
    ngram = {"speculative": "ngram"}
    hybrid = LLM(str(family_model_dir("qwen3_next")), max_num_seqs=4, **ngram).engine.scheduler
    spec = hybrid.config.speculation
    assert spec.max_batch == 8 and spec.per_position
    assert hybrid.kv.tree is not None and hybrid.kv.states.num == 64 + 16
    positions = hybrid.kv.positions
    assert positions.num == (spec.num_tokens + 1) * 8 and positions.first == 4 + 64 + 16
    ssm = LLM(str(family_model_dir("mamba2")), max_num_seqs=4, **ngram).engine.scheduler
    assert ssm.config.speculation.per_position and ssm.kv.states.num == 64 + 16
    plain = LLM(str(tiny_model_dir("llama")), **ngram).engine.scheduler
    assert plain.config.speculation.max_batch == 8
    off = LLM(str(family_model_dir("qwen3_next")), state_snapshots=0, **ngram).engine.scheduler
    assert off.kv.tree is None and off.kv.states.num == 16


def _spy(monkeypatch) -> list[tuple[int, int, bool]]:
    """Each group of multi-token segments that shares its calls: (rows, tokens per row,
    whether its rows are verifies: keep backups or their states per position)."""
    from tandem.runner import recurrent_step

    calls: list[tuple[int, int, bool]] = []
    sequences = recurrent_step._sequences

    def counting(runner, segments, group, *args):
        first = segments[group[0]]
        verify = first.state_backup >= 0 or bool(first.state_positions)
        calls.append((len(group), first.num_tokens, verify))
        return sequences(runner, segments, group, *args)

    monkeypatch.setattr(recurrent_step, "_sequences", counting)
    return calls


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1"])
def test_verifies_of_one_length_run_as_one_call(family_model_dir, monkeypatch, model_type):
    """Equally long verifies of several requests go through the model together, each row
    its own state and backup (or states per position): the outputs equal mlx-lm's."""
    calls = _spy(monkeypatch)
    path = family_model_dir(model_type)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(13)] for _ in range(6)]
    oracle(monkeypatch, path, prompts, seed=8)
    llm = LLM(str(path), check_invariants=True, kv_page_size=4, **SPEC)
    calls.clear()  # (the load check's)
    outs = llm.generate(prompts, greedy(N))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference(path, p, N)
    verifies = [rows for rows, n, backup in calls if backup and n == 5]
    assert verifies and max(verifies) >= 3  # several verifies of K + 1 in one call


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2", "falcon_h1"])
def test_prompts_of_one_length_prefill_as_one_call(family_model_dir, monkeypatch, model_type):
    """Prompts of one length starting together share their calls, reading no state: one
    (B, n) call without the prefix cache; with it, two, cut where each row's state is kept
    for the cache (position 8, its last page boundary) and copied out between them; chunked
    under a smaller budget, the prompts the budget takes whole still share theirs."""
    calls = _spy(monkeypatch)
    path = family_model_dir(model_type)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(11)] for _ in range(4)]
    # Whole prompts, then chunks of 11 + 11 + 2 (the last alone); with and without snapshots.
    for chunk, cache in ((2048, False), (24, False), (2048, True)):
        llm = LLM(
            str(path),
            check_invariants=True,
            kv_page_size=4,
            prefix_cache=cache,
            max_num_batched_tokens=chunk,
        )
        runner = llm.engine.loop.runner
        shapes, call = [], runner.call

        def recording(ctx, inputs, *args, call=call, shapes=shapes):
            shapes.append(tuple(inputs.shape) if ctx.sequence else None)
            return call(ctx, inputs, *args)

        runner.call = recording
        calls.clear()
        outs = llm.generate(prompts, greedy(12))
        for p, o in zip(prompts, outs, strict=True):
            assert o.token_ids == reference(path, p, 12)
        assert (4, 11, False) in calls if chunk == 2048 else (2, 11, False) in calls
        if cache:  # cut at 8, where each row's state is kept for the cache
            assert (4, 8) in shapes and (4, 3) in shapes
        elif chunk == 2048:
            assert (4, 11) in shapes


def test_a_model_failing_the_batched_check_runs_its_segments_alone(
    family_model_dir, monkeypatch, caplog
):
    """Where the (B, n) layout disagrees with mlx-lm at load, the model is still served,
    each multi-token segment a call of its own, and speculates one request at a time."""
    from tandem.runner import recurrent_step

    sequences = recurrent_step._sequences

    def wrong(runner, segments, group, *args):
        if len(group) > 1:
            raise ValueError("a layout this model does not take")
        return sequences(runner, segments, group, *args)

    monkeypatch.setattr(recurrent_step, "_sequences", wrong)
    path = family_model_dir("qwen3_next")
    llm = LLM(str(path), check_invariants=True, kv_page_size=4, speculative="ngram")
    assert not llm.engine.loop.runner.batch_sequences
    assert llm.engine.scheduler.config.speculation.max_batch == 1
    assert "one call each" in caplog.text
    prompts = [p[:12] for p in prompts_for(9)]
    for p, o in zip(prompts, llm.generate(prompts, greedy(12)), strict=True):
        assert o.token_ids == reference(path, p, 12)
