"""The window page group (engine/kv_manager.py): sliding-window layers' pages are allocated as
positions are written and freed once wholly behind the window, while the full-attention
pages stay; the prefix cache keeps window pages per node and a hit needs the window before
its end. The fake runner reads every sample's window back through the window pages."""

from __future__ import annotations

import random

import pytest

from tandem.engine.engine import Engine
from tandem.engine.pages import PageAllocator
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.scheduler import SchedulerConfig
from tandem.engine.speculation import SpecConfig
from tandem.testing.fake_runner import FakeRecurrentRunner, FakeRunner, copying_token
from tests.unit.test_speculation import check_staggered, drive, expected, staggered

P = 4
W = 10  # positions: a query reads itself and the 9 before it


# ---- the prefix cache's window pages -------------------------------------------------------
def tree_with_window() -> tuple[PrefixCache, PageAllocator, PageAllocator]:
    full, win = PageAllocator(64), PageAllocator(64)
    return PrefixCache(full, P, window_alloc=win, window=W), full, win


def test_a_hit_ends_where_the_window_before_it_is_cached():
    tree, full, win = tree_with_window()
    tokens = list(range(100, 132))  # 8 pages
    pages = full.allocate(8)
    wpages = win.allocate(8)
    # The writer freed its window pages behind the window: pages 0-3 are gone.
    win.decref(wpages[:4])
    held = [-1] * 4 + wpages[4:]
    tree.insert(tokens, pages, held)
    # A hit of 8 pages reads positions 23..31 (pages 5-7): there. It takes only those.
    hit = tree.match_hit(tokens + [1], 33)
    assert len(hit.pages) == 8 and hit.wpages == [-1] * 5 + wpages[5:]
    # A hit ending after 5 pages would read positions 11..19 (pages 2-4): page 2, 3 gone;
    # the longest usable prefix of tokens[:22] is then none at all.
    hit = tree.match_hit(tokens[:22], 22)
    assert hit.pages == [] and hit.matched == 20
    # Positions 0..3 alone (1 page, reads 0..3): page 0 is gone too.
    assert tree.match_hit(tokens[:5], 5).pages == []


def test_window_pages_only_the_tree_holds_drop_alone_and_nodes_keep_their_full_pages():
    tree, full, win = tree_with_window()
    tokens = list(range(200, 216))  # 4 pages
    pages, wpages = full.allocate(4), win.allocate(4)
    tree.insert(tokens, pages, wpages)
    win.decref(wpages[:2])  # the writer lets go of two; it still holds the last two
    assert win.num_cached == 2
    assert tree.drop_window(10) == 2
    assert win.num_free == 64 - 2 and tree.num_pages == 4
    tree.check()
    # The node is still there for its full pages, but a hit of 4 pages would read
    # positions 7..15 (page 1 is gone), and one of fewer pages page 0: none is usable.
    hit = tree.match_hit(tokens + [0], 17)
    assert hit.pages == [] and hit.matched == 16
    full.decref(pages)
    win.decref(wpages[2:])
    assert tree.evict(4) == 4  # evicting the node frees its window pages too
    assert win.num_free == 64 and full.num_free == 64


def test_a_caller_fills_window_pages_the_tree_lacks_and_splits_keep_them_aligned():
    tree, full, win = tree_with_window()
    tokens = list(range(300, 324))  # 6 pages
    pages, wpages = full.allocate(6), win.allocate(6)
    tree.insert(tokens, pages, [-1] * 6)
    other = win.allocate(6)
    assert tree.insert(tokens[:12], pages[:3], other[:3]) == []
    tree.check()
    hit = tree.match_hit(tokens[:12] + [9], 13)  # splits the edge after 3 pages
    assert hit.wpages == other[:3]
    tree.check()
    win.decref(wpages)


# ---- the engine on the fake runner -------------------------------------------------------
def window_engine(overlap: bool, window_pages: int, runner_cls=FakeRunner, **cfg):
    base = {
        "max_num_seqs": 6,
        "max_model_len": 4096,
        "page_size": P,
        "max_num_batched_tokens": 16,
        "window": W,
        "window_pages": window_pages,
    }
    config = SchedulerConfig(**{**base, **cfg})
    runner = runner_cls(
        config.num_pages,
        P,
        token_fn=copying_token,
        window=W,
        window_pages=window_pages,
    )
    return Engine(runner, config, overlap=overlap, check_invariants=True), runner


