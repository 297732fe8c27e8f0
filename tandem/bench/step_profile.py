"""Where a decode step's time goes, phase by phase, and how many graph nodes it submits.

    python -m tandem.bench.step_profile --shape qwen3-0.6b --dtype bfloat16 --batch 1,16,64

Runs B equal prompts through the engine and times every phase of each steady decode step
(the loop's steps whose launched plan holds only B single-token segments), overlap on and off:

- ``schedule``: ``Scheduler.schedule`` (admission, pages, the frozen plan);
- ``build``: ``ModelRunner.launch`` without its submission (inputs, step layout, the model's
  lazy graph, sampling);
- ``submit``: ``mx.async_eval`` of the step's outputs;
- ``wait``: ``ModelRunner.finalize`` (blocking on the tokens, then plain Python values);
- ``update``: ``Scheduler.update`` (tokens appended, stops, late release, outputs);
- ``other``: the rest of the loop's step (invariant checks off; outputs handed back);
- ``step``: the whole ``loop.step()``, and ``nodes``: primitives in one decode step's graph
  (``mx.export_to_dot``, counted once with overlap off: roughly the kernels it launches).

With overlap on, ``wait`` is what the host could not hide behind the device. Steps whose
host work ran on the loop's helper thread (``threaded``: ``schedule`` and ``update`` beside
``submit``, engine/loop.py) overlap their phases, so those need not add up to ``step``.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

PHASES = ("schedule", "build", "submit", "wait", "update", "other", "step")


def _count_nodes(arrays) -> dict[str, int]:
    """Primitives in the graph of ``arrays``, by kind (most first)."""
    import mlx.core as mx

    f = io.StringIO()
    mx.export_to_dot(f, *arrays)
    kinds = Counter(
        label.split(" ")[0]
        for label in re.findall(r'label ="([^"]+)", shape=rectangle', f.getvalue())
    )
    return dict(kinds.most_common())


def profile(
    path: Path,
    batch: int,
    in_len: int,
    steps: int,
    overlap: bool,
    double_buffer: bool | None = None,
    count_nodes: bool = False,
    options: dict[str, Any] | None = None,
    cache_prompts: bool = False,
) -> dict[str, Any]:
    import tandem.runner.model_runner as mr
    from tandem import LLM, SamplingParams

    options = {"kv_double_buffer": double_buffer, **(options or {})}
    llm = LLM(str(path), overlap=overlap, max_num_seqs=max(batch, 8), **options)
    loop = llm.engine.loop
    runner, sched = loop.runner, loop.scheduler
    cur: dict[str, float] = {}
    steady = [False]  # the step's launched plan is B single-token segments
    nodes: list[dict[str, int]] = []
    seen = [0]  # steady steps submitted (the graph counted is one of them)
    rec: dict[str, list[float]] = {k: [] for k in PHASES}
    plans: Counter[str] = Counter()  # the timed run's launched plans: segments x tokens

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                cur[name] = cur.get(name, 0.0) + time.perf_counter() - t

        return wrapper

    real = {
        "schedule": sched.schedule,
        "launch": runner.launch,
        "finalize": runner.finalize,
        "update": sched.update,
        "async_eval": mr.mx.async_eval,
        "step": loop.step,
    }

    def async_eval(*arrays):
        # The 4th steady step's graph: the first after a prefill reads every row's recurrent
        # state from the pool, where later ones keep them resident (runner/state.py).
        if count_nodes and steady[0]:
            seen[0] += 1
            if seen[0] == 4:
                nodes.append(_count_nodes(arrays))
        t = time.perf_counter()
        real["async_eval"](*arrays)
        cur["submit"] = cur.get("submit", 0.0) + time.perf_counter() - t

    def launch(plan, parent, masks=None, **kw):
        steady[0] = len(plan.segments) == batch and all(s.num_tokens == 1 for s in plan.segments)
        plans[f"{len(plan.segments)}x{sum(s.num_tokens for s in plan.segments)}"] += 1
        t = time.perf_counter()
        submit0 = cur.get("submit", 0.0)
        h = real["launch"](plan, parent, masks, **kw)
        spent = time.perf_counter() - t
        cur["build"] = cur.get("build", 0.0) + spent - (cur.get("submit", 0.0) - submit0)
        cur["steady"] = cur.get("steady", 1.0) * steady[0]
        return h

    def step():
        cur.clear()
        t = time.perf_counter()
        out = real["step"]()
        total = time.perf_counter() - t
        if cur.get("steady"):
            for k in PHASES[:5]:
                rec[k].append(cur.get(k, 0.0))
            rec["other"].append(total - sum(cur.get(k, 0.0) for k in PHASES[:5]))
            rec["step"].append(total)
        return out

    sched.schedule = timed("schedule", real["schedule"])
    runner.finalize = timed("wait", real["finalize"])
    sched.update = timed("update", real["update"])
    runner.launch, loop.step, mr.mx.async_eval = launch, step, async_eval
    try:
        prompts = [[10 + (i * 7 + j) % 400 for j in range(in_len)] for i in range(batch)]
        sp = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        if cache_prompts:  # the timed run's prompts are prefix hits: all B decode at once
            llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        for v in rec.values():
            v.clear()
        nodes.clear()  # a warm-up step may have been counted (sampled rows)
        plans.clear()
        chained0, fresh0, threaded0 = loop.num_chained, loop.num_fresh, loop.num_threaded
        seen[0] = 0
        t = time.perf_counter()
        llm.generate(prompts, sp)
        total = time.perf_counter() - t
    finally:
        mr.mx.async_eval = real["async_eval"]
        for obj, name in ((sched, "schedule"), (sched, "update"), (runner, "launch")):
            delattr(obj, name)  # (the class's own again: no cycle through these closures)
        del runner.finalize, loop.step
        # Its memory goes now: the next engine sizes its KV pool from what is free, and one
        # left to the collector still holds its pool and weights then.
        llm.close()
    out: dict[str, Any] = {k: statistics.median(v) * 1e3 for k, v in rec.items() if v}
    out["steady_steps"] = len(rec["step"])
    out["tok_s"] = batch * steps / total
    # What the timed run launched (a run with few steady steps says why here).
    out["plans"] = dict(plans.most_common(6))
    out["chained"] = loop.num_chained - chained0
    out["fresh"] = loop.num_fresh - fresh0
    out["threaded"] = loop.num_threaded - threaded0  # (then phases overlap: see engine/loop.py)
    out["pool_tokens"] = sched.kv.num_pages * sched.config.page_size
    if nodes:
        out["nodes"] = sum(nodes[0].values())
        out["node_kinds"] = nodes[0]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import tandem.runner  # noqa: F401  (preloads BLAS before mlx)
    from tandem.bench.shapes import RANDOM_SHAPES, make_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory (default: a random-weight --shape)")
    p.add_argument("--shape", choices=RANDOM_SHAPES, default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", default="1,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument(
        "--single-buffer-too", action="store_true", help="also overlap on with one KV buffer set"
    )
    p.add_argument("--engine-options", default="{}", help="JSON of more engine options")
    p.add_argument("--overlap-only", action="store_true", help="skip the overlap-off run")
    p.add_argument(
        "--cache-prompts",
        action="store_true",
        help="run the prompts once first, so the timed run's are prefix hits and its B "
        "requests decode together from the start (long prompts, where a request would "
        "otherwise finish before the last one's prefill)",
    )
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    options = json.loads(a.engine_options)
    results: dict[str, Any] = {"model": a.model or f"random {a.shape} ({a.dtype})", "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(a.model) if a.model else make_model(a.shape, a.dtype, Path(tmp))
        for b in [int(x) for x in a.batch.split(",")]:
            modes = [(True, None)] if a.overlap_only else [(False, None), (True, None)]
            modes += [(True, False)] if a.single_buffer_too else []
            for overlap, double in modes:
                r = profile(
                    path,
                    b,
                    a.input_len,
                    a.steps,
                    overlap,
                    double,
                    not overlap,
                    options,
                    cache_prompts=a.cache_prompts,
                )
                name = ("on " if overlap else "off") + (" 1buf" if double is False else "")
                results["runs"].append({"batch": b, "overlap": name.strip(), **r})
                cells = "  ".join(f"{k}={r[k]:.2f}" for k in (*PHASES, "tok_s") if k in r) + (
                    f"  nodes={r['nodes']}" if "nodes" in r else ""
                )
                cells += f"  threaded={r['threaded']}" if r["threaded"] else ""
                print(f"B={b:<4} overlap={name} ms/step: {cells}", flush=True)
                if r["steady_steps"] < a.steps // 2:
                    print(
                        f"       few steady steps: plans {r['plans']}, chained {r['chained']}, "
                        f"traced {r['fresh']}, KV pool {r['pool_tokens']} tokens",
                        flush=True,
                    )
                if "node_kinds" in r:
                    print("      ", json.dumps(r["node_kinds"]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
