"""What grammar-constrained rows cost their batch: decode throughput of one batch with no,
half or all rows constrained by a JSON schema, overlap on and off. Offline engine, same
prompts, greedy, every row runs exactly ``--tokens`` tokens (the schema is an array of at
least 500 objects, so no row's grammar completes early); both engines built and warmed up
front, repeats interleaved over every point, medians reported.
Also reports the host time spent computing masks per step.

    python -m tandem.bench.guided_mix --model DIR [--batch 16] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import json
import statistics
import time

from tandem import LLM, SamplingParams
from tandem.bench.sampling_mix import batch_arguments, batch_prompts

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


def measure(llms: dict[str, LLM], prompts: list[list[int]], args) -> dict[str, dict]:
    """Every (mode, mix) warmed with a full-length run first, then the repeats interleaved
    (repeat r runs every mode and mix once), so drift hits all points alike."""
    spent = {"s": 0.0, "calls": 0}
    for llm in llms.values():
        sched = llm.engine.scheduler
        original = sched.grammar_masks

        def timed(plan, words, original=original):
            t = time.perf_counter()
            try:
                return original(plan, words)
            finally:
                if plan.sampling.constrained:
                    spent["s"] += time.perf_counter() - t
                    spent["calls"] += 1

        sched.grammar_masks = timed  # type: ignore[method-assign]
    params = {mix: [params_for(mix, i, args.tokens) for i in range(args.batch)] for mix in MIXES}
    for llm in llms.values():
        for mix in MIXES:
            llm.generate(prompts, params[mix])  # warm-up: every shape this run will see
    rates: dict[tuple[str, str], list[float]] = {}
    mask_ms: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for mode, llm in llms.items():
            for mix in MIXES:
                spent.update(s=0.0, calls=0)
                t = time.perf_counter()
                outs = llm.generate(prompts, params[mix])
                dt = time.perf_counter() - t
                assert all(len(o.token_ids) == args.tokens for o in outs)
                rates.setdefault((mode, mix), []).append(args.batch * args.tokens / dt)
                mask_ms.setdefault((mode, mix), []).append(
                    1e3 * spent["s"] / max(1, spent["calls"])
                )
    out: dict[str, dict] = {}
    for (mode, mix), r in rates.items():
        loop = llms[mode].engine.loop
        out.setdefault(mode, {})[mix] = {
            "tok_per_s": statistics.median(r),
            "tok_per_s_all": r,
            "mask_ms_per_step": statistics.median(mask_ms[(mode, mix)]),
            "chained_share": loop.num_chained / max(1, loop.num_steps),
        }
    return out


def main() -> None:
    p = batch_arguments(__doc__)
    p.add_argument("--out", help="write the results JSON here")
    args = p.parse_args()
    prompts = batch_prompts(args)
    llms = {
        "overlap": LLM(args.model, prefix_cache=False, overlap=True),
        "no-overlap": LLM(args.model, prefix_cache=False, overlap=False),
    }
    results = measure(llms, prompts, args)
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
