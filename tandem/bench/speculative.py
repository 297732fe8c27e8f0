"""``tandem bench speculative``: Tandem with and without n-gram speculation, one process.

Workloads:
- ``copy``: a coding agent's edit: "rewrite this ~1,000-token Python file with one name
  changed" (the files are Tandem's own sources, so nothing is downloaded); the answer copies
  most of its prompt, n-gram speculation's good case;
- ``random``: random prompt tokens, outputs that copy nothing (what speculation costs when it
  cannot help).

Each stream count B runs B such requests together (different files), greedy, EOS ignored,
first with ``max_tokens=1`` (so the timed run reads its prompt from the prefix cache and
measures decoding), then timed. Every configuration must give the same tokens as speculation
off (greedy is exact); the table gives output tok/s, the ratio to off, and the acceptance.

    tandem bench speculative [--model M] [--streams 1,4,64] [--num-tokens 4,8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

SOURCES = [
    "engine/pages.py",
    "engine/kv_manager.py",
    "engine/request.py",
    "engine/admission.py",
    "engine/state_slots.py",
    "engine/invariants.py",
    "engine/loop.py",
    "engine/results.py",
]
RENAMES = [("pages", "blocks"), ("request", "job"), ("slot", "cell"), ("step", "tick")]


def copy_prompts(llm, n: int, prompt_tokens: int) -> list[list[int]]:
    """``n`` chat prompts asking to rewrite a source file (cut to about ``prompt_tokens``)."""
    root = Path(__file__).resolve().parent.parent
    out = []
    for i in range(n):
        text = (root / SOURCES[i % len(SOURCES)]).read_text()
        ids = llm.tokenizer.encode(text)[:prompt_tokens]
        text = llm.tokenizer.decode(ids)
        old, new = RENAMES[i % len(RENAMES)]
        msg = (
            f"Here is a Python file:\n\n```python\n{text}\n```\n\nRewrite the whole file, "
            f"renaming `{old}` to `{new}` everywhere. Output only the code."
        )
        out.append(llm.chat_prompt([{"role": "user", "content": msg}], add_generation_prompt=True))
    return out


def random_prompts(llm, n: int, prompt_tokens: int) -> list[list[int]]:
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(n)]


def run_config(
    model: str | None,
    spec_tokens: int,
    prompts: list[list[int]],
    max_tokens: int,
    repeats: int,
    **engine: Any,
) -> dict[str, Any]:
    from tandem import LLM, SamplingParams

    options = dict(engine)
    if spec_tokens:
        options.update(speculative="ngram", num_speculative_tokens=spec_tokens)
    llm = LLM(model, max_num_seqs=max(8, len(prompts)), **options)
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))  # prompts cached
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    times, outs = [], []
    stats = llm.engine.scheduler.stats
    before = (stats.spec_proposed, stats.spec_accepted, stats.spec_verifies)
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t)
    tokens = sum(len(o.token_ids) for o in outs)
    proposed = stats.spec_proposed - before[0]
    accepted = stats.spec_accepted - before[1]
    verifies = stats.spec_verifies - before[2]
    return {
        "spec_tokens": spec_tokens,
        "streams": len(prompts),
        "tok_s": tokens / statistics.median(times),
        "times": times,
        "acceptance": accepted / proposed if proposed else None,
        "mean_accepted_per_verify": accepted / verifies if verifies else None,
        "token_ids": [o.token_ids for o in outs],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory or .gguf (default: the default model)")
    p.add_argument("--workloads", default="copy,random")
    p.add_argument("--streams", default="1,4,64")
    p.add_argument("--num-tokens", default="4,8", help="K values to compare with off")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", help="write the results here")


def main(args: argparse.Namespace) -> int:
    from tandem import LLM

    probe = LLM(args.model, dtype=args.dtype)
    rows = []
    ks = [int(k) for k in args.num_tokens.split(",") if k]
    for workload in args.workloads.split(","):
        make = copy_prompts if workload == "copy" else random_prompts
        for b in [int(x) for x in args.streams.split(",")]:
            prompts = make(probe, b, args.prompt_tokens)
            base = None
            for k in [0, *ks]:
                r = run_config(
                    args.model, k, prompts, args.max_tokens, args.repeats, dtype=args.dtype
                )
                r["workload"] = workload
                if base is None:
                    base = r
                r["ratio"] = r["tok_s"] / base["tok_s"]
                r["exact"] = r["token_ids"] == base["token_ids"]
                rows.append(r)
                print(format_row(r), flush=True)
    print()
    print(table(rows))
    if args.json:
        keep = [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]
        Path(args.json).write_text(json.dumps(keep, indent=1))
    return 0 if all(r["exact"] for r in rows) else 1


def format_row(r: dict[str, Any]) -> str:
    acc = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
    mean = "" if r["mean_accepted_per_verify"] is None else f"{r['mean_accepted_per_verify']:.2f}"
    k = r["spec_tokens"] or "off"
    return (
        f"| {r['workload']} | {r['streams']} | {k} | {r['tok_s']:.1f} | {r['ratio']:.2f} | "
        f"{acc} | {mean} | {'yes' if r['exact'] else 'NO'} |"
    )


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| workload | streams | K | output tok/s | vs off | accepted | accepted per verify "
        "| same tokens |\n|---|---:|---:|---:|---:|---:|---:|---|"
    )
    return "\n".join([head, *(format_row(r) for r in rows)])
