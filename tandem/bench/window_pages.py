"""Sliding-window pages freed behind the window: how many long requests run at once in the
same KV memory, and how fast, with the window group (engine/kv_manager.py) and without it.

N requests of ``--prompt-len`` tokens (``--output-len`` out each) arrive at once. Both runs
get the same KV memory (``--kv-mib``): without the group every layer keeps every position
(``kv_window_pages=0``, a pool of M / bytes-per-token tokens); with it the windowed layers'
pages come from the group sized as build.py sizes it (``--window-pages`` to set it) and the
rest of M goes to the full-attention layers' pages. Reports the pools, the peak number of
requests running at once, retractions, time to first token and output throughput.

    python -m tandem.bench.window_pages --shape gemma3-tiny --requests 16 --prompt-len 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.bench.shapes import RANDOM_SHAPES, make_model


def run(llm: Any, prompts: list[list[int]], out_len: int) -> dict[str, Any]:
    from tandem import SamplingParams

    engine = llm.engine
    sched = engine.scheduler
    sp = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = {engine.add_request(p, sp): i for i, p in enumerate(prompts)}
    first: dict[int, float] = {}
    tokens = peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                first.setdefault(ids[out.request_id], time.perf_counter() - t0)
                tokens += len(out.new_token_ids)
        peak = max(peak, sum(not r.finished for r in sched.running.values()))
    wall = time.perf_counter() - t0
    kv = sched.kv
    return {
        "full_pages": kv.num_pages,
        "window_pages": kv.walloc.num_pages if kv.walloc is not None else 0,
        "peak_running": peak,
        "retractions": sched.stats.retractions,
        "ttft_median_s": round(statistics.median(first.values()), 3),
        "ttft_max_s": round(max(first.values()), 3),
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 1),
    }


def main(argv: list[str] | None = None) -> None:
    import tandem.runner  # noqa: F401  (preloads BLAS before mlx)
    from tandem import LLM
    from tandem.build import _fit_window_group, _step_tokens, _window_pages
    from tandem.config import EngineConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=RANDOM_SHAPES, default="gemma3-tiny")
    p.add_argument("--model", help="a model directory instead of a random shape")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-mib", type=float, default=0, help="KV memory (default: 4 prompts)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--window-pages", type=int, default=0, help="the group's size (default: auto)")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else make_model(args.shape, args.dtype, Path(tmp))
        opts: dict[str, Any] = {"max_num_seqs": args.max_num_seqs, "dtype": "auto"}
        probe = LLM(str(path), kv_budget_tokens=4096, kv_window_pages=0, **opts)
        runner = probe.engine.loop.runner
        per_token, wbytes, window = (
            runner.bytes_per_token,
            runner.window_bytes_per_token(),
            runner.max_window,
        )
        vocab = runner.vocab_size
        step = _step_tokens(runner, EngineConfig(), probe.max_model_len, 16)  # as build.py
        probe.close()
        if not window:
            raise SystemExit(f"{path}: no sliding-window layer")
        total = args.prompt_len + args.output_len
        memory = int(args.kv_mib * 2**20) or 4 * total * per_token
        page = 16
        # The group as build.py sizes it (every sequence's window, within half the memory).
        config = EngineConfig(max_num_seqs=args.max_num_seqs)
        nw = args.window_pages or _fit_window_group(
            config, _window_pages(config, window, page, step), window, page, wbytes, memory, 2
        )
        full_tokens = (memory - nw * page * wbytes) // (per_token - wbytes)
        configs = {
            "one group (every position kept)": {
                "kv_budget_tokens": memory // per_token,
                "kv_window_pages": 0,
            },
            "window group (freed behind the window)": {
                "kv_budget_tokens": full_tokens,
                "kv_window_pages": nw,
            },
        }
        prompts = [
            [(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(args.prompt_len)]
            for i in range(args.requests)
        ]
        result: dict[str, Any] = {
            "model": str(args.model or args.shape),
            "window": window,
            "bytes_per_token": per_token,
            "window_layers_bytes_per_token": wbytes,
            "kv_mib": round(memory / 2**20, 1),
            "requests": args.requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "runs": {},
        }
        for name, cfg in configs.items():
            llm = LLM(str(path), prefix_cache=False, **opts, **cfg)
            run(llm, prompts[:1], 2)  # warm up
            row = run(llm, prompts, args.output_len)
            result["runs"][name] = row
            print(name, json.dumps(row), flush=True)
            llm.close()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
