"""Does a partial-rotary model (16 of 64 dims rotated, as small GPT-NeoX / Pythia and
StableLM 2 checkpoints do) hit MLX's CUDA rope fault in Tandem's multi-prompt steps?

    python scripts/gpu_partial_rope.py

First a sweep of ``mx.fast.rope`` rotating 16 (or 8, 32) dims of (T, H, 1, D) inputs, D > dims,
with an offset per token (scripts/gpu_rope_hd16.py swept dims = D only); then a tiny float32
``gpt_neox`` (head dim 64, rotary_pct 0.25) through Tandem, 12 prompts of 43-342 tokens in
unchunked steps (one step of them all), against mlx-lm's ``generate_step``: failed requests,
outputs that differ, and how many rope calls had a shape MLX rejects, with MLX's rope and
with Tandem's guard (runner/mlx_compat.py). On the CPU nothing fails either way.
"""

import os
import random
import tempfile
from pathlib import Path

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import tandem.runner  # noqa: F401, E402  (preloads BLAS before mlx)

# isort: split
import gpu_workload  # noqa: E402 - scripts/, beside this file
import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402

from tandem import LLM  # noqa: E402
from tandem.runner import mlx_compat  # noqa: E402
from tandem.testing import model_zoo  # noqa: E402


def sweep(dtype) -> dict[str, list[tuple[int, ...]]]:
    """Which (head dim, rotated dims, heads, tokens) failed, and where the prediction
    (``mlx_compat.invalid_launch``) was wrong either way."""
    out: dict[str, list[tuple[int, ...]]] = {"failed": [], "unpredicted": [], "passed": []}
    for d, dims in ((64, 16), (80, 20), (128, 32), (64, 8), (32, 16)):
        for h in (1, 4, 32):
            for t in (16, 64, 128, 256, 1024, 4096):
                x = mx.random.normal((t, h, 1, d)).astype(dtype)
                predicted = mlx_compat.invalid_launch(x.shape, dims)
                try:
                    mx.eval(
                        mx.fast.rope(
                            x, dims, traditional=False, base=1e4, scale=1.0, offset=mx.arange(t)
                        )
                    )
                    if predicted and mx.fast.rope is not mlx_compat._guarded_rope:
                        out["passed"].append((d, dims, h, t))  # predicted to fail
                except RuntimeError:
                    out["failed"].append((d, dims, h, t))
                    if not predicted:
                        out["unpredicted"].append((d, dims, h, t))
    return out


mlx_compat.unguard_rope()
for dtype in (mx.bfloat16, mx.float32):
    r = sweep(dtype)
    print(dtype, "MLX's rope, failed (head dim, rotated dims, heads, tokens):", r["failed"])
    print(dtype, "failed unpredicted:", r["unpredicted"], "predicted but passed:", r["passed"])
print("guard installed (forced on the CPU):", mlx_compat.guard_cuda_rope(force=True))
print("with the guard, failed:", sweep(mx.float32)["failed"])

# The model's rope calls in its steps: how many had a shape the predicate flags.
flagged = [0, 0]
# GPT-NeoX (Pythia) rotates rotary_pct of each head. (A tiny stablelm would not do: Tandem
# runs its layers as dense ones, at most 64 tokens a step, which never reach the fault.)
over = {"hidden_size": 256, "num_attention_heads": 4, "rotary_pct": 0.25}
path = model_zoo.make_zoo_model(Path(tempfile.mkdtemp()) / "gpt_neox", "gpt_neox", overrides=over)
# Prompts of their own (no shared prefix), so an unchunked step holds several of them.
rng = random.Random(1)
params = gpu_workload.requests()[1]
prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(43, 343))] for _ in params]
refs = gpu_workload.mlx_lm_greedy(load(str(path))[0], prompts, params)
for name, guard, opts in (
    ("unchunked, MLX's rope", False, {"max_num_batched_tokens": 8192}),
    ("unchunked, guarded", True, {"max_num_batched_tokens": 8192}),
    ("chunked-64, guarded", True, {"max_num_batched_tokens": 64}),
):
    llm = LLM(str(path), max_num_seqs=12, compile_decode=0, **opts)
    if guard:
        mlx_compat.guard_cuda_rope(force=True)  # (load_model installs it on CUDA only)
    else:
        mlx_compat.unguard_rope()
    inner = mx.fast.rope
    flagged[:] = [0, 0]

    def counting(a, dims, _inner=inner, **kw):
        flagged[0] += 1
        flagged[1] += mlx_compat.invalid_launch(a.shape, dims)
        return _inner(a, dims, **kw)

    mx.fast.rope = counting
    try:
        outs = llm.generate(prompts, params)
    finally:
        mx.fast.rope = inner
    failed = sum(o.finish_reason == "error" for o in outs)
    differ = sum(o.token_ids != r for o, r in zip(outs, refs, strict=True))
    print(
        f"gpt_neox rotary 16 of 64, {name}: failed {failed}, differ {differ} of 12; "
        f"rope calls {flagged[0]}, of a shape MLX rejects {flagged[1]}"
    )
    del llm
