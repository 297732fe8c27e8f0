"""The seam paged attention hooks: mlx-lm's models call ``scaled_dot_product_attention`` by
name from their own module (imported from ``mlx_lm.models.base``)."""

from __future__ import annotations

import importlib
import inspect

import pytest

from tandem.runner import attention
from tandem.testing.tiny_models import ARCHITECTURES

# Full-attention model types whose caches are all plain KVCache (what the runner accepts);
# the tiny architectures are also token-exact in the parity tests.
# ("mistral" is served by mlx-lm's llama module: its MODEL_REMAPPING.)
FULL_ATTENTION = sorted({*ARCHITECTURES, "mistral", "qwen2_moe", "phi3", "granite", "olmo2"})


@pytest.mark.parametrize("model_type", FULL_ATTENTION)
def test_attention_seam_exists_for_every_supported_model_type(model_type):
    from mlx_lm.utils import MODEL_REMAPPING

    name = MODEL_REMAPPING.get(model_type, model_type)
    module = importlib.import_module(f"mlx_lm.models.{name}")
    assert attention.has_seam(module), f"{model_type} has no {attention.SEAM}"
    assert module.scaled_dot_product_attention is not None
    assert f"{attention.SEAM}(" in inspect.getsource(module)


def test_install_routes_only_paged_caches(tiny_model_dir):
    from mlx_lm.utils import load

    model = load(str(tiny_model_dir("qwen3")))[0]
    attention.install(model)
    module = attention.model_module(model)
    assert module.scaled_dot_product_attention is attention.paged_sdpa
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    # Other caches (mlx-lm's own generation) still take mlx-lm's path.
    tokens = [int(t) for t, _ in generate_step(mx.array([1, 2, 3]), model, max_tokens=3)]
    assert len(tokens) == 3


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_lm_head_runs_only_on_the_rows_a_step_needs(tiny_model_dir, arch):
    """Tied embeddings too: the body wrapper forwards the outer model's attribute reads."""
    from mlx_lm.utils import load

    from tandem.runner.model_runner import ModelRunner

    runner = ModelRunner(load(str(tiny_model_dir(arch)))[0], model_type=arch)
    assert runner.selector is not None


def test_the_double_buffer_drops_replayed_writes_this_step_overwrites():
    import mlx.core as mx
    import numpy as np

    from tandem.runner.layers import LayerSpec
    from tandem.runner.paged import PagePool

    pool = PagePool([LayerSpec(1, 4, 1, 4, mx.float32)], 2, 4, double_buffer=True)
    ones = mx.ones((2, 1, 4))
    a = np.array([0, 1], dtype=np.int32)
    pool.begin_step([(a, mx.array(a))])
    pool.write(0, mx.array(a), ones, ones)  # set 1: slots 0, 1 = 1
    b = np.array([1, 2], dtype=np.int32)
    pool.begin_step([(b, mx.array(b))])  # set 0 owes slots 0, 1; this step rewrites slot 1
    pool.write(0, mx.array(b), 2 * ones, 2 * ones)
    k = np.array(pool.layer(0)[:, 0, 0])
    assert k[:3].tolist() == [1.0, 2.0, 2.0]


