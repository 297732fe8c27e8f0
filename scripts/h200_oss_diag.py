"""gpt_oss (sinks + windows), chunked-64 prefill: in-place writes, scatters, and mlx-lm's
generate_step, token for token on the GPU (the H200 check found in-place and scatters
disagreeing there). ``python scripts/h200_oss_diag.py [MODEL_TYPE] [OPTIONS_JSON] [VARIANTS]``
(VARIANTS: a comma list of the names below)."""

import json  # noqa: I001  (tandem.runner preloads BLAS before mlx)
import random
import sys
import tempfile
from pathlib import Path

import tandem.runner  # noqa: F401
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from tandem import LLM, SamplingParams
from tandem.testing import families

fam = sys.argv[1] if len(sys.argv) > 1 else "gpt_oss"
extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {"max_num_batched_tokens": 64}
path = families.make_family_model(Path(tempfile.mkdtemp()) / fam, fam)
rng = random.Random(0)
prefix = [rng.randrange(5, 500) for _ in range(40)]
prompts = [
    prefix + [rng.randrange(5, 500) for _ in range(rng.randrange(3, 300))] for _ in range(12)
]
ns = [rng.randrange(8, 48) for _ in prompts]
model = load(str(path))[0]
ref = [
    [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n)]
    for p, n in zip(prompts, ns, strict=True)
]
params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in ns]


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


variants = {
    "inplace": {},
    "inplace-again": {},
    "scatter": {"kv_inplace_writes": False},
    "inplace-overlap-off": {"overlap": False},
    "scatter-overlap-off": {"kv_inplace_writes": False, "overlap": False},
}
chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else list(variants)
for name, opts in [(n, variants[n]) for n in chosen]:
    llm = LLM(str(path), max_num_seqs=8, **extra, **opts)
    for rep in range(2):
        got = [r.token_ids for r in llm.generate(prompts, params)]
        diffs = [
            (i, first_diff(g, r)) for i, (g, r) in enumerate(zip(got, ref, strict=True)) if g != r
        ]
        print(
            json.dumps(
                {
                    "variant": name,
                    "pass": rep,
                    "failures": llm.engine.scheduler.stats.step_failures,
                    "mismatched_vs_mlx_lm": len(diffs),
                    "first_diffs": diffs,
                }
            ),
            flush=True,
        )
    del llm
