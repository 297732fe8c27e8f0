"""Prefix caching for models with recurrent layers: state snapshots in the radix tree, with
the fake recurrent runner (each state is the exact token history it folded, checked against
the pages at every segment)."""

from __future__ import annotations

import random

import pytest

from tandem.engine.engine import Engine
from tandem.engine.pages import PageAllocator
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.scheduler import SchedulerConfig
from tandem.engine.state_slots import Snapshots
from tandem.sampling_params import SamplingParams
from tandem.testing.fake_runner import FakeRecurrentRunner
from tandem.testing.fake_runner import fake_tokens as expected

P = 4


def engine_for(overlap: bool = True, **cfg) -> tuple[Engine, FakeRecurrentRunner]:
    base = {
        "max_num_seqs": 8,
        "max_model_len": 4096,
        "page_size": P,
        "max_num_batched_tokens": 16,
        "state_slots": 8,
        "state_snapshots": 8,
    }
    config = SchedulerConfig(**{**base, **cfg})
    runner = FakeRecurrentRunner(config.num_pages, config.page_size)
    return Engine(runner, config, overlap=overlap, check_invariants=True), runner


def run(engine: Engine, requests: dict[str, tuple[list[int], int, int]]) -> dict[str, int]:
    """Add ``requests`` (id: prompt, seed, max_tokens), run them to the end, check every
    output token; returns each request's cached_tokens."""
    for rid, (prompt, seed, n) in requests.items():
        engine.add_request(prompt, SamplingParams(max_tokens=n, seed=seed, ignore_eos=True), rid)
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            got[out.request_id] += out.new_token_ids
            if out.cached_tokens is not None:
                cached[out.request_id] = out.cached_tokens
        engine.check_invariants()
    for rid, (prompt, seed, n) in requests.items():
        assert got[rid] == expected(seed, prompt, n), rid
    return cached


# ---- the tree ---------------------------------------------------------------------------
def test_hits_end_at_the_deepest_snapshot_and_splits_keep_it_below():
    alloc = PageAllocator(16)
    snaps = Snapshots(8, 4)
    tree = PrefixCache(alloc, P, snaps)
    toks = list(range(16))  # 4 pages
    pages = alloc.allocate(4)
    tree.insert(toks, pages)
    s8, s16 = snaps.allocate(), snaps.allocate()
    assert tree.attach(toks, 8, s8) and tree.attach(toks, 16, s16)  # the first splits the edge
    assert not tree.attach(toks, 8, snaps.allocate())  # already held there
    hit = tree.match_hit(toks, 16)
    assert (hit.pages, hit.snapshot, hit.matched) == (pages, s16, 16)
    hit = tree.match_hit(toks[:12] + [99, 98], 14)  # matched 12, state only at 8
    assert (hit.pages, hit.snapshot, hit.matched) == (pages[:2], s8, 12)
    assert tree.snapshot_at(toks, 8) == s8 and tree.snapshot_at(toks, 12) == -1
    assert tree.match_hit([50] + toks[1:], 16).snapshot == -1
    tree.check()
    assert tree.snapshot_refs() == {s8: 1, s16: 1}
    # The least recently used snapshot no request reads goes first; evicting pages drops
    # their node's snapshot.
    snaps.incref(s16)  # a request admitted on it, its chunk not launched yet
    tree.match_hit(toks[:12], 12)  # touch s8's path: s16's is older, but it is being read
    assert tree.evict_snapshot() and tree.snapshot_refs() == {s16: 1}
    snaps.decref(s16)
    alloc.decref(pages)
    assert tree.evict(1) == 1  # the leaf (positions 12-16) went, and its snapshot with it
    assert tree.snapshot_refs() == {} and set(snaps.refs) == {2 + 8}  # the refused one
    tree.check()


# ---- the scheduler ----------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [True, False])
def test_multi_turn_repeats_and_parting_prompts_resume_from_cached_states(overlap):
    engine, runner = engine_for(overlap)
    rng = random.Random(3)
    turn1 = [rng.randrange(900) for _ in range(29)]
    # Prefill in chunks of 16: states kept at 16 (the chunk's end) and 28 (a repeat's hit);
    # the decodes checkpoint at each page boundary, the last (40 of 43 computed) cached.
    assert run(engine, {"t1": (turn1, 1, 15)}) == {"t1": 0}
    out1 = expected(1, turn1, 15)
    turn2 = turn1 + out1 + [9, 10, 11]
    assert run(engine, {"t2": (turn2, 2, 6)}) == {"t2": 40}
    assert run(engine, {"again": (turn1, 3, 4)}) == {"again": 28}
    # Two prompts that part from turn1 after 22 tokens: the first resumes at 16 and keeps the
    # state at 20 (where the cache matched to), so the second resumes there.
    part_a, part_b = turn1[:22] + [901], turn1[:22] + [902, 903]
    assert run(engine, {"a": (part_a, 4, 5)}) == {"a": 16}
    assert run(engine, {"b": (part_b, 5, 5)}) == {"b": 20}
    assert runner.snapshot_reads == 4
    assert engine.scheduler.stats.hit_tokens == 40 + 28 + 16 + 20


