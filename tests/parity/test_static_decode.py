"""Compiled decode steps (runner/static_decode.py): a replayed trace is the step it stands for.

On the CPU the pool's buffers go through the compiled step as inputs and outputs (scatters);
on CUDA they are written in place (scripts/gpu_inplace_check.py runs that path against the
uncompiled one)."""

from __future__ import annotations

import logging
import random
import shutil

import mlx.core as mx
import pytest

from tandem import LLM, SamplingParams
from tandem.runner import static_decode
from tests.parity.test_mlx_lm_parity import greedy, reference, run_staggered


def _llm(path, **options) -> LLM:
    options.setdefault("compile_decode", True)
    options.setdefault("kv_double_buffer", False)
    return LLM(str(path), check_invariants=True, max_num_seqs=32, **options)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(("overlap", "double"), [(True, False), (False, False), (True, True)])
def test_staggered_requests_compiled_match_mlx_lm(tiny_model_dir, arch, overlap, double):
    """Rows joining and leaving (new shapes), stops, aborts, prefix hits, chunked prompts;
    with one buffer set, and with two (the CPU's default with overlap on: a compiled step
    replays the writes its set missed, as its inputs)."""
    path = tiny_model_dir(arch)
    llm = _llm(
        path, overlap=overlap, max_num_batched_tokens=64, kv_page_size=4, kv_double_buffer=double
    )
    assert llm.engine.loop.runner.pool.num_sets == 1 + double
    static = llm.engine.loop.runner.static
    assert static is not None
    run_staggered(llm, path, random.Random(arch))
    assert static.traces > 0
    assert static.replays > static.traces  # most steady steps replayed a trace


def test_a_long_generation_is_traced_a_few_times(tiny_model_dir):
    """Page tables grow by WIDTH_STEP pages at a time, so 300 tokens at pages of 4 positions
    (75 pages) take a handful of traces, and every token equals mlx-lm's."""
    path = tiny_model_dir("qwen3")
    llm = _llm(path, kv_page_size=4)
    prompt = [7, 3, 99, 250, 14]
    out = llm.generate([prompt], greedy(300))[0]
    assert out.token_ids == reference(path, prompt, 300)
    static = llm.engine.loop.runner.static
    assert 1 <= static.traces <= 10
    assert static.replays >= 280


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gemma2"])
@pytest.mark.parametrize("overlap", [True, False])
def test_dense_layers_compiled_match_mlx_lm(family_model_dir, model_type, overlap):
    """Dense layers (deepseek_v3's MLA; gemma2's softcapped scores, its mask of rank 5)
    gather each row's whole table under its mask in the trace: staggered rows token-exact
    with mlx-lm, most steady steps replayed."""
    path = family_model_dir(model_type)
    llm = _llm(path, overlap=overlap, max_num_batched_tokens=64, kv_page_size=4)
    runner = llm.engine.loop.runner
    assert runner.dense and runner.static is not None
    assert runner.mask_rank == (5 if model_type == "gemma2" else 4)
    run_staggered(llm, path, random.Random(model_type))
    assert runner.static.replays > 2 * runner.static.traces


@pytest.mark.parametrize(
    ("model_type", "page"),
    [("gemma3_text", 4), ("gpt_oss", 4), ("llama4", 4), ("gemma3_text", 1), ("llama4", 1)],
)
@pytest.mark.parametrize(("window_pages", "double"), [(None, False), (0, False), (None, True)])
def test_windows_and_chunks_compiled_match_mlx_lm(
    family_model_dir, model_type, page, window_pages, double
):
    """Sliding windows (gemma3_text; gpt_oss with attention sinks) and chunks (llama4) of 8
    positions over pages of 4 (and of 1, where a span's 9 pages are wider than short rows'
    full tables: those cap them), in the window page group (its pages freed behind the
    window) or in the full one (0): staggered rows far past the window, token-exact with
    mlx-lm, and most steady steps replayed."""
    path = family_model_dir(model_type)
    llm = _llm(
        path,
        max_num_batched_tokens=64,
        kv_page_size=page,
        kv_window_pages=window_pages,
        kv_double_buffer=double,
    )
    runner = llm.engine.loop.runner
    assert bool(runner.pool.window_pages) == (window_pages is None)
    assert runner.static is not None and runner.static.spans
    run_staggered(llm, path, random.Random(model_type))
    assert runner.static.replays > runner.static.traces > 0


