"""Where an end-to-end batched run's time goes: the prefill ramp against steady decoding.

    python -m tandem.bench.ramp --shape qwen3-0.6b --dtype bfloat16 --batch 256 \
        --input-len 256 --output-len 256 --budgets 2048,8192

``tandem bench offline`` times B prompts end to end, where the plain-loop ceiling prefills
all of them in one forward and Tandem in steps of at most ``max_num_batched_tokens`` tokens,
the first requests decoding alongside the later ones' chunks. This runs the same workload
once per step budget (a warm-up run on other prompts first, in the same engine) and times
every loop step (``Engine.step``) by what the steps it launched held (one, or two where it
starts the chain): ``ramp`` steps carry prompt tokens, ``decode`` steps only decode rows.
It also times the ceiling's two parts on the same prompts (its one prefill forward, then
its decode loop) for comparison.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _tandem(
    path: Path, b: int, in_len: int, out_len: int, vocab: int, budget: int, opts: dict
) -> dict:
    from tandem import LLM, SamplingParams
    from tandem.bench import sides

    llm = LLM(str(path), max_num_seqs=max(b, 8), max_num_batched_tokens=budget, **opts)
    loop = llm.engine.loop
    real_launch, real_step = loop.runner.launch, loop.step
    launched: list[tuple[int, int]] = []  # (prefill tokens, decode rows) of each launch
    steps: list[dict[str, Any]] = []

    def launch(plan, parent, masks=None, **kw):
        pre = dec = 0
        for s in plan.segments:
            prompt = loop.scheduler.running[s.request_id].num_prompt_tokens
            pre += max(0, min(s.start + s.num_tokens, prompt) - s.start)
            dec += s.start + s.num_tokens > prompt
        launched.append((pre, dec))
        return real_launch(plan, parent, masks, **kw)

    def step():
        launched.clear()
        t = time.perf_counter()
        out = real_step()
        ms = (time.perf_counter() - t) * 1e3
        pre = sum(p for p, _ in launched)
        dec = sum(d for _, d in launched)
        steps.append({"ms": ms, "prefill_tokens": pre, "decode_rows": dec})
        return out

    loop.runner.launch, loop.step = launch, step
    sets = sides.prompt_sets(seed=b, count=2, b=b, length=in_len, vocab=vocab)
    sp = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    try:
        llm.generate(sets[0], sp)  # warm-up: every shape of the run met once
        steps.clear()
        t = time.perf_counter()
        outs = llm.generate(sets[1], sp)
        total = time.perf_counter() - t
    finally:
        del loop.runner.launch, loop.step  # (the instances' hooks: their own methods again)
        # The next run's pool is sized from the memory left free.
        llm.close()
    assert sum(len(o.token_ids) for o in outs) == b * out_len
    ramp = [s for s in steps if s["prefill_tokens"]]
    dec = [s for s in steps if not s["prefill_tokens"]]
    return {
        "budget": budget,
        "tok_s": b * out_len / total,
        "seconds": total,
        "ramp_steps": len(ramp),
        "ramp_s": sum(s["ms"] for s in ramp) / 1e3,
        "ramp_step_ms_median": statistics.median(s["ms"] for s in ramp) if ramp else 0.0,
        "decode_steps": len(dec),
        "decode_s": sum(s["ms"] for s in dec) / 1e3,
        "decode_step_ms_median": statistics.median(s["ms"] for s in dec) if dec else 0.0,
        "steps": steps,
    }


def _ceiling(path: Path, b: int, in_len: int, out_len: int, vocab: int) -> dict:
    """The plain loop's prefill forward and decode, timed apart (after one warm-up run)."""
    from mlx_lm.utils import load

    from tandem.bench import sides
    from tandem.bench.ceiling import free, plain_decode

    model = load(str(path))[0]
    sets = sides.prompt_sets(seed=b, count=2, b=b, length=in_len, vocab=vocab)
    try:
        plain_decode(model, sets[0], out_len)
        t = time.perf_counter()
        _, t_first = plain_decode(model, sets[1], out_len)
        end = time.perf_counter()
    finally:
        model = None
        free()
    return {
        "tok_s": b * out_len / (end - t),
        "seconds": end - t,
        "prefill_s": t_first - t,
        "decode_s": end - t_first,
    }


def main(argv: list[str] | None = None) -> int:
    from tandem.bench.shapes import RANDOM_SHAPES, make_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=RANDOM_SHAPES, default="qwen3-0.6b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--budgets", default="2048,8192", help="max_num_batched_tokens values to run")
    p.add_argument("--engine-options", default="{}", help="JSON of more engine options")
    p.add_argument("--no-ceiling", action="store_true")
    p.add_argument(
        "--unbatched-too",
        action="store_true",
        help="also run each budget with new prompts' chunks attended one call each "
        "(step_context.BATCH_FRESH off)",
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    import tandem.runner  # noqa: F401  (preloads BLAS before mlx)
    from tandem.runner import step_context

    opts = json.loads(args.engine_options)
    results: dict[str, Any] = {"shape": args.shape, "dtype": args.dtype, "batch": args.batch}
    results.update(input_len=args.input_len, output_len=args.output_len, engine_options=opts)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(args.shape, args.dtype, Path(tmp))
        # Token ids below 512 (and the vocabulary): both sides get the same prompts.
        vocab = min(int(json.loads((path / "config.json").read_text())["vocab_size"]), 512)
        run = (args.batch, args.input_len, args.output_len, vocab)
        if not args.no_ceiling:
            c = _ceiling(path, *run)
            results["ceiling"] = c
            print(
                f"ceiling: {c['tok_s']:,.0f} tok/s, {c['seconds']:.2f} s = prefill "
                f"{c['prefill_s']:.2f} + decode {c['decode_s']:.2f}",
                flush=True,
            )
        results["tandem"] = []
        budgets = [int(x) for x in args.budgets.split(",") if x]
        for budget, batched in itertools.product(budgets, (True, False)):
            if not batched and not args.unbatched_too:
                continue
            step_context.BATCH_FRESH = batched
            try:
                r = _tandem(path, *run, budget, opts)
            finally:
                step_context.BATCH_FRESH = True
            r["batch_fresh"] = batched
            results["tandem"].append(r)
            print(
                f"budget {budget}{'' if batched else ' unbatched'}: {r['tok_s']:,.0f} tok/s, "
                f"{r['seconds']:.2f} s; ramp "
                f"{r['ramp_steps']} steps {r['ramp_s']:.2f} s (median "
                f"{r['ramp_step_ms_median']:.1f} ms); decode {r['decode_steps']} steps "
                f"{r['decode_s']:.2f} s (median {r['decode_step_ms_median']:.2f} ms)",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