@pytest.mark.parametrize("overlap", [True, False])
def test_requests_arriving_together_keep_the_state_where_their_prompts_part(overlap):
    """Requests sharing a long prefix, admitted in one step: one prefills, the others wait a
    step and resume from the state it keeps where their prompts part."""
    engine, runner = engine_for(overlap, max_num_batched_tokens=512)
    system = [random.Random(4).randrange(900) for _ in range(300)]
    reqs = {f"u{i}": (system + [i + 1] * (i + 2), i, 6) for i in range(5)}
    cached = run(engine, reqs)
    assert cached["u0"] == 0
    assert all(cached[f"u{i}"] == 300 // P * P for i in range(1, 5)), cached


def test_long_decodes_leave_room_for_new_prompts_states():
    """Checkpoints of running decodes hold at most half the snapshot slots, so a prompt
    arriving while they run still keeps its state and a later prompt sharing it hits."""
    engine, runner = engine_for(state_snapshots=4)
    rng = random.Random(6)
    for i in range(4):
        prompt = [rng.randrange(900) for _ in range(9)]
        params = SamplingParams(max_tokens=200, seed=i, ignore_eos=True)
        engine.add_request(prompt, params, f"long{i}")
    for _ in range(20):  # every long one is decoding past several page boundaries
        engine.step()
    held = [r.checkpoint for r in engine.scheduler.running.values() if r.checkpoint >= 0]
    assert len(held) == 2
    shared = [rng.randrange(900) for _ in range(40)]
    engine.add_request(shared + [1], SamplingParams(max_tokens=2, seed=9), "a")
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.cached_tokens is not None:
                cached[out.request_id] = out.cached_tokens
            if out.request_id == "a" and out.finished:  # the long ones still decode
                engine.add_request(shared + [2, 3], SamplingParams(max_tokens=2, seed=9), "b")
        engine.check_invariants()
    assert cached["a"] == 0 and cached["b"] == 40


@pytest.mark.parametrize("overlap", [True, False])
def test_random_load_with_few_pages_and_snapshots_is_token_exact(overlap):
    """Multi-turn conversations and shared prefixes under page and snapshot pressure (LRU
    snapshot eviction, page eviction, retraction), with aborts in flight: every state any
    segment reads is its exact history, every token as computed from scratch."""
    engine, runner = engine_for(
        overlap, kv_budget_tokens=40 * P, state_snapshots=6, max_num_batched_tokens=13
    )
    rng = random.Random(9)
    stems = [[rng.randrange(900) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    history: list[list[int]] = []
    hits = 0
    for round_ in range(6):
        reqs = {}
        for i in range(6):
            if history and rng.random() < 0.5:
                prompt = rng.choice(history) + [
                    rng.randrange(900) for _ in range(rng.randint(1, 6))
                ]
            else:
                prompt = rng.choice(stems) + [rng.randrange(900) for _ in range(rng.randint(0, 9))]
            reqs[f"{round_}.{i}"] = (prompt, rng.randrange(100), rng.randint(1, 20))
        doomed = f"{round_}.{rng.randrange(6)}"
        for rid, (prompt, seed, n) in reqs.items():
            params = SamplingParams(max_tokens=n, seed=seed, ignore_eos=True)
            engine.add_request(prompt, params, rid)
        got: dict[str, list[int]] = {rid: [] for rid in reqs}
        ends = {}
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
                if out.finish_reason:
                    ends[out.request_id] = out.finish_reason
                if out.cached_tokens:
                    hits += 1
            steps += 1
            if steps == 3:
                engine.abort(doomed)
            engine.check_invariants()
        for rid, (prompt, seed, n) in reqs.items():
            want = expected(seed, prompt, n)
            if ends[rid] == "abort":
                assert got[rid] == want[: len(got[rid])], rid
            else:
                assert ends[rid] == "length" and got[rid] == want, rid
                history.append(prompt + want)
    kv = engine.scheduler.kv
    assert hits >= 5 and runner.snapshot_reads >= hits
    assert kv.evicted_snapshots > 0 and kv.evicted_pages > 0
    assert engine.scheduler.stats.retractions > 0  # resumed from their own cached states
