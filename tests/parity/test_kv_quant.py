"""Quantized KV pages (``kv_cache_dtype`` int8 / int4): whatever the schedule — staggered
arrivals, chunked prefill, prefix hits shared and adopted, aborts, overlap on and off, one or
two buffer sets, speculation — every request's tokens equal its own run alone on a quantized
engine (up to a near-tie that float rounding tipped), for plain, windowed, sink, MLA and
hybrid recurrent models. How far quantized KV is from float KV: tiny models here, the
default model in tests/test_default_model.py and ``tandem bench kv-quant``."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from test_mlx_lm_parity import greedy, run_staggered

from tandem import LLM, SamplingParams
from tandem.runner import kv_quant
from tandem.runner.kv_quant import KVQuant, QuantizedPages
from tandem.runner.layers import LayerSpec
from tandem.runner.paged import PagePool, bytes_per_token, quantizable
from tandem.testing import tiny_models
from tandem.testing.families import RECURRENT, family_config

# A float32 logit moved by another summation order (OpenBLAS blocks a matmul by its row
# count, so a batch rounds unlike a solo run: ~1e-5) can land a value on the other side of a
# quantization step, which moves log-probabilities by up to ~1e-2 (int8: measured 2e-3):
# where the top two tokens are that close, a schedule may pick either.
TIE = 0.05


class Solo:
    """Greedy tokens of each request alone (one prefill, no cache, no overlap) on a quantized
    engine, and where a scheduled run may part from them: only at a near-tie."""

    def __init__(self, path, dtype: str, **options) -> None:
        # (Uncompiled: the compiled steps on quantized pages are compared against it.)
        options.setdefault("compile_decode", 0)
        self.llm = LLM(
            str(path), kv_cache_dtype=dtype, overlap=False, prefix_cache=False, **options
        )
        self.runs: dict[tuple, tuple[list[int], list[float]]] = {}
        self.parted = 0

    def __call__(self, prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self.runs:
            out = self.llm.generate([prompt], greedy(n, logprobs=2))[0]
            margins = [lp - top[1][1] for lp, top in out.logprobs]
            self.runs[key] = (out.token_ids, margins)
        return self.runs[key][0]

    def tie(self, prompt: list[int], got: list[int], want: list[int]) -> bool:
        i = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        if i is None:
            return False
        margins = self.runs[(tuple(prompt), len(want))][1]
        self.parted += margins[i] < TIE
        return margins[i] < TIE


def staggered_ways(path, dtype: str, seed: str, ways, **options) -> LLM:
    """run_staggered (every request equal to its solo run, or parting at a near-tie) each
    way; at most 2 of 18 requests part per way. Returns the last way's engine."""
    solo = Solo(path, dtype, **options)
    for way in ways:
        llm = LLM(
            str(path),
            kv_cache_dtype=dtype,
            check_invariants=True,
            max_num_seqs=32,
            **options,
            **way,
        )
        runner = llm.engine.loop.runner
        assert all(quantizable(s, runner.kv_quant) for s in runner.specs), runner.kv_description
        solo.parted = 0
        run_staggered(llm, path, random.Random(seed), solo=solo, tie=solo.tie)
        assert llm.engine.scheduler.stats.hit_tokens > 0
        assert solo.parted <= 2, way
    return llm


WAYS = (
    {"overlap": True, "kv_double_buffer": True},
    {"overlap": True, "kv_double_buffer": False, "max_num_batched_tokens": 16},
    {"overlap": False, "kv_page_size": 4, "max_num_batched_tokens": 24},
)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_schedule_does_not_change_quantized_output(tiny_model_dir, arch, dtype):
    staggered_ways(tiny_model_dir(arch), dtype, arch, WAYS)


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss", "deepseek_v3", "qwen3_next"])
def test_families_with_quantized_kv(family_model_dir, tmp_path, model_type):
    """Windows of 8 positions (prompts far longer), sinks, MLA latents gathered per token,
    and attention beside Gated DeltaNet state (resumed from snapshots on a hit)."""
    path = family_model_dir(model_type)
    if model_type == "deepseek_v3":  # a latent of 56 + 8 rope values: groups of 64
        config = {**family_config(model_type), "kv_lora_rank": 56}
        path = tiny_models._write_model(tmp_path / "mla", config, 0, "float32", 512)
    ways = WAYS[:1] + WAYS[2:] if model_type in RECURRENT else WAYS
    staggered_ways(path, "int8", model_type, ways)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_compiled_steps_on_quantized_pages(tiny_model_dir, dtype):
    """Compiled decode steps (runner/static_decode.py) take a quantized layer's packed
    values, scales and biases as three inputs and outputs: staggered requests equal their
    solo runs (up to near-ties), most steady steps replayed. With two buffer sets (which
    replay one array per layer) steps stay uncompiled."""
    path = tiny_model_dir("qwen3")
    way = {"overlap": True, "kv_double_buffer": False, "compile_decode": True}
    static = staggered_ways(path, dtype, "compiled", [way]).engine.loop.runner.static
    assert static is not None and static.replays > 2 * static.traces
    double = {**way, "kv_double_buffer": True}
    assert LLM(str(path), kv_cache_dtype=dtype, **double).engine.loop.runner.static is None


