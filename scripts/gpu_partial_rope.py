"""Does a partial-rotary model (16 of 64 dims rotated, as StableLM 2 and small GPT-NeoX /
Pythia checkpoints do) hit MLX's CUDA rope fault in Tandem's multi-prompt steps?

    python scripts/gpu_partial_rope.py

First a sweep of ``mx.fast.rope`` rotating 16 (or 8, 32) dims of (T, H, 1, D) inputs, D > dims,
with an offset per token (scripts/gpu_rope_hd16.py swept dims = D only); then a tiny float32
``stablelm`` (head dim 64, partial_rotary_factor 0.25) through Tandem, 12 staggered prompts of
43-342 tokens in unchunked steps, against mlx-lm's ``generate_step``: failed requests and
outputs that differ.
"""

import os
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
from tandem.testing import model_zoo  # noqa: E402

bad = []
for d, dims in ((64, 16), (80, 20), (128, 32), (64, 8), (32, 16)):
    for h in (1, 4, 32):
        for t in (64, 128, 256, 1024):
            x = mx.random.normal((t, h, 1, d)).astype(mx.bfloat16)
            try:
                mx.eval(
                    mx.fast.rope(
                        x, dims, traditional=False, base=1e4, scale=1.0, offset=mx.arange(t)
                    )
                )
            except RuntimeError:
                bad.append((d, dims, h, t))
print("partial rope failed (head dim, rotated dims, heads, tokens):", bad)

over = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "partial_rotary_factor": 0.25,
}
path = model_zoo.make_zoo_model(Path(tempfile.mkdtemp()) / "stablelm", "stablelm", overrides=over)
prompts, params = gpu_workload.requests()
model = load(str(path))[0]
refs = []
for p, sp in zip(prompts, params, strict=True):
    gen = generate_step(mx.array(p), model, max_tokens=sp.max_tokens)
    refs.append([int(t) for t, _ in gen])
for name, opts in {
    "unchunked": {"max_num_batched_tokens": 8192},
    "chunked-64": {"max_num_batched_tokens": 64},
}.items():
    llm = LLM(str(path), max_num_seqs=12, compile_decode=0, **opts)
    outs = llm.generate(prompts, params)
    failed = sum(o.finish_reason == "error" for o in outs)
    differ = sum(o.token_ids != r for o, r in zip(outs, refs, strict=True))
    print(f"stablelm partial rotary 16/64, {name}: failed {failed}, differ {differ} of 12")
    del llm
