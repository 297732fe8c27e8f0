"""Does a partial-rotary model (16 of 64 dims rotated, as StableLM 2 and small GPT-NeoX /
Pythia checkpoints do) hit MLX's CUDA rope fault in Tandem's multi-prompt steps?

    python scripts/gpu_partial_rope.py

First a sweep of ``mx.fast.rope`` rotating 16 (or 8, 32) dims of (T, H, 1, D) inputs, D > dims,
with an offset per token (scripts/gpu_rope_hd16.py swept dims = D only); then a tiny float32
``stablelm`` (head dim 64, partial_rotary_factor 0.25) through Tandem, 12 prompts of 43-342 tokens
in unchunked steps, against mlx-lm's ``generate_step``: failed requests and outputs that
differ, with MLX's rope and with Tandem's guard (runner/mlx_compat.py).
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
from mlx_lm.generate import generate_step  # noqa: E402

from tandem import LLM  # noqa: E402
from tandem.runner import mlx_compat  # noqa: E402
from tandem.testing import model_zoo  # noqa: E402


def sweep() -> list[tuple[int, ...]]:
    bad = []
    for d, dims in ((64, 16), (80, 20), (128, 32), (64, 8), (32, 16)):
        for h in (1, 4, 32):
            for t in (16, 64, 128, 256, 1024, 4096):
                x = mx.random.normal((t, h, 1, d)).astype(mx.bfloat16)
                try:
                    mx.eval(
                        mx.fast.rope(
                            x, dims, traditional=False, base=1e4, scale=1.0, offset=mx.arange(t)
                        )
                    )
                except RuntimeError:
                    bad.append((d, dims, h, t))
                    assert mlx_compat.invalid_launch(x.shape, dims), "unpredicted failure"
    return bad


mlx_compat.unguard_rope()
print("partial rope failed (head dim, rotated dims, heads, tokens):", sweep())
print("guard installed:", mlx_compat.guard_cuda_rope())
print("with the guard, failed:", sweep())

over = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "partial_rotary_factor": 0.25,
}
path = model_zoo.make_zoo_model(Path(tempfile.mkdtemp()) / "stablelm", "stablelm", overrides=over)
# Prompts of their own (no shared prefix), so an unchunked step holds several of them.
rng = random.Random(1)
params = gpu_workload.requests()[1]
prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(43, 343))] for _ in params]
model = load(str(path))[0]
refs = []
for p, sp in zip(prompts, params, strict=True):
    gen = generate_step(mx.array(p), model, max_tokens=sp.max_tokens)
    refs.append([int(t) for t, _ in gen])
for name, guard, opts in (
    ("unchunked, MLX's rope", False, {"max_num_batched_tokens": 8192}),
    ("unchunked, guarded", True, {"max_num_batched_tokens": 8192}),
    ("chunked-64, guarded", True, {"max_num_batched_tokens": 64}),
):
    llm = LLM(str(path), max_num_seqs=12, compile_decode=0, **opts)
    if not guard:
        mlx_compat.unguard_rope()
    outs = llm.generate(prompts, params)
    failed = sum(o.finish_reason == "error" for o in outs)
    differ = sum(o.token_ids != r for o, r in zip(outs, refs, strict=True))
    print(f"stablelm partial rotary 16/64, {name}: failed {failed}, differ {differ} of 12")
    del llm
