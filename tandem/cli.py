"""The ``tandem`` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import asdict

from tandem.config import KV_CACHE_DTYPES, SPECULATIVE_METHODS
from tandem.server.tool_calls import FORMATS as TOOL_CALL_FORMATS

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
        llm = LLM(**asdict(_engine_config(args)))
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


def _export_tokenizer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tandem.frontend.tokenizer import Tokenizer
    from tandem.model_source import ModelSourceError, resolve_model

    try:
        path = resolve_model(args.model)
    except ModelSourceError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.directory)
    if out.exists() and not out.is_dir():
        print(f"tandem: error: {str(out)!r} exists and is not a directory", file=sys.stderr)
        return 2
    files = Tokenizer.load(path).save(out)
    print(f"tandem: wrote the tokenizer of {path.name} to {out} ({', '.join(files)})")
    return 0


def _engine_config(args: argparse.Namespace):
    from tandem.config import EngineConfig

    return EngineConfig(
        model=args.model,
        overlap=not args.no_overlap,
        host_thread={"auto": None, "on": True, "off": False}[args.host_thread],
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_chunk=args.max_prefill_chunk,
        prefill_chunk_while_decoding=args.prefill_chunk_while_decoding,
        kv_memory_fraction=args.kv_memory_fraction,
        kv_budget_tokens=args.kv_budget_tokens,
        kv_page_size=args.kv_page_size,
        kv_window_pages=args.kv_window_pages,
        compile_decode=args.compile_decode,
        fuse_projections=args.fuse_projections,
        kv_cache_dtype=args.kv_cache_dtype,
        check_invariants=args.debug_invariants,
        prefix_cache=not args.no_prefix_cache,
        state_snapshots=args.state_snapshots,
        speculative=args.speculative,
        draft_model=args.draft_model,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_max_batch=args.speculative_max_batch,
        speculative_min_gain=args.speculative_min_gain,
    )


def _serve(args: argparse.Namespace) -> int:
    from tandem.server.serve import serve

    try:
        config = _engine_config(args)
        return serve(
            config,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            default_max_tokens=args.default_max_tokens,
            max_pending=args.max_pending,
            reasoning=args.reasoning,
            tool_call_format=args.tool_call_format,
            keep_billing_header=args.keep_billing_header,
            trust_request_chat_template=args.trust_request_chat_template,
            ui=not args.no_ui,
        )
    except (ValueError, RuntimeError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2


def _bench(args: argparse.Namespace) -> int:
    from tandem.bench import offline

    offline.run(args)
    return 0


def _add_engine_arguments(p: argparse.ArgumentParser, *, max_num_seqs: int) -> None:
    p.add_argument("--model", help="model directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--no-overlap", action="store_true", help="one step in flight")
    p.add_argument(
        "--host-thread",
        choices=("auto", "on", "off"),
        default="off",
        help="plan and apply results on a helper thread beside each submission (auto: on a "
        "GPU while the host sets the pace; engine/loop.py; off by default: measured no gain)",
    )
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    p.add_argument("--max-model-len", type=int)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="tokens per step, decodes and prefill chunks together (default 8192 on CUDA, "
        "2048 elsewhere)",
    )
    p.add_argument(
        "--max-prefill-chunk",
        type=int,
        default=2048,
        help="one request's prefill tokens per step (0: the whole step budget); bounds a long "
        "prompt's chunk attention while the step budget batches many prompts",
    )
    p.add_argument(
        "--prefill-chunk-while-decoding",
        type=int,
        default=0,
        help="prefill tokens per step while requests are decoding (0: no extra limit; "
        "512 measured worse on the H200, docs/benchmarks.md)",
    )
    p.add_argument(
        "--kv-memory-fraction",
        type=float,
        help="share of the memory left after the weights for the KV pool, sized once at "
        "start (default 0.5; on the CPU backend at most 4 GiB unless given)",
    )
    p.add_argument("--kv-budget-tokens", type=int, help="KV pool size in tokens (overrides)")
    p.add_argument("--kv-page-size", type=int, default=16, help="positions per KV page")
    p.add_argument(
        "--kv-window-pages",
        type=int,
        help="pages of the sliding-window layers' own group, freed behind the window "
        "(default: sized for every sequence's window; 0: no group)",
    )
    p.add_argument(
        "--compile-decode",
        type=int,
        default=None,
        metavar="ROWS",
        help="decode steps of at most ROWS rows replay a compiled trace of the model "
        "(with CUDA's decode kernel a speculative verify counts as one; default 8 with "
        "CUDA's in-place KV writes, "
        "4 on the CPU where MLX can build its fused kernels, else off; 0: off)",
    )
    p.add_argument(
        "--fuse-projections",
        type=int,
        default=0,
        metavar="ROWS",
        help="one matmul for each layer's q/k/v and gate/up projections in steps of at most "
        "ROWS rows (fewer kernel launches; 0: off; not yet measured on a GPU)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=tuple(KV_CACHE_DTYPES),
        default="auto",
        help="KV pages in the model's dtype (auto) or quantized per token in groups of 64 "
        "(int8: about 1.9x the tokens of float16, int4: about 3.6x)",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="recompute every prompt (no radix prefix cache)",
    )
    p.add_argument(
        "--state-snapshots",
        type=int,
        help="models with recurrent layers: states the prefix cache keeps (default: "
        "8 x --max-num-seqs, at least 64, within a quarter of the KV memory; 0: no prefix "
        "cache for them)",
    )
    p.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        help="speculative decoding: ngram proposes tokens from the request's own prompt and "
        "output, draft the greedy tokens of --draft-model; verified in the batched step, the "
        "output is unchanged",
    )
    p.add_argument(
        "--draft-model",
        help="with --speculative draft: a smaller model with the same tokenizer (directory "
        "or .gguf)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="most tokens proposed per verify (an n-gram match of n tokens proposes 2^n at most)",
    )
    p.add_argument(
        "--speculative-max-batch",
        type=int,
        default=None,
        help="no speculation while more requests than this decode (default 8; 1 for a "
        "recurrent model whose verifies cannot share a model call)",
    )
    p.add_argument(
        "--speculative-min-gain",
        type=float,
        default=1.0,
        help="speculation turns itself off for a while when its steps emit fewer tokens per "
        "second than this share of plain decoding's, as the engine times them (0: never)",
    )
    p.add_argument(
        "--debug-invariants",
        action="store_true",
        help="check scheduler invariants after every step",
    )


def _bench_serve(args: argparse.Namespace) -> int:
    from tandem.bench import serve_client

    try:
        result = serve_client.main(args)
    except serve_client.ClientError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    return 0 if result["completed"] else 1


def _bench_speculative(args: argparse.Namespace) -> int:
    from tandem.bench.speculative import main as run

    return run(args)


def _bench_kv_quant(args: argparse.Namespace) -> int:
    from tandem.bench.kv_quant import main as run

    return run(args)


def _bench_report(args: argparse.Namespace) -> int:
    from tandem.bench.report import main as run

    return run(args)


def _bench_compare(args: argparse.Namespace) -> int:
    from tandem.bench import compare

    return compare.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt and print the text")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--ignore-eos", action="store_true")
    _add_engine_arguments(g, max_num_seqs=8)
    g.set_defaults(func=_generate)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument(
        "--port", type=int, default=8000, help="0: a free port, named in the 'serving' line"
    )
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (not on /health)")
    s.add_argument("--served-model-name")
    s.add_argument(
        "--default-max-tokens",
        type=int,
        default=2048,
        help="chat max_tokens when the request gives none",
    )
    s.add_argument(
        "--max-pending",
        type=int,
        default=1024,
        help="requests in the engine before new ones get 503",
    )
    s.add_argument(
        "--reasoning",
        choices=("auto", "on", "off"),
        default="auto",
        help="return a leading <think> block as reasoning_content (auto: when the chat "
        "template uses think tags); requests override with separate_reasoning",
    )
    s.add_argument(
        "--tool-call-format",
        choices=("auto", *TOOL_CALL_FORMATS),
        default="auto",
        help="how the model writes tool calls (auto: from its chat template / model type)",
    )
    s.add_argument(
        "--keep-billing-header",
        action="store_true",
        help="/v1/messages: keep system blocks starting with x-anthropic-billing-header (by "
        "default they are dropped: they change every request and defeat the prefix cache)",
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat template (chat_template_kwargs.chat_template): "
        "Jinja from clients run on the server, so only for trusted clients",
    )
    s.add_argument(
        "--no-ui",
        action="store_true",
        help="serve no web pages (the playground at / and the dashboard at /dashboard)",
    )
    _add_engine_arguments(s, max_num_seqs=256)
    s.set_defaults(func=_serve)
    x = sub.add_parser(
        "export-tokenizer",
        help="write the model's tokenizer (rebuilt from a GGUF file) as a Hugging Face folder",
    )
    x.add_argument("directory", help="folder to write (created if missing)")
    x.add_argument("--model", help="model directory or .gguf (default: SmolLM2-135M-Instruct)")
    x.set_defaults(func=_export_tokenizer)
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    off = bsub.add_parser("offline", help="Tandem vs mlx-lm in one process")
    from tandem.bench.offline import add_arguments

    add_arguments(off)
    off.set_defaults(func=_bench)
    srv = bsub.add_parser("serve", help="drive an OpenAI-compatible server, report metrics")
    from tandem.bench.serve_client import add_arguments as add_serve_arguments

    add_serve_arguments(srv)
    srv.set_defaults(func=_bench_serve)
    cmp = bsub.add_parser("compare", help="Tandem vs mlx_lm.server, same sweep, same client")
    from tandem.bench.compare import add_arguments as add_compare_arguments

    add_compare_arguments(cmp)
    cmp.set_defaults(func=_bench_compare)
    spc = bsub.add_parser("speculative", help="Tandem with and without n-gram speculation")
    from tandem.bench.speculative import add_arguments as add_spec_arguments

    add_spec_arguments(spc)
    spc.set_defaults(func=_bench_speculative)
    kvq = bsub.add_parser("kv-quant", help="quantized KV pages vs float: capacity, quality, speed")
    from tandem.bench.kv_quant import add_arguments as add_kv_quant_arguments

    add_kv_quant_arguments(kvq)
    kvq.set_defaults(func=_bench_kv_quant)
    rep = bsub.add_parser("report", help="one machine's benchmark summary, one command")
    from tandem.bench.report import add_arguments as add_report_arguments

    add_report_arguments(rep)
    rep.set_defaults(func=_bench_report)
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
