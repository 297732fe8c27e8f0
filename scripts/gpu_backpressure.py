"""MLX's eval backpressure at batch 1 on a GPU: how far the host runs ahead of the device.

MLX's CUDA backend commits its recorded kernels as one task every ``MLX_MAX_OPS_PER_BUFFER``
nodes (100 on an H100/H200, 20 on most others; also once its inputs pass
``MLX_MAX_MB_PER_BUFFER``), and ``eval``/``async_eval`` block the submitting thread while more than
10 tasks are in flight. A decode step of hundreds of nodes is then tens of tasks, so the host
can queue only a fraction of a step ahead, and an overlapped loop's submit of step N+1 waits
for most of step N. Run once per value of MLX_MAX_OPS_PER_BUFFER (it is read once per process):

    for v in 20 40 80 160; do MLX_MAX_OPS_PER_BUFFER=$v python scripts/gpu_backpressure.py DIR; done

Prints one JSON line: the plain loop (mlx-lm's model and caches, argmax) synchronous and
chained (step N+1 built on N's lazy token and submitted before N is read), tok/s and the
median time the host spent inside ``async_eval`` per step; the graph nodes of one step; and
Tandem's single stream with overlap on and off (``LLM.stream``, decode tok/s).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import tandem.runner  # noqa: F401  (BLAS before mlx)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from tandem.bench.step_profile import _count_nodes

STEPS = 256


def plain(model, chained: bool) -> tuple[float, float]:
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array([[11 + i % 50 for i in range(32)]]), cache=cache)[:, -1], -1)
    mx.eval(y)
    submit: list[float] = []
    t0 = time.perf_counter()
    for _ in range(STEPS):
        nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        t = time.perf_counter()
        if chained:
            mx.async_eval(nxt)
            submit.append(time.perf_counter() - t)
            y.item()
        else:
            mx.async_eval(nxt)
            submit.append(time.perf_counter() - t)
            nxt.item()
        y = nxt
    y.item()
    return STEPS / (time.perf_counter() - t0), statistics.median(submit) * 1e3


def nodes(model) -> dict[str, int]:
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array([[11, 12, 13]]), cache=cache)[:, -1], -1)
    mx.eval(y)
    return _count_nodes([mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)])


def tandem(path: str, overlap: bool) -> float:
    from tandem import LLM, SamplingParams

    llm = LLM(path, overlap=overlap, max_num_seqs=8, kv_budget_tokens=4096)
    sp = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    rates = []
    for _ in range(3):
        t0 = 0.0
        for i, _ in enumerate(llm.stream([11 + i % 50 for i in range(32)], sp)):
            if i == 0:
                t0 = time.perf_counter()
        rates.append((STEPS - 1) / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    path = sys.argv[1]
    model = load(path)[0]
    out: dict[str, object] = {
        "max_ops_per_buffer": os.environ.get("MLX_MAX_OPS_PER_BUFFER", "default")
    }
    out["step_nodes"] = sum(nodes(model).values())
    for mode in ("sync", "chained"):
        runs = [plain(model, mode == "chained") for _ in range(3)]
        out[f"plain_{mode}_tok_s"] = round(statistics.median(r[0] for r in runs), 1)
        out[f"plain_{mode}_submit_ms"] = round(statistics.median(r[1] for r in runs), 3)
    model = None
    mx.clear_cache()
    if "--no-tandem" not in sys.argv:
        for overlap in (True, False):
            out[f"tandem_overlap_{'on' if overlap else 'off'}_tok_s"] = round(
                tandem(path, overlap), 1
            )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