def test_speculation_on_quantized_kv_changes_nothing(tiny_model_dir):
    path = tiny_model_dir("llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(6)] * 4 for _ in range(4)]
    outs = []
    for spec in (
        {},
        {"speculative": "ngram", "num_speculative_tokens": 4, "speculative_min_gain": 0},
    ):
        llm = LLM(str(path), kv_cache_dtype="int4", kv_page_size=4, check_invariants=True, **spec)
        outs.append([o.token_ids for o in llm.generate(prompts, greedy(60))])
    assert outs[0] == outs[1]
    assert llm.engine.scheduler.stats.spec_accepted > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_quantized_kv_stays_near_float_kv(tiny_model_dir, arch):
    """Log-probabilities of 4 x 80 random tokens read on int8 / int4 pages against float
    pages (measured: int8 max 0.013 / 0.065, mean 0.003 / 0.013; int4 mean 0.04 / 0.22): a
    decode that is consistent but wrong (a wrong group, scale or bias) is far off."""
    path = tiny_model_dir(arch)
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 500) for _ in range(80)] for _ in range(4)]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    lps = {}
    for dtype in ("auto", "int8", "int4"):
        llm = LLM(str(path), kv_cache_dtype=dtype, kv_budget_tokens=2048)
        outs = llm.generate(seqs, params)
        lps[dtype] = np.array([lp for o in outs for lp, _ in o.prompt_logprobs])
    err = {d: np.abs(lps[d] - lps["auto"]) for d in ("int8", "int4")}
    assert err["int8"].max() < 0.2 and err["int8"].mean() < 0.03, err["int8"].max()
    assert err["int4"].mean() < 0.5
    assert 0 < err["int8"].mean() < err["int4"].mean()  # both quantize; int4 more coarsely


def test_double_buffer_replays_quantized_writes():
    """Steps writing overlapping slots through the two buffer sets (the previous step's
    writes replayed, a slot written again dropped from the replay): after every step the
    current set holds each slot's latest entry, round-tripped."""
    specs = [LayerSpec(2, 64, 2, 64, mx.float32), LayerSpec(1, 48, 1, 48, mx.float32)]
    pool = PagePool(specs, 4, 4, double_buffer=True, quant=KVQuant(8))
    rng = np.random.default_rng(1)
    latest: dict[int, list[mx.array]] = {}
    for slots in ([0, 1, 2], [2, 3], [5, 0], [6], [3, 6, 7]):
        s = np.array(slots)
        pool.begin_step([(s, mx.array(s))])
        for layer, spec in enumerate(specs):
            shape = (len(slots), spec.k_heads, spec.k_dim)
            k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)) for _ in "kv")
            pool.write(layer, mx.array(s), k, v)
            rk, rv = kv_quant.roundtrip(pool.layer(layer), k, v)
            for i, slot in enumerate(slots):
                latest.setdefault(slot, [None, None])[layer] = mx.concatenate([rk, rv], 1)[i]
        for layer in range(len(specs)):
            held = sorted(latest)
            got = kv_quant.take(pool.layer(layer), mx.array(held))
            want = mx.stack([latest[slot][layer] for slot in held])
            assert mx.array_equal(got, want).item(), (slots, layer)


def test_quantized_pool_stores_what_attention_reads():
    """A write through the double buffer, read back by slot and by page table, equals the
    round trip of the fresh entries; float layers and unquantizable ones are untouched."""
    specs = [LayerSpec(2, 64, 2, 64, mx.float32), LayerSpec(1, 8, 1, 8, mx.float32)]
    pool = PagePool(specs, 4, 4, double_buffer=True, quant=KVQuant(4))
    assert pool.quantized(0) and not pool.quantized(1)  # 16 values: no group divides them
    rng = np.random.default_rng(0)
    for slots in ([0, 1, 2], [3, 8, 9]):
        s = np.array(slots)
        pool.begin_step([(s, mx.array(s))])
        k, v = (mx.array(rng.standard_normal((3, 2, 64)).astype(np.float32)) for _ in "kv")
        pool.write(0, mx.array(s), k, v)
        rk, rv = kv_quant.roundtrip(pool.layer(0), k, v)
        got = kv_quant.take(pool.layer(0), mx.array(s))
        assert mx.array_equal(got, mx.concatenate([rk, rv], axis=1)).item()
        assert 0 < mx.abs(rk - k).max().item() < 0.5  # int4 of unit normals
    # Both steps' writes in the current set, read as page tables (page 2 holds slots 8, 9).
    table = mx.array([[0, 2]], dtype=mx.int32)
    x = kv_quant.take_pages(pool.layer(0), table, 4, 6)
    assert x.shape == (1, 6, 4, 64)
    first = kv_quant.take(pool.layer(0), mx.array([0, 1, 2, 3, 8, 9]))
    assert mx.array_equal(x[0], first).item()
    assert isinstance(pool.layer(0), QuantizedPages) and isinstance(pool.layer(1), mx.array)


def test_memory_per_token_of_a_real_shape():
    """Qwen3-8B's layers in float16 (8 KV heads of 128): int8 holds ~1.9x the tokens, int4
    ~3.6x (packed values plus a float16 scale and bias per group of 64)."""
    spec = LayerSpec(8, 128, 8, 128, mx.float16)
    full = bytes_per_token(spec, None)
    assert full == 4096
    assert bytes_per_token(spec, KVQuant(8)) == 2048 + 2 * 32 * 2
    assert bytes_per_token(spec, KVQuant(4)) == 1024 + 2 * 32 * 2
    assert full / bytes_per_token(spec, KVQuant(4)) > 3.5


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, int4"):
        LLM(kv_cache_dtype="fp8")
