"""The CUDA rope guard (runner/mlx_compat.py): which shapes MLX 0.32's CUDA rope rejects (the
failures scripts/gpu_rope_hd16.py measured on an H200, and the partial-rotary sweep of
scripts/gpu_partial_rope.py on an H100, 2026-12-05: docs/benchmarks/h200-host/), and the
padded call's values, on the CPU."""

import mlx.core as mx
import numpy as np
import pytest

from tandem.runner import mlx_compat


@pytest.mark.parametrize(
    ("shape", "dims", "bad"),
    [
        ((128, 4, 1, 16), 16, True),  # measured: from T = 128 at 1-4 heads
        ((127, 4, 1, 16), 16, False),
        ((128, 1, 1, 16), 16, True),
        ((64, 32, 1, 16), 16, True),
        ((16, 32, 1, 64), 16, True),  # measured: T = 16 fails at 32 heads, 15 passes
        ((15, 32, 1, 64), 16, False),
        ((128, 4, 1, 64), 16, True),  # partial rotary, measured failing
        ((128, 4, 1, 80), 20, True),
        ((1024, 32, 1, 64), 8, True),
        ((1024, 32, 1, 64), 32, False),  # 32 dims and more never failed
        ((1024, 32, 1, 128), 128, False),
        ((1, 4, 293, 16), 16, False),  # the sequence layout passed
        ((128, 4, 2, 16), 16, False),  # two rows in T: x and y take 16 threads
        ((128, 4, 2, 8), 8, True),
        ((200, 1, 16), 16, True),  # (B, T, D)
        ((1, 1, 1, 16), 16, False),
    ],
)
def test_invalid_launch_matches_measured(shape, dims, bad):
    assert mlx_compat.invalid_launch(shape, dims) is bad


@pytest.mark.parametrize("dims", [2, 4, 6, 8, 12, 16, 20, 30])
def test_padding_makes_the_launch_valid(dims):
    t = mlx_compat.rows_needed(dims)
    assert not mlx_compat.invalid_launch((4096, 64, t, 64), dims)
    assert t == 1 or mlx_compat.invalid_launch((4096, 64, t // 2, 64), dims)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offset", ["array", "int"])
@pytest.mark.parametrize("freqs", [False, True])
@pytest.mark.parametrize(
    ("shape", "dims"),
    [((130, 4, 1, 64), 16), ((40, 32, 1, 16), 8), ((200, 1, 20), 20), ((64, 2, 3, 1, 32), 4)],
)
def test_padded_rope_equals_rope(shape, dims, traditional, offset, freqs):
    assert mlx_compat.invalid_launch(shape, dims)
    x = mx.random.normal(shape, key=mx.random.key(0))
    kw = {
        "traditional": traditional,
        "base": None if freqs else 1e4,
        "scale": 0.5,
        "offset": mx.arange(shape[0]) * 3 + 5 if offset == "array" else 7,
    }
    if freqs:
        kw["freqs"] = mx.exp(mx.arange(dims // 2) * 0.3)
    want = mx.fast.rope(x, dims, **kw)
    got = mlx_compat.padded_rope(x, dims, **kw)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.array(got), np.array(want))


def test_guard_routes_only_rejected_calls():
    calls = []
    orig = mlx_compat.padded_rope
    before = mx.fast.rope  # (the guard, where a CUDA model was loaded earlier)
    try:
        mlx_compat.padded_rope = lambda a, dims, **kw: calls.append(a.shape) or orig(a, dims, **kw)
        assert mlx_compat.guard_cuda_rope(force=True)
        kw = {"traditional": False, "base": 1e4, "scale": 1.0, "offset": 0}
        mx.fast.rope(mx.zeros((4, 4, 1, 64)), 16, **kw)
        mx.fast.rope(mx.zeros((256, 4, 1, 64)), 64, **kw)
        assert calls == []
        y = mx.fast.rope(mx.ones((256, 4, 1, 64)), 16, **kw)
        assert calls == [(256, 4, 1, 64)] and y.shape == (256, 4, 1, 64)
        mlx_compat.unguard_rope()
        assert mx.fast.rope is mlx_compat._MLX_ROPE
        if not mx.cuda.is_available():
            assert not mlx_compat.guard_cuda_rope()  # the CPU: not installed
    finally:
        mlx_compat.padded_rope = orig
        mx.fast.rope = before
