"""Draft models for benchmarks, made from the target itself (nothing is downloaded).

``write_truncated`` writes the target's first ``layers`` decoder layers with its embeddings,
final norm and LM head as a model folder of its own: an early-exit draft, as LayerSkip and
"self-speculative" decoding use. Its tokenizer is the target's by construction, it costs
about ``layers / num_layers`` of the target's layer work plus the head, and how often it
agrees with the full model is a property of the weights, measured, never assumed. With
random weights (the H200 shapes) that agreement says little about real checkpoints; the
default model's real weights give the CPU numbers.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_truncated(model: str | None, layers: int, out: Path, dtype: str = "auto") -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from tandem.frontend.tokenizer import Tokenizer
    from tandem.model_source import resolve_model
    from tandem.runner.loader import load_model, prepare_for_device

    path = resolve_model(model)
    net, config = load_model(path, dtype)
    prepare_for_device(net, dtype)
    inner = getattr(net, "model", net)
    total = len(inner.layers)
    if not 0 < layers <= total:
        raise ValueError(f"draft layers must be in [1, {total}], got {layers}")
    inner.layers = inner.layers[:layers]
    config = {**config, "num_hidden_layers": layers}
    weights = dict(tree_flatten(net.parameters()))
    if not any(k.endswith(".scales") for k in weights):  # dequantized for this device
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str))
    Tokenizer.load(path).save(out)
    return out


def damped_init(layers: int, damping: float, tied: bool):
    """An ``init`` for ``tiny_models.make_random_model``: the usual random weights, except
    that the output projections (attention and MLP) of every layer from ``layers`` on are
    scaled by ``damping``. The later layers still run at full cost, but move the residual
    stream less, so the first ``layers`` layers (``write_truncated``) agree with the whole
    model more often as ``damping`` falls: random weights with a draft that agrees at a rate
    one can set (it is measured in every run, not assumed), for benchmarks of the
    speculation machinery on shapes no checkpoint here has."""
    import re

    from tandem.testing.tiny_models import init_std

    pattern = re.compile(r"model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\.down_proj)\.weight")

    def init(name: str, shape: tuple[int, ...]) -> float | None:
        std = init_std(name, shape, tied)
        m = pattern.fullmatch(name)
        if m and int(m.group(1)) >= layers and std is not None:
            std *= damping
        return std

    return init


# A 12-layer Qwen3 of width 256 for CPU runs (its vocabulary is the 512-token test BPE).
SMALL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}


def main(argv: list[str] | None = None) -> int:
    """Write a benchmark pair: a random target of a real shape whose layers from
    ``--layers`` on are damped, its first ``--layers`` layers as a draft, and optionally a
    random draft of another shape (same tokenizer; it agrees with the target by chance)."""
    import argparse

    import tandem.runner  # noqa: F401  (the optimized BLAS before mlx)
    from tandem.testing import tiny_models as tm

    p = argparse.ArgumentParser(prog="python -m tandem.bench.draft_model")
    p.add_argument("--shape", default="qwen3-8b", choices=("qwen3-small", "qwen3-0.6b", "qwen3-8b"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--damping", type=float, default=0.015)
    p.add_argument("--random-draft", choices=("qwen3-0.6b",))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    shapes = {"qwen3-small": SMALL, "qwen3-0.6b": tm.QWEN3_0_6B, "qwen3-8b": tm.QWEN3_8B}
    shape = shapes[args.shape]
    init = damped_init(args.layers, args.damping, bool(shape["tie_word_embeddings"]))
    target = tm.make_random_model(args.out / "target", "qwen3", shape, dtype=args.dtype, init=init)
    write_truncated(str(target), args.layers, args.out / f"draft-{args.layers}", "auto")
    if args.random_draft:
        other = shapes[args.random_draft]
        tm.make_random_model(args.out / "draft-random", "qwen3", other, dtype=args.dtype, seed=1)
    print("wrote", *sorted(str(d) for d in args.out.iterdir()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
