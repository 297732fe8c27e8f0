"""Ragged batch: does one long prompt slow every other request down?

B short prompts (``--short-len`` tokens, ``--output-len`` out each), then the same batch with
one of them replaced by a ``--long-len``-token prompt. For Tandem (engine-level timing) it
reports the decode rate of the B-1 short requests — their output tokens after the first,
over the span from the moment all of them have a first token to the moment the last of them
finishes — with and without the long one, and the time until they all have a first token
(prefill) separately. mlx-lm's ``batch_generate`` runs the same two batches end to end.

    python -m tandem.bench.ragged --shape qwen3-0.6b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.bench.offline import _NoEos
from tandem.bench.shapes import RANDOM_SHAPES, make_model


def tandem_run(llm: Any, prompts: list[list[int]], out_len: int, short: set[int]) -> dict:
    from tandem import SamplingParams

    engine = llm.engine
    sp = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts]
    idx = {rid: i for i, rid in enumerate(ids)}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    count = dict.fromkeys(range(len(prompts)), 0)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            i = idx[out.request_id]
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(i, now)
                count[i] += len(out.new_token_ids)
            if out.finish_reason:
                last[i] = now
    end = time.perf_counter()
    ready = max(first[i] for i in short)
    done = max(last[i] for i in short)
    decode_tokens = sum(count[i] - 1 for i in short)
    out = {
        "short_prefill_s": ready - t0,
        "short_decode_tok_s": decode_tokens / (done - ready),
        "end_to_end_tok_s": sum(count.values()) / (end - t0),
    }
    long_ = [i for i in range(len(prompts)) if i not in short]
    if long_:
        out["long_ttft_s"] = first[long_[0]] - t0
    return out


def run(args: argparse.Namespace) -> dict:
    import tandem.runner  # noqa: F401, I001  (preloads BLAS before mlx)
    from mlx_lm.generate import batch_generate
    from mlx_lm.utils import load

    from tandem import LLM

    root = Path(tempfile.mkdtemp(prefix="tandem-ragged-"))
    path = Path(args.model) if args.model else make_model(args.shape, args.dtype, root)
    rng = random.Random(0)
    b = args.batch
    vocab = 1000
    shorts = [[rng.randrange(10, vocab) for _ in range(args.short_len)] for _ in range(b)]
    long_prompt = [rng.randrange(10, vocab) for _ in range(args.long_len)]
    cases = {
        "uniform": (shorts, set(range(b))),
        "one_long": (shorts[:-1] + [long_prompt], set(range(b - 1))),
        "short_only": (shorts[:-1], set(range(b - 1))),
    }
    result: dict[str, Any] = {"args": vars(args)}
    model = load(str(path))[0]
    for name in ("uniform", "one_long"):
        prompts = cases[name][0]

        def mlx(prompts: list[list[int]] = prompts) -> float:
            t = time.perf_counter()
            r = batch_generate(
                model,
                _NoEos(),
                prompts,
                max_tokens=args.output_len,
                completion_batch_size=len(prompts),
                prefill_batch_size=8,
                return_token_ids=True,
            )
            return sum(len(x) for x in r.token_ids) / (time.perf_counter() - t)

        try:
            mlx()
            result[f"mlx_lm_{name}_tok_s"] = statistics.median(mlx() for _ in range(args.repeats))
        except RuntimeError as e:  # e.g. mlx-lm's padded batch cache out of device memory
            result[f"mlx_lm_{name}_error"] = str(e)[:200]
            print(f"mlx-lm {name}: {e}", flush=True)
            break
    model = None
    import mlx.core as mx

    mx.clear_cache()
    # No prefix cache (unless asked): the cases share their short prompts and every run
    # repeats the warm-up's, so hits would skip the prefills whose cost this measures.
    options = {"prefix_cache": False, **json.loads(args.engine_options)}
    llm = LLM(str(path), max_num_seqs=max(b, 8), **options)
    for name, (prompts, short) in cases.items():
        tandem_run(llm, prompts, args.output_len, short)  # warm-up (kernel JIT)
        runs = [tandem_run(llm, prompts, args.output_len, short) for _ in range(args.repeats)]
        result[f"tandem_{name}"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    base = result["tandem_short_only"]["short_decode_tok_s"]
    result["tandem_short_decode_ratio_with_long"] = (
        result["tandem_one_long"]["short_decode_tok_s"] / base
    )
    if "mlx_lm_one_long_tok_s" in result:
        result["mlx_lm_one_long_over_uniform"] = (
            result["mlx_lm_one_long_tok_s"] / result["mlx_lm_uniform_tok_s"]
        )
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--shape", choices=RANDOM_SHAPES, default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--short-len", type=int, default=128)
    p.add_argument("--long-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engine-options", default="{}", help="JSON of extra LLM options")
    p.add_argument("--json")
    run(p.parse_args())


if __name__ == "__main__":
    main()