def test_rows_leaving_reuse_padded_shapes(tiny_model_dir):
    """Seven requests finishing one after another run as 8, 4, 2 and 1 rows (padding rows
    write into the scratch page): a few traces, every output equal to mlx-lm's."""
    from tandem.runner.static_decode import bucket

    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 64, 65, 200)] == [1, 2, 4, 8, 8, 16, 64, 80, 208]
    path = tiny_model_dir("llama")
    llm = _llm(path, kv_double_buffer=True)  # (padded replays of the other set's writes too)
    prompts = [[3 + i, 40 + 2 * i, 99, 7 * i + 1] for i in range(7)]
    outs = llm.generate(prompts, [greedy(10 + 9 * i) for i in range(7)])
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.token_ids == reference(path, prompt, 10 + 9 * i)
    static = llm.engine.loop.runner.static
    assert static.traces <= 4
    assert static.replays >= 50


def test_least_recently_used_shapes_dropped(tiny_model_dir, monkeypatch):
    """Past ``MAX_SHAPES`` step shapes the least recently used one's trace is dropped (the
    rest are kept): rows leaving one by one meet 8, 4, 2 and 1 rows, and with room for two
    the oldest go; every output equal to mlx-lm's."""
    from tandem.runner import static_decode

    monkeypatch.setattr(static_decode, "MAX_SHAPES", 2)
    path = tiny_model_dir("llama")
    llm = _llm(path)
    prompts = [[3 + i, 40 + 2 * i, 99, 7 * i + 1] for i in range(7)]
    outs = llm.generate(prompts, [greedy(10 + 9 * i) for i in range(7)])
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.token_ids == reference(path, prompt, 10 + 9 * i)
    static = llm.engine.loop.runner.static
    assert static.traces >= 4 and static.replays >= 50
    assert len(static._fns) == 2
    assert [shape[0] for shape in static._fns] == [2, 1]  # the latest two, oldest first


