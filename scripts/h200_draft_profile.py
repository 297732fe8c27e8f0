"""Where a draft-speculation round's time goes (host phases, and the wait).

    python scripts/h200_draft_profile.py TARGET DRAFT [K [KV_TOKENS|- [on|off]]]

Environment: STREAMS (requests at once, 1), REPEATS (timed runs, 2), LLM_OPTIONS (JSON).
"""

import json
import os
import sys
import time
from collections import defaultdict

import tandem.runner  # noqa: F401
from tandem import LLM, SamplingParams
from tandem.engine.loop import OverlapLoop
from tandem.runner.draft import DraftModel
from tandem.runner.model_runner import ModelRunner

target, draft = sys.argv[1], sys.argv[2]
k = int(sys.argv[3]) if len(sys.argv) > 3 else 4
budget = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] != "-" else None  # KV tokens
overlap = sys.argv[5] != "off" if len(sys.argv) > 5 else True
acc: dict[str, float] = defaultdict(float)


def timed(cls, name, key):
    orig = getattr(cls, name)

    def wrap(*a, **kw):
        t = time.perf_counter()
        try:
            return orig(*a, **kw)
        finally:
            acc[key] += time.perf_counter() - t

    setattr(cls, name, wrap)


import mlx.core as mx  # noqa: E402

timed(mx, "async_eval", "mx.async_eval (submit)")
timed(ModelRunner, "forward", "forward graphs (host, target and draft)")
timed(DraftModel, "build", "draft build (host)")
timed(ModelRunner, "launch", "launch incl. draft build")
timed(ModelRunner, "finalize", "finalize (wait)")
timed(OverlapLoop, "_launch", "loop launch incl. schedule")
opts = {"speculative": "draft", "draft_model": draft, "num_speculative_tokens": k} if k else {}
llm = LLM(
    target,
    max_num_seqs=8,
    kv_budget_tokens=budget,
    overlap=overlap,
    **opts,
    **json.loads(os.environ.get("LLM_OPTIONS", "{}")),
)
streams = int(os.environ.get("STREAMS", "1"))
prompts = [[10 + i] + list(range(11, 266)) for i in range(streams)]
p = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
llm.generate(prompts, p)
for _ in range(int(os.environ.get("REPEATS", "2"))):
    acc.clear()
    steps0 = llm.engine.loop.num_steps
    t = time.perf_counter()
    llm.generate(prompts, p)
    total = time.perf_counter() - t
    steps = llm.engine.loop.num_steps - steps0
    s = llm.engine.scheduler.stats
    print(
        f"K={k} streams {streams}: total {total * 1000:.0f} ms, "
        f"{128 * streams / total:.1f} tok/s, {steps} launches"
    )
    for key, v in acc.items():
        print(f"  {key}: {v * 1000:.0f} ms ({v * 1000 / max(1, steps):.2f} ms/launch)")
    print("  accepted/proposed", s.spec_accepted, s.spec_proposed)
    static = llm.engine.loop.runner.static
    if static is not None:
        print("  target traces/replays/verifies", static.traces, static.replays, static.verifies)
