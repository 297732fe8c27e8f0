"""The ``tandem`` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# transformers warns at import that PyTorch is missing; Tandem never needs it.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _generate(args: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        llm = LLM(args.model, overlap=not args.no_overlap, max_num_seqs=8)
        prompt = (
            llm.chat_prompt([{"role": "user", "content": args.prompt}])
            if args.chat
            else args.prompt
        )
        printed = 0
        for out in llm.stream(prompt, params):
            sys.stdout.write(out.text[printed:])
            sys.stdout.flush()
            printed = len(out.text)
    except ValueError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from tandem.bench import offline

    offline.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt and print the text")
    g.add_argument("--model", help="model directory or .gguf (default: SmolLM2-135M-Instruct)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--no-overlap", action="store_true", help="one step in flight")
    g.set_defaults(func=_generate)
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    off = bsub.add_parser("offline", help="Tandem vs mlx-lm in one process")
    from tandem.bench.offline import add_arguments

    add_arguments(off)
    off.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if not args.verbose:
        logging.getLogger("tandem").setLevel(logging.INFO)
        logging.getLogger("tandem").handlers[:] = [logging.StreamHandler(sys.stderr)]
        logging.getLogger("tandem").propagate = False
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