@pytest.mark.parametrize("overlap", [True, False])
def test_a_long_request_holds_its_window_not_its_length(overlap):
    engine, runner = window_engine(overlap, window_pages=8)
    prompt = [random.Random(1).randrange(1000) for _ in range(50)]
    engine.add_request(prompt, _params(150, 3), "a")
    got, held = [], []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.new_token_ids
        engine.check_invariants()
        req = engine.scheduler.running.get("a")
        if req is not None and req.output_token_ids:  # decoding
            held.append(sum(pg >= 0 for pg in req.wpages))
    assert got == expected(3, prompt, 150) and runner.window_reads == 150
    # 200 positions in 50 full pages; while decoding the request held the window's 3-4
    # window pages and at most one step's lag more, in a group of 8 (its prefill chunks
    # were cut to the pages there were).
    kv = engine.scheduler.kv
    assert len(kv.tree.page_refs()) == 49  # (the full pages: all cached at the end)
    assert max(held) <= 5 and min(held) >= 3


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("speculate", [False, True])
def test_staggered_load_with_hits_aborts_and_few_window_pages_is_exact(overlap, speculate):
    """18 requests over a window group of 20 pages (the widest window needs 3-4 per
    request, 5 to hold it steadily): admission waits for window room, chunks for window
    pages, cached window pages are dropped for them,
    hits end where their window is cached; with n-gram verifies too."""
    spec = SpecConfig(num_tokens=4, max_batch=8, patience=3, backoff=4) if speculate else None
    extra = {"speculation": spec} if spec else {}
    arrivals, want = staggered(random.Random(11))
    engine, runner = window_engine(overlap, window_pages=20, kv_budget_tokens=96 * P, **extra)
    got, reasons = drive(engine, arrivals, {12: "r4", 25: "r9"})
    check_staggered(got, reasons, want)
    kv = engine.scheduler.kv
    assert engine.scheduler.stats.hit_tokens > 0 and runner.window_reads > 300
    assert kv.dropped_window_pages > 0  # the cache gave window pages up for new ones
    assert kv.num_held == 0 and kv.walloc.num_used == kv.walloc.num_cached
    if speculate:
        assert engine.scheduler.stats.spec_accepted > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_recurrent_layers_beside_windowed_ones(overlap):
    """A hybrid with sliding-window attention: states, snapshots and window pages together
    (a hit needs both a snapshot and its window)."""
    arrivals, want = staggered(random.Random(2))
    engine, runner = window_engine(
        overlap,
        window_pages=24,
        runner_cls=FakeRecurrentRunner,
        state_slots=6,
        state_snapshots=12,
        speculation=SpecConfig(num_tokens=3, max_batch=8, patience=3, backoff=4),
    )
    got, reasons = drive(engine, arrivals)
    check_staggered(got, reasons, want)
    assert engine.scheduler.stats.hit_tokens > 0 and runner.replays > 0


def test_a_window_group_smaller_than_one_window_is_refused():
    with pytest.raises(ValueError, match="cannot hold a window of 10 positions"):
        window_engine(True, window_pages=4)


def _params(n: int, seed: int):
    from tandem.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, seed=seed, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_retracted_prefill_waits_for_window_room_instead_of_coming_back_stuck(overlap):
    """Found in review: two prefills each holding their window in a group of 6 pages, one
    of them on a cached prefix. The newest is retracted to let the other on; it must not be
    admitted straight back onto its cached window pages (the two would be stuck again,
    forever): admission keeps the running prefills' next window pages in reserve."""
    engine, _ = window_engine(overlap, window_pages=6)
    rng = random.Random(5)
    first = [rng.randrange(1000) for _ in range(40)]
    engine.add_request(first, _params(1, 0), "prev")
    while engine.has_unfinished():
        engine.step()
    other = [rng.randrange(1000) for _ in range(60)]
    engine.add_request(other, _params(5, 1), "r0")
    engine.add_request([*first, 1, 2, 3, 4, 5], _params(5, 2), "r1")
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        engine.check_invariants()
    assert not engine.has_unfinished()
    assert got == {"r0": expected(1, other, 5), "r1": expected(2, [*first, 1, 2, 3, 4, 5], 5)}
    assert engine.scheduler.stats.retractions <= 2
