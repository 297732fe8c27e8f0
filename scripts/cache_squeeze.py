"""Cached prompts sent again to a pool too small for all of them (engine/admission.py, the
cache-aware jump): B prompts of L tokens are run once (each finished request leaves its
prompt cached), then again with 24 output tokens each; prints the wall time of the second
run and the tokens its steps computed (B x L if every prompt is computed again; about L plus
the decodes if only the one that does not fit is).

    python scripts/cache_squeeze.py [--shape tiny] [--batch 4] [--len 2000] [--budgets 16384,7200]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    import tandem.runner  # noqa: F401  (preloads BLAS before mlx)
    from tandem import LLM, SamplingParams
    from tandem.bench.shapes import make_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--len", type=int, default=2000)
    p.add_argument("--budgets", default="16384,7200", help="KV pool sizes in tokens")
    a = p.parse_args()
    prompts = [[10 + (i * 7 + j) % 400 for j in range(a.len)] for i in range(a.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(a.shape, a.dtype, Path(tmp))
        for budget in (int(b) for b in a.budgets.split(",")):
            for overlap in (False, True):
                opts = {"max_num_seqs": 8, "kv_budget_tokens": budget}
                with LLM(str(path), overlap=overlap, **opts) as llm:
                    runner = llm.engine.loop.runner
                    real, computed = runner.launch, [0]

                    def launch(plan, parent, masks=None, _real=real, _n=computed, **kw):
                        _n[0] += sum(s.num_tokens for s in plan.segments)
                        return _real(plan, parent, masks, **kw)

                    runner.launch = launch
                    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
                    computed[0] = 0
                    t = time.perf_counter()
                    llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
                    dt = time.perf_counter() - t
                    del runner.launch
                print(
                    f"pool {budget} tokens, overlap {'on' if overlap else 'off'}: "
                    f"{dt * 1e3:.0f} ms, {computed[0]} tokens computed",
                    flush=True,
                )


if __name__ == "__main__":
    main()
