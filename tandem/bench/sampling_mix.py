"""What sampled rows cost their batch: decode throughput of one batch that is all greedy, half
greedy / half sampled (temperature, top-k, top-p, min-p), half greedy / half "everything"
(sampling plus penalties, logit_bias and top-5 logprobs), and all sampled. Offline engine,
same prompts, warm-up first, median of repeats.

    python -m tandem.bench.sampling_mix --model DIR [--batch 16] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tandem import LLM, SamplingParams

MIXES = ("all-greedy", "half-sampled", "half-everything", "all-sampled")


def params_for(mix: str, i: int, tokens: int) -> SamplingParams:
    greedy = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    sampled = SamplingParams(
        max_tokens=tokens,
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        seed=i,
        ignore_eos=True,
    )
    everything = SamplingParams(
        max_tokens=tokens,
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        seed=i,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logit_bias={5: 1.0},
        logprobs=5,
    )
    if mix == "all-greedy":
        return greedy
    if mix == "all-sampled":
        return sampled
    other = sampled if mix == "half-sampled" else everything
    return greedy if i % 2 == 0 else other


def batch_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options of the one-batch offline benchmarks (this one, guided_mix)."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    return p


def batch_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``--batch`` distinct prompts of ``--prompt-len`` token ids (no shared prefixes)."""
    return [[(7 * i + 13 * j) % 500 + 3 for j in range(args.prompt_len)] for i in range(args.batch)]


def main() -> None:
    args = batch_arguments(__doc__).parse_args()
    llm = LLM(args.model, prefix_cache=False)
    prompts = batch_prompts(args)
    results = {}
    for mix in MIXES:
        params = [params_for(mix, i, args.tokens) for i in range(args.batch)]
        llm.generate(
            prompts,
            [
                SamplingParams(
                    max_tokens=4,
                    **{k: getattr(sp, k) for k in ("temperature", "top_k", "top_p", "seed")},
                )
                for sp in params
            ],
        )  # warm-up of this mix's graph
        rates = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t
            rates.append(sum(len(o.token_ids) for o in outs) / dt)
        results[mix] = statistics.median(rates)
    base = results["all-greedy"]
    for mix, rate in results.items():
        print(f"{mix:16s} {rate:9.1f} tok/s  {rate / base:5.2f}x of all-greedy")
    print(json.dumps({"config": vars(args), "tok_per_s": results}))


if __name__ == "__main__":
    main()
