"""Fuzzed schedule parity: a seeded random schedule drives the engine — arrivals at random
steps, random prompt and output lengths, shared prefixes and multi-turn resends (prefix-cache
hits), stop tokens met mid-chain, aborts at random points, a small chunk budget (chunk
boundaries), pauses (steps where the driver does not step), a small KV pool (evictions,
retractions) — and every greedy output must equal mlx-lm's ``generate_step`` token for token
(aborted ones: a prefix of it), with the scheduler's invariants checked after every step.
A divergence is accepted only where mlx-lm's own logits for the two tokens differ by less than
1e-4 (a float32 near-tie: KV computed in chunks or batches rounds differently from one
forward); it is counted and reported as a tie.

    python -m tandem.testing.fuzz_parity --model DIR --requests 2000 [--seed S]

The suite runs a CI-sized version (tests/parity/test_fuzz_parity.py).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field


@dataclass
class FuzzReport:
    requests: int = 0
    steps: int = 0
    aborted: int = 0
    stopped_early: int = 0
    mismatches: list[str] = field(default_factory=list)
    ties: int = 0
    details: dict[str, tuple] = field(default_factory=dict)  # id -> (prompt len, got, want)
    hit_tokens: int = 0
    retractions: int = 0
    evictions: int = 0
    spec_accepted: int = 0
    seconds: float = 0.0


def run(
    model_dir: str,
    num_requests: int,
    seed: int = 0,
    *,
    overlap: bool = True,
    speculative: str | None = None,
    speculative_min_gain: float = 1.0,
) -> FuzzReport:
    import tandem.runner  # noqa: F401, I001  (preloads BLAS before mlx)
    from tandem import LLM, SamplingParams
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    t0 = time.perf_counter()
    rng = random.Random(seed)
    llm = LLM(
        model_dir,
        overlap=overlap,
        check_invariants=True,
        max_num_seqs=12,
        max_num_batched_tokens=rng.choice([5, 16, 64]),
        kv_budget_tokens=96 * 16,  # a small pool: evictions and retractions happen
        speculative=speculative,
        speculative_min_gain=speculative_min_gain,
    )
    engine = llm.engine
    vocab = llm.tokenizer.vocab_size
    model = load(model_dir)[0]
    refs: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int], n: int) -> list[int]:
        key = tuple(prompt)
        if key not in refs or len(refs[key]) < n:
            gen = generate_step(mx.array(prompt), model, max_tokens=n)
            refs[key] = [int(t) for t, _ in gen]
        return refs[key][:n]

    shared = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 120))] for _ in range(4)]
    specs = []
    horizon = max(50, num_requests * 2)
    for i in range(num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))]
        u = rng.random()
        if u < 0.35:
            prompt = rng.choice(shared) + prompt[: rng.randint(0, 12)]
        elif u < 0.5 and specs:
            prev = rng.choice(specs)
            prompt = prev["prompt"] + reference(prev["prompt"], prev["n"]) + prompt[:4]
        prompt = prompt[:300]
        n = rng.randint(1, 40) if rng.random() < 0.9 else rng.randint(100, 300)
        ref = reference(prompt, n)
        stop: tuple[int, ...] = ()
        if rng.random() < 0.2 and n > 3:
            stop = (ref[rng.randrange(1, n - 1)],)
        arrive = rng.randrange(0, horizon)
        abort_at = arrive + rng.randint(0, 30) if rng.random() < 0.1 else None
        specs.append(
            {
                "id": f"f{i}",
                "prompt": prompt,
                "n": n,
                "stop": stop,
                "ref": ref,
                "arrive": arrive,
                "abort": abort_at,
            }
        )
    by_step: dict[int, list[dict]] = {}
    for s in specs:
        by_step.setdefault(s["arrive"], []).append(s)
    aborts = {s["abort"]: s for s in specs if s["abort"] is not None}
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    report = FuzzReport(requests=num_requests)
    step = 0
    while step <= horizon or engine.has_unfinished():
        for s in by_step.get(step, ()):
            params = SamplingParams(
                max_tokens=s["n"], temperature=0, ignore_eos=True, stop_token_ids=s["stop"]
            )
            engine.add_request(s["prompt"], params, s["id"])
            got[s["id"]] = []
        s = aborts.get(step)
        if s is not None and s["id"] in got and s["id"] not in reasons:
            engine.abort(s["id"])
        if rng.random() < 0.03:  # a pause: the driver does not step this time
            step += 1
            continue
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
        engine.check_invariants()
        step += 1
        report.steps += 1
    for s in specs:
        want = s["ref"]
        if s["stop"]:
            want = want[: want.index(s["stop"][0]) + 1]
            report.stopped_early += len(want) < s["n"]
        mine = got[s["id"]]
        if reasons[s["id"]] == "abort":
            report.aborted += 1
            ok = mine == want[: len(mine)]
        else:
            ok = mine == want
        if not ok and _near_tie(model, s["prompt"], mine, want):
            report.ties += 1
            ok = True
        if not ok:
            report.mismatches.append(s["id"])
            report.details[s["id"]] = (len(s["prompt"]), s["n"], s["stop"], mine, want)
    stats = engine.scheduler.stats
    report.hit_tokens, report.retractions = stats.hit_tokens, stats.retractions
    report.evictions = engine.scheduler.kv.evicted_pages
    report.spec_accepted = stats.spec_accepted
    report.seconds = time.perf_counter() - t0
    return report


def _near_tie(model, prompt: list[int], got: list[int], want: list[int]) -> bool:
    import mlx.core as mx

    i = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if i is None:
        return False  # a length difference, not a token choice
    logits = model(mx.array(prompt + want[:i])[None])[0, -1].astype(mx.float32)
    return abs(float(logits[got[i]]) - float(logits[want[i]])) < 1e-4


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="a model directory (e.g. a tiny one)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--speculative", choices=("ngram",))
    args = p.parse_args()
    r = run(
        args.model,
        args.requests,
        args.seed,
        overlap=not args.no_overlap,
        speculative=args.speculative,
    )
    print(
        f"fuzz parity: {r.requests} requests, {r.steps} steps, {r.aborted} aborted, "
        f"{r.stopped_early} stopped early on a stop token, prefix hits {r.hit_tokens} tokens, "
        f"{r.retractions} retractions, {r.evictions} evictions, {len(r.mismatches)} mismatches, "
        f"{r.ties} float32 near-ties, {r.spec_accepted} speculative tokens accepted "
        f"({r.seconds:.0f} s)"
    )
    return 1 if r.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
