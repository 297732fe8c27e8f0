"""Graph nodes of one decode step at batch 1: mlx-lm's generate_step graph (model + argmax on
its own caches) against Tandem's (the step profiler's count), for a shape or a model dir.
On MLX's CUDA backend each node is a kernel launch or more, so at batch 1 the counts predict
host time per step.

    python scripts/node_counts.py qwen3.5-tiny gemma3-tiny tiny
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import tandem.runner  # noqa: F401  (BLAS before mlx)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from tandem.bench.offline import make_model
from tandem.bench.step_profile import _count_nodes, profile


def mlx_lm_nodes(path: Path, prompt_len: int = 64) -> dict[str, int]:
    model = load(str(path))[0]
    cache = make_prompt_cache(model)
    y = mx.array([[11 + i % 50 for i in range(prompt_len)]])
    logits = model(y, cache=cache)
    tok = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(tok, [c.state for c in cache])
    for _ in range(3):
        logits = model(tok[:, None], cache=cache)
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(tok)
    logits = model(tok[:, None], cache=cache)
    tok = mx.argmax(logits[:, -1, :], axis=-1)
    states = [a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)]
    return _count_nodes([tok, *states])


def main() -> None:
    for spec in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(spec) if Path(spec).is_dir() else make_model(spec, "float32", Path(tmp))
            ml = mlx_lm_nodes(path)
            t = profile(path, 1, 64, 24, overlap=False, count_nodes=True)
            tk = t["node_kinds"]
            top = sorted(set(ml) | set(tk), key=lambda k: -max(ml.get(k, 0), tk.get(k, 0)))
            print(f"{spec}: mlx-lm {sum(ml.values())} nodes, Tandem {t['nodes']}")
            for k in top[:25]:
                print(f"  {k:60.60s} {ml.get(k, 0):5d} {tk.get(k, 0):5d}")


if __name__ == "__main__":
    main()
