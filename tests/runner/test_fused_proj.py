"""Fused projections (runner/fused_proj.py): q/k/v and gate/up as one matmul for one-row
inputs, each part's own rows otherwise; bit-for-bit the modules they replace, and greedy
output token-exact with mlx-lm through the engine."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from tandem.runner import fused_proj


class _Attention(nn.Module):
    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.q_proj = nn.Linear(64, 128, bias=bias)
        self.k_proj = nn.Linear(64, 32, bias=bias)
        self.v_proj = nn.Linear(64, 32, bias=bias)

    def __call__(self, x: mx.array, kv: mx.array | None = None) -> tuple[mx.array, ...]:
        src = x if kv is None else kv  # keys and values from another tensor
        return self.q_proj(x), self.k_proj(src), self.v_proj(src)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(64, 96, bias=False)
        self.up_proj = nn.Linear(64, 96, bias=False)
        self.down_proj = nn.Linear(96, 64, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.fixture
def matmuls(monkeypatch) -> list[bool]:
    """Each matmul the fused layers run: True for the whole fused product, False for one
    part's own rows."""
    calls: list[bool] = []
    real = fused_proj.FusedLinear._matmul

    def counting(self, x, a):
        calls.append(a is self)
        return real(self, x, a)

    monkeypatch.setattr(fused_proj.FusedLinear, "_matmul", counting)
    return calls


def _inputs() -> list[mx.array]:
    mx.random.seed(3)
    return [mx.random.normal(s) for s in ((1, 1, 64), (1, 5, 64), (4, 1, 64), (64,))]


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_parts_match_the_modules_they_replace(quantize: bool, bias: bool) -> None:
    attn, mlp = _Attention(bias), _Mlp()
    if quantize:
        nn.quantize(attn, group_size=32, bits=4)
        nn.quantize(mlp, group_size=32, bits=4)
    xs = _inputs()
    want = [(attn(x), mlp(x)) for x in xs]
    fused = fused_proj.fuse(attn) + fused_proj.fuse(mlp)
    assert len(fused) == 2
    assert isinstance(attn.k_proj, fused_proj.Part) and isinstance(mlp.up_proj, fused_proj.Part)
    # The parameters are the fused arrays once: no second copy of the weights.
    names = {k for k, _ in nn.utils.tree_flatten(attn.parameters())}
    assert all(k.startswith("fused_q_k_v.") for k in names), names
    for x, (a, m) in zip(xs, want, strict=True):
        got_a, got_m = attn(x), mlp(x)
        assert all(mx.array_equal(u, v).item() for u, v in zip(a, got_a, strict=True))
        assert mx.array_equal(m, got_m).item()
    # The product is let go once every part has its slice.
    assert all(f._pending.out is None for f in fused)


def test_one_row_runs_one_matmul(matmuls) -> None:
    attn = _Attention()
    fused_proj.fuse(attn)
    attn(mx.zeros((1, 1, 64)))
    assert matmuls == [True]  # the fused product, sliced three ways
    matmuls.clear()
    attn(mx.zeros((2, 1, 64)))
    assert matmuls == [False, False, False]  # each part its own rows


def test_inputs_up_to_rows_take_the_fused_product(matmuls) -> None:
    """With ``rows`` 4, inputs of up to 4 rows take strided slices of one product, and
    give the same values; more rows take each part's own."""
    attn, mlp = _Attention(bias=True), _Mlp()
    xs = [mx.random.normal(s) for s in ((4, 1, 64), (2, 2, 64), (5, 1, 64))]
    want = [(attn(x), mlp(x)) for x in xs]
    fused_proj.fuse(attn, rows=4)
    fused_proj.fuse(mlp, rows=4)
    for x, (a, m) in zip(xs, want, strict=True):
        got_a = attn(x)
        assert all(mx.array_equal(u, v).item() for u, v in zip(a, got_a, strict=True))
        assert mx.array_equal(m, mlp(x)).item()
    assert matmuls == [True, True, True, True] + [False] * 5


def test_a_part_on_another_input_computes_its_own(matmuls) -> None:
    """q on x, k and v on another tensor: q takes the fused product, k and v their own rows
    (not the whole product again); a forward's end drops q's pending product."""
    attn = _Attention()
    x, kv = mx.random.normal((1, 1, 64)), mx.random.normal((1, 1, 64))
    want = attn(x, kv)
    fused = fused_proj.fuse(attn)
    with fused_proj.releasing(fused):
        got = attn(x, kv)
    assert all(mx.array_equal(u, v).item() for u, v in zip(want, got, strict=True))
    assert matmuls == [True, False, False]
    assert fused[0]._pending.out is None


def test_groups_that_differ_are_left_alone() -> None:
    attn = _Attention()
    attn.v_proj = nn.Linear(48, 32, bias=False)  # another input size
    mlp = _Mlp()
    mlp.up_proj = nn.QuantizedLinear(64, 96, bias=False, group_size=32, bits=4)
    assert fused_proj.fuse(attn) == [] and fused_proj.fuse(mlp) == []
    assert type(attn.q_proj) is nn.Linear and type(mlp.gate_proj) is nn.Linear


def test_off_by_default(tmp_path) -> None:
    from tandem import LLM
    from tandem.testing.tiny_models import make_tiny_model

    llm = LLM(str(make_tiny_model(tmp_path / "m", "llama", dtype="float32")))
    runner = llm.engine.loop.runner
    q = runner.model.layers[0].self_attn.q_proj
    assert runner.fused == [] and isinstance(q, nn.Linear) and type(q).__name__ == "Linear"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(("overlap", "rows"), [(True, 1), (False, 1), (True, 8)])
def test_engine_greedy_exact_with_mlx_lm(tmp_path, arch: str, overlap: bool, rows: int) -> None:
    """A single stream (fused one-row steps) and a batch (each part's own rows, or strided
    slices of the product with ``rows`` 8), token-exact with mlx-lm's unfused model."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    from tandem import LLM, SamplingParams
    from tandem.testing.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch, dtype="float32")
    model = load(str(path))[0]
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(4)]
    want = []
    for p in prompts:
        steps = generate_step(mx.array(p), model, max_tokens=24)
        want.append([int(t) for t, _ in steps])
    llm = LLM(str(path), overlap=overlap, max_num_seqs=4, fuse_projections=rows)
    assert llm.engine.loop.runner.fused, "nothing was fused"
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert [llm.generate([p], sp)[0].token_ids for p in prompts] == want
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
