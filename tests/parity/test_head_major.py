"""Float pages head by head (runner/paged.py ``head_major``), the CPU's default since the
gather path reads whole runs of a page there: both layouts against mlx-lm on every read
path (decode groups, chunks with a history, sliding windows from mid-page, compiled steps,
the double buffer's replays), and the two pools' reads equal entry for entry."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from tandem import LLM
from tandem.runner import kv_quant
from tandem.runner.layers import LayerSpec
from tandem.runner.paged import PagePool
from tests.parity.test_mlx_lm_parity import run_staggered


def _spec(hkv: int = 2, d: int = 8) -> LayerSpec:
    return LayerSpec(k_heads=hkv, v_heads=hkv, k_dim=d, v_dim=d, dtype=mx.float32)


@pytest.mark.parametrize("double_buffer", [False, True])
def test_reads_of_both_layouts_are_equal(double_buffer):
    """Random writes (pages out of order, a slot written twice across steps) land in both
    pools; whole-table reads, reads from mid-page and the slot-by-slot reads agree."""
    page, pages, hkv = 4, 12, 2
    pools = [
        PagePool([_spec(hkv)], pages, page, double_buffer=double_buffer, head_major=hm)
        for hm in (False, True)
    ]
    assert [p.layer(0).ndim for p in pools] == [3, 4]
    rng = np.random.default_rng(0)
    for _ in range(5):  # steps
        slots = rng.choice(pages * page, size=9, replace=False).astype(np.int32)
        k = mx.array(rng.standard_normal((9, hkv, 8)).astype(np.float32))
        v = mx.array(rng.standard_normal((9, hkv, 8)).astype(np.float32))
        for pool in pools:
            pool.begin_step([(slots, mx.array(slots))])
            pool.write(0, mx.array(slots), k, v)
            mx.eval(*pool.arrays())
    flat, heads = (p.layer(0) for p in pools)
    tables = mx.array(rng.permutation(pages)[:6].reshape(2, 3).astype(np.int32))
    for skip, n in ((0, 12), (0, 9), (3, 7)):
        slots = (tables[:, :, None] * page + mx.arange(page)[None, None]).reshape(2, -1)
        want = kv_quant.take_heads(flat, kv_quant.head_rows(slots[:, skip : skip + n], hkv))
        got = kv_quant.take_head_pages(heads, kv_quant.head_rows(tables, hkv), skip, n)
        for w, g in zip(want, got, strict=True):
            assert g.shape == (2, hkv, n, 8)
            assert mx.array_equal(w, g).item()


def _chunked(path, **options) -> LLM:
    """Chunks of 24 over pages of 4: chunks start mid-page over a history."""
    return LLM(
        str(path),
        check_invariants=True,
        max_num_seqs=32,
        max_num_batched_tokens=24,
        kv_page_size=4,
        **options,
    )


@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_both_layouts_match_mlx_lm(tiny_model_dir, head_major, overlap):
    """Staggered requests, prefix hits, aborts and stops, in chunks of 24 over pages of 4
    (chunks start mid-page over a history), compiled steps of up to 4 rows included."""
    path = tiny_model_dir("qwen3")
    llm = _chunked(path, overlap=overlap, kv_head_major=head_major)
    pool = llm.engine.loop.runner.pool
    assert pool.head_major == head_major
    assert all(b.ndim == (4 if head_major else 3) for b in pool.sets[0])
    run_staggered(llm, path, random.Random(f"head-major-{head_major}-{overlap}"))


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_windows_and_sinks_head_major_match_mlx_lm(family_model_dir, model_type):
    """Sliding windows read from mid-page (``skip``), in their own page group; gpt-oss's
    sinks; both on head-major pages."""
    path = family_model_dir(model_type)
    llm = _chunked(path, kv_head_major=True)
    assert llm.engine.loop.runner.pool.head_major
    run_staggered(llm, path, random.Random(model_type))
