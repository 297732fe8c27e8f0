"""The engine's own Python per steady decode step at B rows, without MLX: the scheduler's
``schedule`` and ``update`` around the fake runner (tandem/testing/fake_runner.py), all
requests decoding, overlap on. On a GPU at B = 256 a step is all host work (docs/benchmarks.md,
"B = 256, compiled and not"), so these two are a floor under it.

    python scripts/sched_host_cost.py [B [STEPS]]

Prints medians over STEPS steps (after 80 to reach steady decoding) in milliseconds, and how
many steps were chained (all of them, unless the pool ran short).
"""

from __future__ import annotations

import statistics
import sys
import time

from tandem.engine.engine import Engine
from tandem.engine.scheduler import SchedulerConfig
from tandem.sampling_params import SamplingParams
from tandem.testing.fake_runner import FakeRunner


def main() -> None:
    b = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    cfg = SchedulerConfig(
        max_num_seqs=b,
        max_model_len=4096,
        page_size=16,
        max_num_batched_tokens=2048,
        kv_budget_tokens=1 << 20,
    )
    engine = Engine(FakeRunner(cfg.num_pages, cfg.page_size), cfg, overlap=True)
    params = SamplingParams(max_tokens=steps + 200, temperature=0, ignore_eos=True)
    for i in range(b):
        engine.add_request([5 + i % 50, 9, 14, 3] * 64, params, f"r{i}")
    for _ in range(80):
        engine.step()
    sched = engine.scheduler
    spent = {"schedule": 0.0, "update": 0.0}

    def timed(name, fn):
        def wrap(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t

        return wrap

    sched.schedule = timed("schedule", sched.schedule)
    sched.update = timed("update", sched.update)
    rows: dict[str, list[float]] = {"schedule": [], "update": []}
    chained = engine.loop.num_chained
    for _ in range(steps):
        spent.update(schedule=0.0, update=0.0)
        engine.step()
        for k, v in spent.items():
            rows[k].append(v * 1e3)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(
        f"B={b}: schedule {med['schedule']:.3f} ms, update {med['update']:.3f} ms a step; "
        f"{engine.loop.num_chained - chained} of {steps} steps chained"
    )


if __name__ == "__main__":
    main()
