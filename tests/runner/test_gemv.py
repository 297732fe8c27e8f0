"""The one-row GEMV kernel's routing (runner/gemv.py): which products may take it, that the
weight views' modules send them there and nothing else, and that the CPU keeps MLX's path.
The kernel itself runs on CUDA only (its bitwise check against MLX's product:
scripts/gemv_bench.py and the load check, docs/benchmarks.md)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from tandem.runner import gemv, weight_views


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 128)
        self.plain = nn.Linear(128, 256, bias=False)
        self.biased = nn.Linear(256, 128)

    def __call__(self, x: mx.array) -> mx.array:
        return self.embed.as_linear(self.biased(self.plain(x)))


def test_turned_off_it_checks_no_shape_and_keeps_mlxs_product(monkeypatch):
    monkeypatch.setattr(gemv, "_checked", {})
    monkeypatch.setattr(gemv, "active", True)
    monkeypatch.setenv("TANDEM_GEMV", "0")
    w = mx.zeros((256, 128))
    assert not gemv.enabled()
    assert gemv.check([w]) == 0 and not gemv.active
    assert not gemv.suits(w, mx.zeros((1, 128)))
    monkeypatch.delenv("TANDEM_GEMV")
    if not mx.cuda.is_available():  # the CPU: no kernel
        assert not gemv.enabled() and gemv.check([w]) == 0


def test_only_one_row_of_a_checked_shape_suits(monkeypatch):
    w = mx.zeros((256, 128), dtype=mx.bfloat16)
    monkeypatch.setattr(gemv, "_checked", {(256, 128, mx.bfloat16): True})
    monkeypatch.setattr(gemv, "active", True)
    one = mx.zeros((1, 128), dtype=mx.bfloat16)
    assert gemv.suits(w, one) and gemv.suits(w, one[None])
    assert not gemv.suits(w, mx.zeros((2, 128), dtype=mx.bfloat16))  # two rows
    assert not gemv.suits(w, mx.zeros((1, 1, 2, 128), dtype=mx.bfloat16))
    assert not gemv.suits(w, one.astype(mx.float32))  # another dtype
    assert not gemv.suits(mx.zeros((128, 128), dtype=mx.bfloat16), one)  # shape not checked
    assert not gemv.suits(w, mx.zeros((1, 64), dtype=mx.bfloat16))  # another width
    with pytest.raises(ValueError):
        gemv.gemv(w, mx.zeros((1, 64), dtype=mx.bfloat16))
    monkeypatch.setattr(gemv, "_checked", {(256, 128, mx.bfloat16): False})  # checked unequal
    assert not gemv.suits(w, one)


@pytest.mark.parametrize("rows", [1, 3])
def test_views_send_one_row_of_bias_free_weights_to_the_kernel(monkeypatch, rows):
    """The kernel stood in for by MLX's product (recording its calls): a one-row input of
    the bias-free layer and the tied output projection goes to it, the biased layer and
    inputs of more rows do not, and the outputs are the model's."""
    monkeypatch.delenv("TANDEM_WEIGHT_VIEWS", raising=False)
    monkeypatch.setattr(gemv, "_checked", {})  # (install's own check leaves them alone)
    monkeypatch.setattr(gemv, "active", False)
    mx.random.seed(0)
    net = _Net()
    x = mx.random.normal((1, rows, 128))
    want = net(x)
    weight_views.install(net)
    calls: list[tuple] = []

    def fake(w: mx.array, x: mx.array) -> mx.array:
        calls.append(tuple(w.shape))
        return x @ w.T

    shapes = {(256, 128, mx.float32): True, (50, 128, mx.float32): True}
    monkeypatch.setattr(gemv, "_checked", shapes)
    monkeypatch.setattr(gemv, "active", True)
    monkeypatch.setattr(gemv, "gemv", fake)
    got = net(x)
    assert mx.array_equal(got, want).item()
    assert calls == ([(256, 128), (50, 128)] if rows == 1 else [])
    # A weight replaced after load gets MLX's path (the kernel was checked on the views').
    calls.clear()
    net.plain.weight = net.plain.weight * 2
    net(x)
    assert calls == ([(50, 128)] if rows == 1 else [])
