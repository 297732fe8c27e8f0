"""What grammar-constrained rows cost their batch: decode throughput of one batch with no,
half or all rows constrained by a JSON schema, overlap on and off. Offline engine, same
prompts, greedy, every row runs exactly ``--tokens`` tokens (the schema is an array of at
least 500 objects, so no row's grammar completes early), warm-up first, median of repeats.
Also reports the host time spent computing masks per step.

    python -m tandem.bench.guided_mix --model DIR [--batch 16] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tandem import LLM, SamplingParams

MIXES = ("none", "half", "all")
SCHEMA = {
    "type": "array",
    "minItems": 500,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "tag": {"enum": ["alpha", "beta", "gamma"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "tag", "ok"],
        "additionalProperties": False,
    },
}


def params_for(mix: str, i: int, tokens: int) -> SamplingParams:
    constrained = mix == "all" or (mix == "half" and i % 2 == 1)
    return SamplingParams(
        max_tokens=tokens,
        temperature=0,
        ignore_eos=True,
        guided=("json_schema", json.dumps(SCHEMA)) if constrained else None,
    )


def measure(llm: LLM, prompts: list[list[int]], args) -> dict[str, dict[str, float]]:
    sched = llm.engine.scheduler
    spent = {"s": 0.0, "calls": 0}
    original = sched.grammar_masks

    def timed(plan, words):
        t = time.perf_counter()
        try:
            return original(plan, words)
        finally:
            if plan.sampling.constrained:
                spent["s"] += time.perf_counter() - t
                spent["calls"] += 1

    sched.grammar_masks = timed  # type: ignore[method-assign]
    out = {}
    for mix in MIXES:
        params = [params_for(mix, i, args.tokens) for i in range(args.batch)]
        llm.generate(prompts, [params_for(mix, i, 4) for i in range(args.batch)])  # warm-up
        rates, mask_ms = [], []
        for _ in range(args.repeats):
            spent.update(s=0.0, calls=0)
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t
            assert all(len(o.token_ids) == args.tokens for o in outs)
            rates.append(sum(len(o.token_ids) for o in outs) / dt)
            mask_ms.append(1e3 * spent["s"] / max(1, spent["calls"]))
        out[mix] = {
            "tok_per_s": statistics.median(rates),
            "mask_ms_per_step": statistics.median(mask_ms),
            "chained_share": llm.engine.loop.num_chained / max(1, llm.engine.loop.num_steps),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the results JSON here")
    args = p.parse_args()
    prompts = [
        [(7 * i + 13 * j) % 500 + 3 for j in range(args.prompt_len)] for i in range(args.batch)
    ]
    results = {}
    for overlap in (True, False):
        llm = LLM(args.model, prefix_cache=False, overlap=overlap)
        results["overlap" if overlap else "no-overlap"] = measure(llm, prompts, args)
        del llm
    base = results["overlap"]["none"]["tok_per_s"]
    for mode, mixes in results.items():
        for mix, r in mixes.items():
            print(
                f"{mode:10s} {mix:5s} constrained: {r['tok_per_s']:9.1f} tok/s "
                f"{r['tok_per_s'] / base:5.2f}x of unconstrained+overlap, "
                f"masks {r['mask_ms_per_step']:.2f} ms/step"
            )
    doc = {"config": vars(args), "results": results}
    print(json.dumps(doc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
