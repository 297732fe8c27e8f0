"""Step times by plan under n-gram speculation: one stream of the copy workload (the default
model rewriting a source file, tandem/bench/speculative.py), each loop step timed and keyed
by its launched segments' token counts ("1": a plain decode step, "5": a verify of 4
proposals), medians printed. What a verify costs against a plain step on this machine.

    python scripts/spec_step_times.py [--k 4] [--max-tokens 160] [--engine-options JSON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import tandem.runner  # noqa: F401  (preloads BLAS before mlx)
from tandem import LLM, SamplingParams
from tandem.bench.speculative import copy_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--engine-options", default="{}")
    a = p.parse_args()
    options = {"speculative_min_gain": 0, **json.loads(a.engine_options)}
    llm = LLM(None, speculative="ngram", num_speculative_tokens=a.k, **options)
    loop, runner = llm.engine.loop, llm.engine.loop.runner
    times: dict[str, list[float]] = defaultdict(list)
    shape = [""]
    launch, step = runner.launch, loop.step

    def timed_launch(plan, *args, **kw):
        shape[0] = "+".join(str(s.num_tokens) for s in plan.segments)
        return launch(plan, *args, **kw)

    def timed_step():
        shape[0] = "-"
        t = time.perf_counter()
        out = step()
        times[shape[0]].append((time.perf_counter() - t) * 1e3)
        return out

    runner.launch, loop.step = timed_launch, timed_step
    prompts = copy_prompts(llm, 1, a.prompt_tokens)
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    times.clear()
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, sp)
    print(f"{a.max_tokens} tokens in {time.perf_counter() - t:.2f} s")
    for key, v in sorted(times.items(), key=lambda kv: -len(kv[1])):
        print(f"plan {key:>6}: {len(v):4d} steps, median {statistics.median(v):7.1f} ms")
    llm.close()


if __name__ == "__main__":
    main()
