"""Offline benchmark: Tandem and mlx-lm side by side, in one process, on one model.

* single stream: decode tok/s of ``LLM.stream`` vs ``mlx_lm.generate.generate_step``
  (time from the first token to the last, so prefill is excluded on both sides);
* batched: B prompts of ``input_len`` random tokens, ``output_len`` tokens each with EOS
  ignored, end-to-end output tok/s of ``LLM.generate`` vs ``mlx_lm.batch_generate``;
* overlap on vs off for the same build.

Every number is a median over ``repeats`` runs after a warm-up; each batched run has prompts
of its own. ``--ceiling`` adds the plain loop (bench/ceiling.py) as one more side.
``--interleave`` loads the sides together and takes their runs in turn (bench/sides.py), so
the machine's drift falls on all alike: the default on the CPU, and on a GPU where every
side's copy of the model fits a quarter of the device's memory (else phase by phase, one
copy at a time). Interleaved on a GPU, Tandem's pool holds just what the batch needs; such a
tight pool once made its ramp 6x slower (every admission evicting, each walking the prefix
tree: fixed in d298f05), the slowdown the twelfth session saw only interleaved.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.bench import sides
from tandem.bench.ceiling import side as ceiling_side
from tandem.bench.shapes import FAMILY_SHAPES, RANDOM_SHAPES, make_model  # noqa: F401 (API)


class _NoEos:
    """A tokenizer stand-in for mlx-lm's batch_generate with EOS disabled."""

    eos_token_ids: set[int] = set()

    def decode(self, ids: list[int]) -> str:
        return ""


