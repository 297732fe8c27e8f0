"""``tandem bench speculative``: Tandem with and without speculation, one process.

Proposers: n-gram (the default), or a draft model: ``--draft-model PATH``, or
``--draft-layers N``, the target's own first N layers written as a model of their own
(bench/draft_model.py). ``--mlx-lm`` adds mlx-lm's speculative path at one stream with the
same draft (``speculative_generate_step``) and its plain ``generate_step``, decode tok/s.

Workloads:
- ``copy``: a coding agent's edit: "rewrite this ~1,000-token Python file with one name
  changed" (the files are Tandem's own sources as of a3fd828, pinned in
  ``data/copy_texts.json.gz`` so that runs at later commits read the same prompts, and
  nothing is downloaded); the answer copies most of its prompt, n-gram speculation's good
  case;
- ``random``: random prompt tokens, outputs that copy nothing (what speculation costs when it
  cannot help).

``--oracle P`` replaces the n-gram proposer by one that proposes what speculation off
generated (the greedy continuation), each proposal wrong from a random position on with
probability 1 - P: what verification and (on models with recurrent layers) the roll-back of
rejected proposals cost and give at a chosen acceptance, on random weights, which copy
nothing real.

Each stream count B runs B such requests together (different files), greedy, EOS ignored,
first untimed (so the timed runs read their prompts from the prefix cache, and MLX has
compiled its kernels for the step shapes), then timed. One engine per K (off first) runs
every workload and batch.
Every configuration must give the same tokens as speculation off (greedy is exact); the table
gives output tok/s, the ratio to off, and the acceptance.

    tandem bench speculative [--model M] [--streams 1,4,64] [--num-tokens 4,8]
        [--draft-model D | --draft-layers N] [--mlx-lm]
"""

from __future__ import annotations

import argparse
import gzip
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
PINNED_CHARS = 8000  # each pinned text is its file's first 8,000 characters (or all of it)


def copy_prompts(llm, n: int, prompt_tokens: int) -> list[list[int]]:
    """``n`` chat prompts asking to rewrite a source file (cut to about ``prompt_tokens``)."""
    pinned = Path(__file__).resolve().parent / "data" / "copy_texts.json.gz"
    texts = json.loads(gzip.decompress(pinned.read_bytes()))["texts"]
    out = []
    for i in range(n):
        name = SOURCES[i % len(SOURCES)]
        text = texts[name]
        ids = llm.tokenizer.encode(text)
        if len(ids) < prompt_tokens and len(text) == PINNED_CHARS:  # (a short file is whole)
            raise ValueError(
                f"the pinned copy texts hold {len(ids)} tokens of {name}, "
                f"fewer than --prompt-tokens {prompt_tokens}"
            )
        ids = ids[:prompt_tokens]
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


