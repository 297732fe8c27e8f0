"""``tandem bench kv-quant``: quantized KV pages against float ones, one process.

Per KV dtype (``auto`` first, then ``int8``, ``int4``):

- **capacity**: the pool's bytes per token and the tokens that fit in the same memory
  (``--kv-memory-fraction``, the engine's own sizing);
- **quality**: a fixed set of chat prompts, answered greedily on float KV; then every answer
  is read back (prompt + answer as a prompt, ``prompt_logprobs``) on each dtype. Agreement is
  the share of answer positions where the quantized engine's most likely token is the float
  engine's; the log-probability difference is that of the float engine's token. The first
  position where free-running greedy answers part is given too (a near-tie early on changes
  everything after it, which is why agreement is read teacher-forced);
- **speed**: ``--streams`` requests over a ``--context``-token prompt, each decoding
  ``--max-tokens``: output tok/s after the prompt is cached (median of ``--repeats``).

    tandem bench kv-quant [--model M | --shape S] [--context 4096] [--streams 1,4] [--json F]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one paragraph.",
    "List three prime numbers and say why they are prime.",
    "How do I reverse a list in Python?",
    "Translate 'good morning, how are you?' to Spanish.",
    "What is photosynthesis?",
    "Give me a tip for learning to cook.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are the benefits of regular exercise?",
)


def answers(
    llm, max_tokens: int, questions: tuple[str, ...] = PROMPTS
) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy answer) per question."""
    from tandem import SamplingParams

    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [(p, o.token_ids) for p, o in zip(prompts, llm.generate(prompts, params), strict=True)]


def read_back(llm, pairs) -> list[list[tuple[float, int]]]:
    """Per pair, per answer token: (its log-probability, the most likely token there)."""
    from tandem import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    outs = llm.generate([p + a for p, a in pairs], params)
    result = []
    for (p, a), out in zip(pairs, outs, strict=True):
        entries = out.prompt_logprobs[len(p) - 1 :]  # entry i is for token i + 1
        assert len(entries) == len(a)
        result.append([(lp, top[0][0]) for lp, top in entries])
    return result


def quality(base, got, tokens, free_base, free_got) -> dict[str, Any]:
    """``base`` / ``got``: read-backs (``read_back``) on the reference and the tested KV of the
    reference's greedy answers ``tokens``; ``free_base`` / ``free_got``: each side's own
    free-running greedy answers."""
    diffs, agree, total = [], 0, 0
    for b_row, g_row, toks in zip(base, got, tokens, strict=True):
        for (lp_b, _), (lp_g, top_g), t in zip(b_row, g_row, toks, strict=True):
            diffs.append(abs(lp_g - lp_b))
            agree += top_g == t
            total += 1
    parted = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in zip(free_got, free_base, strict=True)
    ]
    return {
        "agreement": agree / total,
        "max_logprob_diff": max(diffs),
        "mean_logprob_diff": statistics.fmean(diffs),
        "free_run_parts_at": parted,
    }


def speed(llm, context: int, streams: int, max_tokens: int, repeats: int) -> dict[str, float]:
    """``streams`` prompts of ``context`` tokens, cached first: each timed run is a prefix
    hit, the prompt's last page prefilled (its chunk reads the whole context), then
    ``max_tokens`` decoded. ``tok_s``: output tok/s of the whole run; ``first_s``: a run of
    one token alone (the hit, the tail's prefill, the first token); ``decode_tok_s``: the
    tokens after the first over the time the whole run takes beyond that (medians)."""
    from tandem import SamplingParams

    rng = random.Random(streams)
    vocab = llm.tokenizer.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(context)] for _ in range(streams)]
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompts, one)  # cached from now on
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    times: dict[str, list[float]] = {"first": [], "whole": []}
    for _ in range(repeats):
        for name, sp in (("first", one), ("whole", params)):
            t = time.perf_counter()
            llm.generate(prompts, sp)
            times[name].append(time.perf_counter() - t)
    first, whole = (statistics.median(times[k]) for k in ("first", "whole"))
    return {
        "tok_s": streams * max_tokens / whole,
        "first_s": first,
        "decode_tok_s": streams * (max_tokens - 1) / max(whole - first, 1e-9),
    }