def test_verify_positions_attend_as_decodes_exactly_as_a_chunk():
    """With the decode kernel a speculative verify segment's positions join the decode
    group (one kernel call); read through the gather path that layout gives what the chunk
    layout gives: each position sees its keys up to itself (inside the window)."""
    import mlx.core as mx
    import numpy as np

    from tandem.engine.plan import Segment
    from tandem.runner.attention import gather_attention
    from tandem.runner.step_context import StepContext

    p, hkv, h, d = 4, 2, 4, 8
    rng = np.random.default_rng(0)
    pool = mx.array(rng.standard_normal((64 * p, 2 * hkv, d)).astype(np.float32))
    segs = [
        Segment("a", 9, 1, (1,), (3, 5, 7), sample_row=0),
        Segment("b", 13, 5, (1, 2, 3, 4, 5), (8, 9, 10, 11, 12), sample_row=1, num_samples=5),
        Segment("c", 6, 3, (1, 2, 3), (20, 21, 22)),
    ]
    t = sum(s.num_tokens for s in segs)
    q = mx.array(rng.standard_normal((t, h, 1, d)).astype(np.float32))
    kv = mx.zeros((t, hkv, 1, d))  # the pool already holds them (not read here)
    chunked = StepContext(segs, p, kernel=False).view(None, kernel=False)
    expanded = StepContext(segs, p, kernel=True).view(None, kernel=True)
    assert len(chunked.chunks) == 2 and len(expanded.chunks) == 1
    assert sum(g.rows.shape[0] for g in expanded.decodes) == 6
    expanded.kernel = False  # read the expanded layout through the gather path
    want = gather_attention(chunked, q, kv, kv, pool, 0.3)
    got = gather_attention(expanded, q, kv, kv, pool, 0.3)
    assert np.allclose(np.array(got), np.array(want), atol=1e-5)


def test_new_prompts_attend_in_one_batched_call_exactly_as_one_call_each():
    """New prompts' chunks (fresh keys, causal) go to attention batched: a run of equal
    lengths as one item, the others grouped by length and padded; a chunk read from the
    pool and the decodes stay apart. Each sequence's output is its own causal attention,
    bit for bit as one call each."""
    import mlx.core as mx
    import numpy as np

    from tandem.engine.plan import Segment
    from tandem.runner.attention import gather_attention
    from tandem.runner.step_context import StepContext

    p, hkv, h, d = 4, 2, 4, 8
    rng = np.random.default_rng(1)
    pool = mx.array(rng.standard_normal((64 * p, 2 * hkv, d)).astype(np.float32))
    segs = [
        Segment("a", 9, 1, (1,), (3, 5, 7), sample_row=0),
        *(Segment(f"n{i}", 0, 6, (1,) * 6, (10 + 2 * i, 11 + 2 * i)) for i in range(3)),
        Segment("short", 0, 5, (1,) * 5, (30, 31)),
        Segment("tail", 6, 6, (1,) * 6, (40, 41, 42)),
        Segment("x", 0, 6, (1,) * 6, (50, 51)),
        Segment("b", 5, 1, (1,), (52, 53), sample_row=1),
        Segment("y", 0, 4, (1,) * 4, (54,)),
    ]
    t = sum(s.num_tokens for s in segs)
    q = mx.array(rng.standard_normal((t, h, 1, d)).astype(np.float32))
    kv = mx.array(rng.standard_normal((t, hkv, 1, d)).astype(np.float32))
    view = StepContext(segs, p, kernel=False).view(None, kernel=False)
    run, padded = [c for c in view.chunks if c.members]
    assert [m for _, m in run.members] == [6, 6, 6] and run.pad_rows is None
    assert [m for _, m in padded.members] == [5, 6, 4] and padded.n == 6
    assert padded.pad_rows is not None and padded.real_rows is not None
    assert [c.slots is None for c in view.chunks] == [True, True, False]
    assert view.unpermute is not None
    got = np.array(gather_attention(view, q, kv, kv, pool, 0.3))
    for first, n in run.members + padded.members:
        qs = q[first : first + n, :, 0, :].transpose(1, 0, 2)[None]
        ks = kv[first : first + n, :, 0, :].transpose(1, 0, 2)[None]
        want = mx.fast.scaled_dot_product_attention(qs, ks, ks, scale=0.3, mask="causal")
        want = np.array(want[0].transpose(1, 0, 2))
        assert np.array_equal(got[first : first + n, :, 0, :], want), first