def single_stream(
    path: Path,
    n: int,
    repeats: int,
    prompt: list[int],
    engine_options: dict[str, Any],
    interleave: bool = False,
    ceiling: bool = False,
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Decode tok/s of one stream, from its first token to its last (prefill excluded)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    from tandem import LLM, SamplingParams

    def mlx_lm() -> sides.Run:
        model = load(str(path))[0]

        def run(p: list[int]) -> float:
            t0 = 0.0
            for i, _ in enumerate(generate_step(mx.array(p), model, max_tokens=n)):
                if i == 0:
                    t0 = time.perf_counter()
            return (n - 1) / (time.perf_counter() - t0)

        return run

    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    if interleave and mx.default_device() != mx.cpu:
        # Two engines beside mlx-lm's model (and the ceiling's): each pool holds what one
        # stream needs, so the other copies still fit after the first engine's pool.
        engine_options = {"kv_budget_tokens": 8 * (len(prompt) + n + 64), **engine_options}

    def tandem(overlap: bool) -> sides.Loader:
        def loader() -> sides.Run:
            llm = LLM(str(path), overlap=overlap, max_num_seqs=8, **engine_options)

            def run(p: list[int]) -> float:
                t0 = 0.0
                for i, _ in enumerate(llm.stream(p, sp)):
                    if i == 0:
                        t0 = time.perf_counter()
                return (n - 1) / (time.perf_counter() - t0)

            return run

        return loader

    loaders = {
        "mlx_lm_tok_s": mlx_lm,
        "tandem_tok_s": tandem(True),
        "tandem_no_overlap_tok_s": tandem(False),
    }
    if ceiling:
        loaders["ceiling_tok_s"] = ceiling_side(path, n, prefill=False)
    out = _measured(loaders, [prompt] * (repeats + 1), interleave, save)
    out["overlap_on_off"] = out["tandem_tok_s"] / out["tandem_no_overlap_tok_s"]
    return out


def batched(
    path: Path,
    b: int,
    in_len: int,
    out_len: int,
    repeats: int,
    vocab: int,
    overlap_too: bool,
    engine_options: dict[str, Any],
    interleave: bool = False,
    ceiling: bool = False,
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """End-to-end output tok/s of B prompts, EOS ignored; each run its own prompts."""
    import mlx.core as mx
    from mlx_lm.generate import batch_generate
    from mlx_lm.utils import load

    from tandem import LLM, SamplingParams

    total = b * out_len

    def mlx_lm() -> sides.Run:
        model = load(str(path))[0]

        def run(prompts: list[list[int]]) -> float:
            t = time.perf_counter()
            r = batch_generate(
                model,
                _NoEos(),
                prompts,
                max_tokens=out_len,
                completion_batch_size=b,
                prefill_batch_size=min(b, 8),
                return_token_ids=True,
            )
            dt = time.perf_counter() - t
            assert sum(len(ids) for ids in r.token_ids) == total
            return total / dt

        return run

    sp = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    if interleave and mx.default_device() != mx.cpu:
        # Every side loaded at once: the engine's pool holds what the batch needs, not half
        # the device, so the other sides' caches still fit beside it.
        engine_options = {"kv_budget_tokens": b * (in_len + out_len + 64), **engine_options}

    def tandem(overlap: bool) -> sides.Loader:
        def loader() -> sides.Run:
            llm = LLM(str(path), overlap=overlap, max_num_seqs=max(b, 8), **engine_options)

            def run(prompts: list[list[int]]) -> float:
                t = time.perf_counter()
                outs = llm.generate(prompts, sp)
                dt = time.perf_counter() - t
                assert sum(len(o.token_ids) for o in outs) == total
                return total / dt

            return run

        return loader

    loaders = {"mlx_lm_tok_s": mlx_lm, "tandem_tok_s": tandem(True)}
    if overlap_too:
        loaders["tandem_no_overlap_tok_s"] = tandem(False)
    if ceiling:
        loaders["ceiling_tok_s"] = ceiling_side(path, out_len, prefill=True)
    sets = sides.prompt_sets(seed=b, count=repeats + 1, b=b, length=in_len, vocab=vocab)
    out = _measured(loaders, sets, interleave, save)
    if overlap_too:
        out["overlap_on_off"] = out["tandem_tok_s"] / out["tandem_no_overlap_tok_s"]
    return out


def _measured(
    loaders: dict[str, sides.Loader],
    inputs: list[Any],
    interleave: bool,
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The row of one configuration: each side's median rate (the error of mlx-lm's side or
    the ceiling's if it failed: mlx-lm may not run or batch every family, and either may run
    out of a device's memory) and Tandem's ratios to them; ``save`` gets the row as it
    grows."""

    def row(rates: dict[str, float], errors: dict[str, str]) -> dict[str, Any]:
        out: dict[str, Any] = dict(rates)
        for side, key in (("mlx_lm_tok_s", "mlx_lm_error"), ("ceiling_tok_s", "ceiling_error")):
            if side in errors:
                out[key] = errors[side]
        tandem = out.get("tandem_tok_s")
        if tandem and "mlx_lm_tok_s" in out:
            out["ratio_vs_mlx_lm"] = tandem / out["mlx_lm_tok_s"]
        if tandem and "ceiling_tok_s" in out:
            out["of_ceiling"] = tandem / out["ceiling_tok_s"]
        return out

    optional = frozenset({"mlx_lm_tok_s", "ceiling_tok_s"})
    progress = None if save is None else (lambda r, e: save(row(r, e)))
    rates, errors = sides.measure(
        loaders, inputs, interleave=interleave, optional=optional, progress=progress
    )
    return row(rates, errors)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: a random-weight --shape)")
    p.add_argument("--shape", choices=RANDOM_SHAPES, default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-sizes", default="16,64,256")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--single-tokens", type=int, default=256)
    p.add_argument("--repeats", type=_positive, default=3)
    p.add_argument(
        "--overlap-batch", type=int, default=64, help="also run this batch size with overlap off"
    )
    p.add_argument(
        "--kv-double-buffer",
        choices=("auto", "on", "off"),
        default="auto",
        help="Tandem's KV double buffering (auto: on with overlap)",
    )
    p.add_argument(
        "--engine-options",
        default="{}",
        help="JSON of more engine options for Tandem, e.g. '{\"kv_inplace_writes\": false}'",
    )
    p.add_argument(
        "--ceiling",
        action="store_true",
        help="also run the plain-loop ceiling (mlx-lm's caches, argmax, each step built on "
        "the last one's lazy tokens, no scheduling) as one more side",
    )
    p.add_argument(
        "--interleave",
        choices=("auto", "on", "off"),
        default="auto",
        help="load the sides together and take their runs in turn, so the machine's drift "
        "falls on all alike (auto: on for the CPU, and on a GPU where every side's copy of "
        "the model fits a quarter of its memory; off keeps one copy of the model in memory "
        "at a time)",
    )
    p.add_argument("--json", help="write results here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tandem.runner  # noqa: F401  (preloads BLAS before mlx)

    # isort: split
    import mlx.core as mx
    import mlx_lm

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else make_model(args.shape, args.dtype, Path(tmp))
        cfg = json.loads((path / "config.json").read_text())
        vocab = min(int(cfg["vocab_size"]), 512)
        results: dict[str, Any] = {
            "model": args.model or f"random {args.shape} ({args.dtype})",
            "device": str(mx.default_device()),
            "machine": platform.machine(),
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "input_len": args.input_len,
            "output_len": args.output_len,
        }
        prompt = [random.Random(0).randrange(10, vocab) for _ in range(32)]
        opts: dict[str, Any] = {}
        if args.kv_double_buffer != "auto":
            opts["kv_double_buffer"] = args.kv_double_buffer == "on"
        opts.update(json.loads(args.engine_options))
        results["engine_options"] = opts
        # auto: on the CPU; on a GPU where every side's copy of the model (mlx-lm's, two
        # engines', the ceiling's) fits a quarter of its memory.
        auto = args.interleave == "auto"
        fits = auto and (mx.default_device().type == mx.cpu or _fits(path, 3 + args.ceiling))
        interleave = args.interleave == "on" or fits
        results["interleaved"] = interleave

        def saver(key: str) -> Callable[[dict[str, Any]], None]:
            def save(row: dict[str, Any]) -> None:
                results[key] = row
                _save(args.json, results)

            return save

        results["single"] = single_stream(
            path,
            args.single_tokens,
            args.repeats,
            prompt,
            opts,
            interleave,
            ceiling=args.ceiling,
            save=saver("single"),
        )
        _report("single stream", results["single"])
        _save(args.json, results)
        for b in [int(x) for x in args.batch_sizes.split(",") if x]:
            r = batched(
                path,
                b,
                args.input_len,
                args.output_len,
                args.repeats,
                vocab,
                overlap_too=b == args.overlap_batch,
                engine_options=opts,
                interleave=interleave,
                ceiling=args.ceiling,
                save=saver(f"batch_{b}"),
            )
            results[f"batch_{b}"] = r
            _report(f"B={b}", r)
            _save(args.json, results)
    return results


def _fits(path: Path, copies: int) -> bool:
    """Whether ``copies`` copies of the model's weights (one a side) take at most a quarter
    of the device's memory (False where MLX does not report it)."""
    import mlx.core as mx

    total = mx.device_info().get("memory_size") or mx.device_info().get("total_memory")
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    weights += sum(f.stat().st_size for f in path.glob("*.gguf"))
    return bool(total) and copies * weights <= int(total) // 4


def _save(path: str | None, results: dict[str, Any]) -> None:
    """Written after every row, so a run that dies later (a device's out-of-memory or a
    crash inside MLX) keeps the rows it finished."""
    if path:
        Path(path).write_text(json.dumps(results, indent=2))


def _report(name: str, r: dict[str, Any]) -> None:
    parts = [f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()]
    print(f"{name:>14}: " + "  ".join(parts), file=sys.stderr, flush=True)