def mlx_lm_single(
    model_path: str | None, draft_path: str | None, prompt: list[int], n: int, ks, repeats, dtype
) -> list[dict[str, Any]]:
    """mlx-lm at one stream: ``generate_step`` (K = 0) and ``speculative_generate_step`` with
    the draft for each K; decode tok/s timed from the first token, as bench offline does."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step

    from tandem.model_source import resolve_model
    from tandem.runner.loader import load_model, prepare_for_device

    def load(path):
        model = load_model(resolve_model(path), dtype)[0]
        prepare_for_device(model, dtype)
        return model

    model = load(model_path)
    draft = load(draft_path) if draft_path else None
    rows = []
    for k in ks:
        if k and draft is None:
            continue

        def run(k: int = k) -> tuple[float, list[int]]:
            if k:
                gen = speculative_generate_step(
                    mx.array(prompt), model, draft, num_draft_tokens=k, max_tokens=n
                )
            else:
                gen = generate_step(mx.array(prompt), model, max_tokens=n)
            t0, toks = 0.0, []
            for i, step in enumerate(gen):
                toks.append(int(step[0]))
                if i == 0:
                    t0 = time.perf_counter()
            return (n - 1) / (time.perf_counter() - t0), toks

        run()
        results = [run() for _ in range(repeats)]
        rows.append(
            {
                "spec_tokens": k,
                "tok_s": statistics.median(r[0] for r in results),
                "token_ids": results[0][1],
            }
        )
    return rows


def oracle(
    prompts: list[list[int]], outputs: list[list[int]], accept: float, vocab: int, seed: int = 0
):
    """A proposer (``speculation.propose``'s signature) of ``outputs``' continuation for each
    prompt, wrong from a random position on with probability ``1 - accept`` (the next token
    id, within the ``vocab``). The hybrid speculation tests use it too."""
    refs = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
    rng = random.Random(seed)

    def propose(req, cfg) -> list[int]:
        room = req.params.max_tokens - len(req.output_token_ids) - 1
        done = len(req.output_token_ids)
        out = list(refs[tuple(req.prompt_token_ids)][done : done + min(cfg.num_tokens, room)])
        if out and rng.random() >= accept:
            bad = rng.randrange(len(out))
            out[bad:] = [(t + 1) % vocab for t in out[bad:]]
        return out

    return propose


def run_config(llm, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict[str, Any]:
    from tandem import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    # Untimed, the whole run once: the prompts are cached, and MLX compiles its kernels for
    # the step shapes this configuration makes (verify and draft rows vary) before timing.
    llm.generate(prompts, params)
    times, outs = [], []
    stats = llm.engine.scheduler.stats
    gain = llm.engine.scheduler.gain
    before = (
        stats.spec_proposed,
        stats.spec_accepted,
        stats.spec_verifies,
        gain.backoffs,
        gain.resumes,
    )
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t)
    tokens = sum(len(o.token_ids) for o in outs)
    proposed = stats.spec_proposed - before[0]
    accepted = stats.spec_accepted - before[1]
    verifies = stats.spec_verifies - before[2]
    return {
        "spec_tokens": llm.config.num_speculative_tokens if llm.config.speculative else 0,
        "streams": len(prompts),
        "tok_s": tokens / statistics.median(times),
        "times": times,
        "acceptance": accepted / proposed if proposed else None,
        "mean_accepted_per_verify": accepted / verifies if verifies else None,
        # Times speculation turned itself off (its steps slower than plain; spec_gain.py).
        "backoffs": gain.backoffs - before[3],
        # Of them, those ended early by the proposals made meanwhile (spec_shadow.py).
        "resumes": gain.resumes - before[4],
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
    p.add_argument("--draft-model", help="speculate with this draft model (same tokenizer)")
    p.add_argument(
        "--draft-layers",
        type=int,
        help="speculate with the target's own first N layers as the draft (written to a "
        "temporary folder)",
    )
    p.add_argument("--speculative-max-batch", type=int, default=None)
    p.add_argument(
        "--compile-decode",
        type=int,
        default=None,
        metavar="ROWS",
        help="as tandem serve's (default: the machine's; 0: no compiled steps)",
    )
    p.add_argument(
        "--speculative-min-gain",
        type=float,
        default=1.0,
        help="as tandem serve's (0: speculate whatever the step times say)",
    )
    p.add_argument(
        "--mlx-lm", action="store_true", help="also mlx-lm's speculative path at one stream"
    )
    p.add_argument(
        "--oracle",
        type=float,
        help="propose speculation-off's own output, right with this probability per proposal",
    )
    p.add_argument("--json", help="write the results here")


def main(args: argparse.Namespace) -> int:
    import gc
    import tempfile

    import mlx.core as mx

    from tandem import LLM, SamplingParams

    ks = [0, *(int(k) for k in args.num_tokens.split(",") if k)]
    draft = args.draft_model
    tmp = tempfile.TemporaryDirectory()
    if args.draft_layers:
        from tandem.bench.draft_model import write_truncated

        draft = str(write_truncated(args.model, args.draft_layers, Path(tmp.name), args.dtype))
    streams = [int(x) for x in args.streams.split(",")]
    workloads = args.workloads.split(",")
    # One pool for every run: the largest batch's prompts and outputs, twice (prefix cache).
    budget = 2 * max(streams) * (args.prompt_tokens + args.max_tokens + 128)
    rows: dict[tuple[str, int, int], dict[str, Any]] = {}
    prompts: dict[tuple[str, int], list[list[int]]] = {}
    for k in ks:
        spec: dict[str, Any] = {}
        if k:
            spec = {
                "speculative": "draft" if draft else "ngram",
                "draft_model": draft,
                "num_speculative_tokens": k,
                "speculative_max_batch": args.speculative_max_batch,
                "speculative_min_gain": args.speculative_min_gain,
            }
        llm = LLM(
            args.model,
            dtype=args.dtype,
            max_num_seqs=max(8, *streams),
            kv_budget_tokens=budget,
            compile_decode=args.compile_decode,
            **spec,
        )
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        for workload in workloads:
            make = copy_prompts if workload == "copy" else random_prompts
            for b in streams:
                key = (workload, b)
                if key not in prompts:
                    prompts[key] = make(llm, b, args.prompt_tokens)
                if k and args.oracle is not None:
                    from tandem.engine import speculation

                    off = rows[(workload, b, 0)]["token_ids"]
                    vocab = llm.engine.vocab_size or llm.tokenizer.vocab_size
                    speculation.propose = oracle(prompts[key], off, args.oracle, vocab)
                r = run_config(llm, prompts[key], args.max_tokens, args.repeats)
                r["workload"] = workload
                base = rows.get((workload, b, 0), r)
                r["ratio"] = r["tok_s"] / base["tok_s"]
                r["exact"] = r["token_ids"] == base["token_ids"]
                r["first_diff"] = first_difference(r["token_ids"], base["token_ids"])
                rows[(workload, b, k)] = r
                print(format_row(r), flush=True)
        del llm
        gc.collect()
        mx.clear_cache()
    ordered = [rows[(w, b, k)] for w in workloads for b in streams for k in ks]
    if args.mlx_lm and 1 in streams:
        for workload in workloads:
            mine = {r["spec_tokens"]: r for r in ordered if r["workload"] == workload}
            prompt = prompts[(workload, 1)][0]
            for r in mlx_lm_single(
                args.model, draft, prompt, args.max_tokens, ks, args.repeats, args.dtype
            ):
                k = r["spec_tokens"]
                r.update(workload=f"{workload}, mlx-lm", streams=1, acceptance=None)
                r["mean_accepted_per_verify"] = None
                r["ratio"] = r["tok_s"] / ordered_base(ordered, workload)["tok_s"]
                want = mine[0]["token_ids"][0] if 0 in mine else r["token_ids"]
                r["token_ids"] = [r["token_ids"]]
                r["first_diff"] = first_difference(r["token_ids"], [want])
                r["exact"] = r["first_diff"] is None
                ordered.append(r)
                print(format_row(r), flush=True)
    print()
    print(table(ordered))
    if args.json:
        keep = [{k: v for k, v in r.items() if k != "token_ids"} for r in ordered]
        meta = {
            "draft_model": args.draft_model,
            "draft_layers": args.draft_layers,
            "oracle": args.oracle,
        }
        Path(args.json).write_text(json.dumps({"config": meta, "rows": keep}, indent=1))
    tmp.cleanup()
    return 0 if all(r["exact"] for r in ordered) else 1


def ordered_base(rows: list[dict[str, Any]], workload: str) -> dict[str, Any]:
    """Tandem without speculation at one stream: what every mlx-lm row is compared with."""
    return next(
        r for r in rows if r["workload"] == workload and r["streams"] == 1 and not r["spec_tokens"]
    )


def first_difference(got: list[list[int]], want: list[list[int]]) -> list[int] | None:
    """Per request, the index of the first token that differs (-1: none); None if all
    agree. Half-precision batches of other shapes round differently, so a near-tie may go
    the other way (float32 is token-exact: tests/parity/test_speculative.py)."""
    out = []
    for a, b in zip(got, want, strict=True):
        i = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        out.append(-1 if i is None and len(a) == len(b) else i if i is not None else len(a))
    return None if all(i == -1 for i in out) else out


def format_row(r: dict[str, Any]) -> str:
    acc = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
    mean = "" if r["mean_accepted_per_verify"] is None else f"{r['mean_accepted_per_verify']:.2f}"
    k = r["spec_tokens"] or "off"
    return (
        f"| {r['workload']} | {r['streams']} | {k} | {r['tok_s']:.1f} | {r['ratio']:.2f} | "
        f"{acc} | {mean} | {same(r)} |"
    )


def same(r: dict[str, Any]) -> str:
    if r["exact"]:
        return "yes"
    diffs = [i for i in r["first_diff"] if i >= 0]
    return f"{len(diffs)} of {r['streams']} differ, first at token {min(diffs)}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| workload | streams | K | output tok/s | vs off | accepted | accepted per verify "
        "| same tokens |\n|---|---:|---:|---:|---:|---:|---:|---|"
    )
    return "\n".join([head, *(format_row(r) for r in rows)])