def test_runs_are_reshapes_and_a_prompt_cut_by_the_budget_stays_out():
    """Equal prompts one after another are a reshape, and the shorter first piece of the
    next (cut by the step's budget) is not padded into them; equal prompts apart are
    gathered without padding (no gather back)."""
    from tandem.engine.plan import Segment
    from tandem.runner.step_context import StepContext

    segs = [Segment(f"n{i}", 0, 8, (1,) * 8, (2 * i, 2 * i + 1)) for i in range(4)]
    segs.append(Segment("cut", 0, 3, (1,) * 3, (20,)))
    first, cut = StepContext(segs, 4, kernel=False).view(None, kernel=False).chunks
    assert first.members == ((0, 8), (8, 8), (16, 8), (24, 8)) and first.pad_rows is None
    assert not cut.members and cut.n == 3
    segs = [
        Segment("u", 0, 8, (1,) * 8, (2, 3)),
        Segment("a", 9, 1, (1,), (3, 5, 7), sample_row=0),
        Segment("v", 0, 8, (1,) * 8, (12, 13)),
    ]
    [c] = StepContext(segs, 4, kernel=False).view(None, kernel=False).chunks
    assert c.members == ((0, 8), (9, 8)) and c.pad_rows is not None and c.real_rows is None


@pytest.mark.parametrize("pool_kind", ["float", "int8"])
@pytest.mark.parametrize("sinks", [False, True])
def test_batched_new_prompts_equal_one_call_each_with_decodes_between(pool_kind, sinks):
    """Batched and one call per prompt give the same bits, with decodes between the chunks
    (the outputs come back out of token order: ``unpermute``), runs of equal prompts,
    prompts of unequal lengths (padded) and equal ones apart, on quantized pages (fresh
    keys read as the pool would return them) and with attention sinks."""
    import mlx.core as mx
    import numpy as np

    from tandem.engine.plan import Segment
    from tandem.runner import step_context
    from tandem.runner.attention import gather_attention
    from tandem.runner.kv_quant import KVQuant, QuantizedPages
    from tandem.runner.step_context import StepContext

    p, hkv, h, d = 4, 2, 4, 32
    rng = np.random.default_rng(2)
    if pool_kind == "float":
        pool = mx.array(rng.standard_normal((64 * p, 2 * hkv, d)).astype(np.float32))
    else:
        pool = QuantizedPages(64 * p, (2 * hkv, d), mx.float32, KVQuant(8))

    def decode(name: str, page: int) -> Segment:
        return Segment(name, 5, 1, (1,), (page, page + 1), sample_row=0)

    segs = [
        *(Segment(f"n{i}", 0, 5, (1,) * 5, (10 + 2 * i, 11 + 2 * i)) for i in range(3)),
        decode("a", 3),
        Segment("b", 0, 4, (1,) * 4, (30, 31)),
        decode("a2", 5),
        Segment("c", 0, 5, (1,) * 5, (32, 33)),
        decode("a3", 7),
        *(Segment(f"m{i}", 0, 5, (1,) * 5, (40 + 2 * i, 41 + 2 * i)) for i in range(2)),
        Segment("long", 0, 16, (1,) * 16, (50, 51, 52, 53)),
        decode("a4", 20),
        Segment("e", 0, 16, (1,) * 16, (54, 55, 56, 57)),
    ]
    t = sum(s.num_tokens for s in segs)
    q = mx.array(rng.standard_normal((t, h, 1, d)).astype(np.float32))
    kv = mx.array(rng.standard_normal((t, hkv, 1, d)).astype(np.float32))
    sink = mx.array(rng.standard_normal((h,)).astype(np.float32)) if sinks else None
    outs = {}
    for batched in (True, False):
        step_context.BATCH_FRESH = batched
        try:
            view = StepContext(segs, p, kernel=False).view(None, kernel=False)
        finally:
            step_context.BATCH_FRESH = True
        assert view.unpermute is not None
        kinds = sorted(
            (c.count, c.pad_rows is not None, c.real_rows is not None) for c in view.chunks
        )
        # Runs of 3 and 2; b and c padded together; long and e equal, apart: no padding.
        want = [(2, False, False), (2, True, False), (2, True, True), (3, False, False)]
        assert kinds == (want if batched else [(1, False, False)] * 9)
        outs[batched] = np.array(gather_attention(view, q, kv, kv, pool, 0.3, sinks=sink))
    assert np.array_equal(outs[True], outs[False])
