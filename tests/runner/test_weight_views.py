"""Linear layers' transposed weights made once (runner/weight_views.py): the same outputs
bit for bit, one graph node fewer per linear call, MLX's own path for a replaced weight, and
the engine's greedy output still mlx-lm's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tandem import LLM
from tandem.bench.step_profile import _count_nodes
from tandem.runner import weight_views
from tests.parity.test_mlx_lm_parity import greedy, reference


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.a = nn.Linear(16, 24)
        self.b = nn.Linear(24, 16, bias=False)
        self.q = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)

    def __call__(self, x: mx.array) -> mx.array:
        return self.embed.as_linear(self.b(self.a(self.embed(x))))


def _nodes(out: mx.array) -> int:
    return sum(_count_nodes([out]).values())


# Nodes saved per linear call: the Transpose, and for a batch of one row (1, L, D) also the
# Flatten and Unflatten (or addmm's two Reshapes) around the product.
@pytest.mark.parametrize(("tokens", "saved"), [([[1, 7, 3]], 9), ([[1], [7], [3]], 3)])
def test_same_outputs_fewer_nodes_per_linear_call(monkeypatch, tokens, saved):
    monkeypatch.delenv("TANDEM_WEIGHT_VIEWS", raising=False)
    mx.random.seed(0)
    net = _Net()
    mx.eval(net.parameters())
    x = mx.array(tokens)
    want = net(x)
    mx.eval(want)
    before = _nodes(net(x))
    assert weight_views.install(net) == 3  # two Linear, one Embedding; not the quantized
    assert type(net.a) is weight_views.Linear and type(net.q) is nn.QuantizedLinear
    assert isinstance(net.embed, nn.Embedding)
    got = net(x)
    assert _nodes(got) == before - saved
    assert np.array_equal(np.asarray(got), np.asarray(want))
    # The views are no parameters: the module's tree is what it was.
    assert sorted(k for k, _ in nn.utils.tree_flatten(net.parameters())) == sorted(
        k for k, _ in nn.utils.tree_flatten(_Net().parameters())
    )


def test_a_replaced_weight_is_read_not_the_old_view(monkeypatch):
    monkeypatch.delenv("TANDEM_WEIGHT_VIEWS", raising=False)
    net = _Net()
    mx.eval(net.parameters())
    weight_views.install(net)
    x = mx.ones((2, 16))
    net.a.weight = mx.zeros_like(net.a.weight)
    out = net.a(x)
    assert np.array_equal(np.asarray(out), np.broadcast_to(np.asarray(net.a.bias), (2, 24)))
    assert weight_views._HELD not in net.a.__dict__  # the old weight is let go


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_WEIGHT_VIEWS", "0")
    net = _Net()
    assert weight_views.install(net) == 0
    assert type(net.a) is nn.Linear


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_installs_them_and_stays_mlx_lms_greedy(tiny_model_dir, arch, monkeypatch):
    monkeypatch.delenv("TANDEM_WEIGHT_VIEWS", raising=False)
    path = tiny_model_dir(arch)
    llm = LLM(str(path))
    kinds = {type(m) for _, m in llm.engine.loop.runner.model.named_modules()}
    assert nn.Linear not in kinds and weight_views.Linear in kinds
    prompt = [5 + (3 * j) % 200 for j in range(20)]
    out = llm.generate([prompt], greedy(16))[0]
    assert out.token_ids == reference(path, prompt, 16)


def test_the_views_share_the_weights_memory(monkeypatch):
    monkeypatch.delenv("TANDEM_WEIGHT_VIEWS", raising=False)
    net = nn.Linear(512, 1024, bias=False)
    mx.eval(net.parameters())
    before = mx.get_active_memory()
    assert weight_views.install(net) == 1
    assert mx.get_active_memory() - before < net.weight.nbytes // 8  # views, no copies