def kernel_times(context: int, streams: list[int], repeats: int = 20) -> list[dict[str, Any]]:
    """One layer of Qwen3-0.6B's attention (16 heads, 8 KV heads of 128), bf16: the decode
    kernel over float, int8 and int4 pages of ``context`` positions per stream (1, 2 or 4 keys
    per warp iteration), and the gather path over the same pages; milliseconds per call
    (median)."""
    import mlx.core as mx
    import numpy as np

    from tandem.bench.paged_attention import timeit
    from tandem.runner import kernel_check, kernels
    from tandem.runner.kv_quant import KVQuant, QuantizedPages

    h, hkv, d, page = 16, 8, 128, 16
    rows = []
    for quant in (None, KVQuant(8), KVQuant(4)):
        ok = kernel_check.available(d, h, hkv, mx.bfloat16, quant)
        for b in streams:
            per = context // page
            tables = mx.array(np.random.default_rng(0).permutation(b * per).reshape(b, per))
            raw = mx.random.normal((b * per * page, 2 * hkv, d)).astype(mx.bfloat16)
            pool = raw
            if quant is not None:
                pool = QuantizedPages(raw.shape[0], (2 * hkv, d), mx.bfloat16, quant)
                pool.q, pool.scales, pool.biases = pool.encode(raw)
            q = mx.random.normal((b, h, d)).astype(mx.bfloat16)
            lengths = mx.array([context] * b, dtype=mx.int32)
            work = kernels.DecodeWork([context] * b)
            mx.eval(q, tables, *([pool] if quant is None else pool.parts()))
            row = {"kv": f"int{quant.bits}" if quant else "bf16", "streams": b, "kernel_ok": ok}
            for u in (1, 2, 4) if ok else ():  # keys per warp iteration
                row[f"kernel_ms_u{u}"] = timeit(
                    lambda q=q, pool=pool, tables=tables, lengths=lengths, work=work, u=u: (
                        kernels.paged_decode(q, pool, tables, lengths, d**-0.5, page, work, u)
                    ),
                    repeats,
                )
            row["gather_ms"] = timeit(
                lambda q=q, pool=pool, tables=tables, lengths=lengths: kernel_check.reference(
                    q, pool, tables, lengths, d**-0.5, page
                ),
                repeats,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory or .gguf (default: the default model)")
    p.add_argument("--shape", help="instead, random weights of a shape of `tandem bench offline`")
    p.add_argument("--dtype", default="auto", help="the model's compute dtype")
    p.add_argument("--kv-dtypes", default="auto,int8,int4")
    p.add_argument("--kv-memory-fraction", type=float, help="the pool's memory (engine default)")
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=4096, help="prompt tokens of the speed run")
    p.add_argument("--streams", default="1,4")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--kernel", action="store_true", help="only the decode kernel, one layer (GPU)")
    p.add_argument("--json", help="write the results here")


def main(args: argparse.Namespace) -> int:
    import tempfile

    if args.kernel:
        rows = kernel_times(args.context, [int(x) for x in args.streams.split(",") if x])
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    if args.shape is None:
        return run(args, args.model)
    from tandem.bench.shapes import make_model

    with tempfile.TemporaryDirectory() as tmp:
        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        return run(args, str(make_model(args.shape, dtype, Path(tmp))))


def run(args: argparse.Namespace, model: str | None) -> int:
    import mlx.core as mx

    from tandem import LLM

    dtypes = args.kv_dtypes.split(",")
    streams = [int(x) for x in args.streams.split(",") if x]
    rows: list[dict[str, Any]] = []
    free: dict[str, list] = {}
    pairs = base = None
    for kv in dtypes:
        llm = LLM(
            model,
            dtype=args.dtype,
            kv_cache_dtype=kv,
            kv_memory_fraction=args.kv_memory_fraction,
            max_num_seqs=max(256, *streams),  # the memory, not the sequences, sizes the pool
            max_model_len=args.context + args.max_tokens + 16,
        )
        runner = llm.engine.loop.runner
        row: dict[str, Any] = {
            "kv_dtype": kv,
            "storage": runner.kv_description,
            "decode_kernel": bool(runner.decode_kernel),
            "bytes_per_token": runner.bytes_per_token,
            "pool_tokens": llm.engine.scheduler.config.kv_budget_tokens,
        }
        if not args.skip_quality:
            run = answers(llm, args.answer_tokens)
            free[kv] = [a for _, a in run]
            if pairs is None:  # the first dtype's answers are the reference
                pairs = run
                base = read_back(llm, pairs)
            got = read_back(llm, pairs)
            row.update(quality(base, got, [a for _, a in pairs], free[dtypes[0]], free[kv]))
        for b in streams:
            got = speed(llm, args.context, b, args.max_tokens, args.repeats)
            row.update({f"{k}_{b}": v for k, v in got.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm, runner
        gc.collect()
        mx.clear_cache()
    for row in rows:
        row["capacity_ratio"] = row["pool_tokens"] / rows[0]["pool_tokens"]
        for b in streams:
            row[f"speed_ratio_{b}"] = row[f"tok_s_{b}"] / rows[0][f"tok_s_{b}"]
    print()
    print(table(rows, streams, args.context))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def table(rows: list[dict[str, Any]], streams: list[int], context: int) -> str:
    speed_cols = "".join(
        f" after a {context}-token hit, {b} streams: tok/s (vs auto; decode only) |"
        for b in streams
    )
    head = (
        "| KV | storage | bytes/token | tokens in the pool (vs auto) | top-1 agreement "
        f"| max / mean logprob diff | free run parts at (median) |{speed_cols}\n"
        "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(streams)
    )
    lines = [head]
    for r in rows:
        q = (
            f" {r['agreement']:.1%} | {r['max_logprob_diff']:.3f} / {r['mean_logprob_diff']:.4f}"
            f" | {statistics.median(r['free_run_parts_at']):.0f} |"
            if "agreement" in r
            else " | | |"
        )
        sp = "".join(
            f" {r[f'tok_s_{b}']:.1f} ({r[f'speed_ratio_{b}']:.2f}x; {r[f'decode_tok_s_{b}']:.1f}) |"
            for b in streams
        )
        lines.append(
            f"| {r['kv_dtype']} | {r['storage']} | {r['bytes_per_token']} | "
            f"{r['pool_tokens']} ({r['capacity_ratio']:.2f}x) |{q}{sp}"
        )
    return "\n".join(lines)