def test_ragged_gathers_run_uncompiled_and_work_lists_pad(tiny_model_dir):
    """The gather path reads every row out to the longest table, so a batch where that more
    than doubles the keys read runs uncompiled; the kernel's work list pads its items (to a
    bucket) only where rows span chunks, with items the merge never reads."""
    from tandem.engine.plan import Segment
    from tandem.runner.kernels import CHUNK, DecodeWork
    from tandem.runner.static_decode import bucket

    llm = _llm(tiny_model_dir("llama"))  # (kept: the trace holds its runner weakly)
    static = llm.engine.loop.runner.static

    def seg(start: int) -> Segment:
        return Segment("r", start, 1, (5,), tuple(range(start // 16 + 1)))

    even = tuple(seg(s) for s in (300, 310, 320, 330))
    ragged = (seg(2000), *(seg(10) for _ in range(7)))
    assert static.applies(even, [0, 1, 2, 3])
    assert not static.applies(ragged, list(range(8)))
    assert not static.applies(even, [0, 1, 2])  # a prompt row's logits too

    work = DecodeWork([CHUNK + 88, 10, 2 * CHUNK + 76], 8, pad=bucket)
    assert work.split and work.num_items == 8  # 2 + 1 + 3 real items
    items = work.items.tolist()
    assert items[:12] == [0, 0, 0, 1, 1, 0, 2, 0, 2, 1, 2, 2] and items[12:] == [0, 0, 0, 0]
    assert work.offsets.tolist() == [0, 2, 3, 6]
    single = DecodeWork([10, 20], 8, pad=bucket)
    assert not single.split and single.num_items == 2


@pytest.mark.parametrize("double", [False, True])
def test_a_trace_that_fails_turns_compiling_off(tiny_model_dir, monkeypatch, double):
    """Model code a trace cannot run: the step runs uncompiled, and so do the next ones (with
    two buffer sets, from the pool as the failed step found it)."""
    from tandem.runner.static_decode import StaticDecode

    def broken(self, *args):
        raise ValueError("cannot trace this")

    monkeypatch.setattr(StaticDecode, "_body", broken)
    path = tiny_model_dir("llama")
    llm = _llm(path, kv_double_buffer=double)
    prompt = [4, 8, 15, 16, 23, 42]
    assert llm.generate([prompt], greedy(20))[0].token_ids == reference(path, prompt, 20)
    assert llm.engine.loop.runner.static is None
    assert llm.engine.scheduler.stats.step_failures == 0


def test_only_steps_of_at_most_compile_decode_rows_are_compiled(tiny_model_dir):
    """``compile_decode=2``: steps of three or more decode rows build their graph in Python
    (on the H200 a trace paid at one row and cost at 16), those of one or two replay it;
    every output equal to mlx-lm's."""
    path = tiny_model_dir("llama")
    llm = _llm(path, compile_decode=2)
    static = llm.engine.loop.runner.static
    assert llm.engine.loop.runner.compile_decode == 2
    prompts = [[3 + i, 40 + 2 * i, 99, 7 * i + 1] for i in range(4)]
    lengths = [4, 5, 20, 40]  # 4 rows, then 2 for 15 steps, then 1 for 20
    outs = llm.generate(prompts, [greedy(n) for n in lengths])
    for prompt, n, out in zip(prompts, lengths, outs, strict=True):
        assert out.token_ids == reference(path, prompt, n)
    assert static.traces <= 3  # 2 and 1 rows (a wider table at most once)
    assert 30 <= static.replays <= 36  # the steps of 1-2 rows, none of 3-4
    with pytest.raises(ValueError, match="compile_decode"):
        LLM(str(path), compile_decode=-1)


@pytest.mark.skipif(
    mx.default_device() != mx.cpu or shutil.which("g++") is None,
    reason="the CPU's default, where MLX compiles (with g++)",
)
def test_the_cpu_compiles_steps_of_up_to_four_rows_by_default(tiny_model_dir, monkeypatch):
    """None: static_decode.GPU_ROWS where KV writes are in place (CUDA); on the CPU
    CPU_ROWS, with overlap on (two buffer sets) and off, unless MLX cannot build a fused CPU
    kernel here (the load-time probe), when steps run uncompiled."""
    for overlap in (True, False):
        llm = LLM(str(tiny_model_dir("llama")), overlap=overlap)
        assert llm.config.compile_decode is None
        runner = llm.engine.loop.runner
        assert runner.compile_decode == static_decode.CPU_ROWS == 4
        assert runner.double_buffer is overlap  # (two sets with overlap on, the CPU's way)
        assert runner.static is not None
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0))[0]
        assert runner.static.replays > 0
        assert out.token_ids == reference(tiny_model_dir("llama"), [5, 6, 7], 6)
    monkeypatch.setattr(static_decode, "cpu_compiler", lambda: False)
    llm = LLM(str(tiny_model_dir("llama")))
    assert llm.engine.loop.runner.compile_decode == 0
    assert llm.engine.loop.runner.static is None


def test_the_compiler_probe_reports_a_failing_build(monkeypatch, caplog):
    """A compiled function that fails when it is evaluated (a compiler that is there but
    fails) makes the probe say no, with a warning, rather than failing a step later."""

    def broken(fun):
        def call(*args):
            raise RuntimeError("[Compile::eval_cpu] Failed to compile function")

        return call

    static_decode.cpu_compiler.cache_clear()
    monkeypatch.setattr(static_decode.mx, "compile", broken)
    monkeypatch.setattr(logging.getLogger("tandem"), "propagate", True)  # (cli.main sets False)
    try:
        with caplog.at_level("WARNING", logger="tandem"):
            assert static_decode.cpu_compiler() is False
        assert "could not build a fused CPU kernel" in caplog.text
    finally:
        static_decode.cpu_compiler.cache_clear()


def test_the_probe_says_no_where_mlx_does_not_compile():
    """Without g++ on the PATH (or with compilation disabled) MLX runs a compiled function's
    Python at every call: a trace per step, not a replay. The probe sees the second call
    run the body again and says no."""
    static_decode.cpu_compiler.cache_clear()
    mx.disable_compile()
    try:
        assert static_decode.cpu_compiler() is False
    finally:
        mx.enable_compile()
        static_decode.cpu_compiler.cache_clear()
    assert static_decode.cpu_compiler() is (shutil.which("g++") is not None)


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2", "falcon_h1"])
@pytest.mark.parametrize("overlap", [True, False])
def test_hybrids_compiled_match_mlx_lm(family_model_dir, model_type, overlap):
    """Recurrent layers in a compiled step: rows whose states are all resident replay a trace
    that takes those states and returns the next ones; rows joining and leaving, stops,
    aborts, prefix hits (snapshots at page boundaries) and chunked prompts run uncompiled
    between. Every output equals mlx-lm's, and most steady steps replay. (Models with
    recurrent states keep one KV buffer set.)"""
    path = family_model_dir(model_type)
    llm = _llm(path, overlap=overlap, max_num_batched_tokens=64, kv_page_size=4)
    runner = llm.engine.loop.runner
    assert runner.state_pool is not None and runner.static is not None
    assert runner.pool.num_sets == 1
    run_staggered(llm, path, random.Random(model_type))
    assert runner.static.replays > runner.static.traces > 0


def test_a_hybrid_single_stream_replays_its_trace(family_model_dir):
    """One request: after its prompt every step replays (a snapshot step at each page
    boundary runs uncompiled), its states resident throughout, equal to mlx-lm's."""
    path = family_model_dir("qwen3_next")
    llm = _llm(path, kv_page_size=16)
    prompt = [7, 3, 99, 250, 14]
    assert llm.generate([prompt], greedy(120))[0].token_ids == reference(path, prompt, 120)
    static = llm.engine.loop.runner.static
    assert static.traces <= 3 and static.replays >= 100


def test_an_all_recurrent_model_traces_one_table_width(family_model_dir):
    """mamba2 has no KV layers: its steps read no page tables, so a row growing past pages
    of 4 positions keeps one trace (tables of one fixed width)."""
    path = family_model_dir("mamba2")
    llm = _llm(path, kv_page_size=4)
    assert not llm.engine.loop.runner.specs
    prompt = [5, 9, 200, 31]
    assert llm.generate([prompt], greedy(60))[0].token_ids == reference(path, prompt, 60)
    static = llm.engine.loop.runner.static
    assert static.traces == 1 and static.replays >= 30


@pytest.mark.parametrize(("overlap", "double"), [(True, False), (False, False), (True, True)])
def test_verify_steps_compiled_match_mlx_lm(tiny_model_dir, overlap, double):
    """Speculative verifies run as one row per position in compiled steps (each attends to
    the keys up to its own): the model drafting for itself under staggered requests, then
    n-gram proposals on repetitive prompts, token-exact with mlx-lm, with compiled verify
    steps replayed."""
    path = tiny_model_dir("qwen3")
    spec = {"num_speculative_tokens": 3, "speculative_min_gain": 0, "kv_page_size": 4}
    spec.update(compile_decode=16, kv_double_buffer=double)
    llm = _llm(path, overlap=overlap, speculative="draft", draft_model=str(path), **spec)
    run_staggered(llm, path, random.Random(f"verify{overlap}{double}"))
    static = llm.engine.loop.runner.static
    assert llm.engine.scheduler.stats.spec_accepted > 20
    # (A staggered run is mostly prefills: few steps replay; fewer with two buffer sets, where
    # a step after a bigger one runs uncompiled.)
    assert static.verifies > (0 if double else 10)

    llm = _llm(path, overlap=overlap, speculative="ngram", **spec)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(5)] * 4 for _ in range(3)]
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(40)), strict=True):
        assert out.token_ids == reference(path, prompt, 40)
    static = llm.engine.loop.runner.static
    assert static.verifies > 5 and static.replays > 2 * static.traces
