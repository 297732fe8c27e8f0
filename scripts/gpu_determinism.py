"""Is a tiny gpt-oss run deterministic on this backend? The same greedy requests, five engines
(scatters twice, in-place writes twice, one sequence at a time), each compared with the first;
then mlx-lm's ``generate_step`` twice (the control: does mlx-lm's own path repeat itself?).

    python scripts/gpu_determinism.py [FAMILY]     # CACHE_LIMIT0=1: mx.set_cache_limit(0)

The family model has 32-wide heads now (scripts/gpu_workload.py). On the H200 (fc32873,
float32, TF32 off; the family model then, heads 16 wide) two engines with
scatters already differed in 7 of 12 outputs (docs/benchmarks/h200-host/
determinism-gpt_oss.txt), so scripts/gpu_inplace_check.py's gpt_oss rows cannot be exact,
whatever the in-place writes do. (Tandem against Tandem: whether MLX or Tandem's sinks path
is the cause is not settled.)
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import tandem.runner  # noqa: F401, E402  (preloads BLAS before mlx)

# isort: split
import gpu_workload  # noqa: E402 - scripts/, beside this file
import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402

from tandem import LLM  # noqa: E402

if os.environ.get("CACHE_LIMIT0"):  # MLX hands no freed buffer out again
    mx.set_cache_limit(0)
family = sys.argv[1] if len(sys.argv) > 1 else "gpt_oss"
path = gpu_workload.family_model(Path(tempfile.mkdtemp()), family)
prompts, params = gpu_workload.requests()
runs = {
    "scatter1": {"kv_inplace_writes": False},
    "scatter2": {"kv_inplace_writes": False},
    "inplace1": {},
    "inplace2": {},
    "scatter-1seq": {"kv_inplace_writes": False, "max_num_seqs": 1},
}
outs = {}
for name, extra in runs.items():
    opts = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "compile_decode": 0, **extra}
    llm = LLM(str(path), **opts)
    outs[name] = [r.token_ids for r in llm.generate(prompts, params)]
    del llm
for name, got in outs.items():
    print(
        family,
        name,
        "outputs differing from scatter1:",
        sum(a != b for a, b in zip(outs["scatter1"], got, strict=True)),
    )
model = load(str(path))[0]
ref = [gpu_workload.mlx_lm_greedy(model, prompts, params) for _ in range(2)]
print(
    family,
    "mlx-lm run 2: outputs differing from mlx-lm run 1:",
    sum(a != b for a, b in zip(ref[0], ref[1], strict=True)),
)
for name, got in outs.items():
    print(
        family,
        name,
        "outputs differing from mlx-lm run 1:",
        sum(a != b for a, b in zip(ref[0], got, strict=True)),
    )
