"""`tandem bench serve`: drive any OpenAI-compatible server with streaming requests and
report the serving metric set (see serve_metrics.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tandem.bench.datasets import (
    RequestSpec,
    TextMaker,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
)
from tandem.bench.serve_metrics import SLO, RequestRecord, compute


async def stream_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[RequestRecord, str]:
    """One streamed request; returns its record and the generated text."""
    rec = RequestRecord(ok=False)
    text: list[str] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                rec.error = f"HTTP {r.status_code}"
                return rec, ""
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = "stream error"
                    return rec, ""
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
                    rec.output_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = details["cached_tokens"]
                for c in chunk.get("choices") or []:
                    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    # A finish chunk counts only if nothing came before (all-empty text,
                    # e.g. a random-weight model emitting ids without text).
                    if piece or (c.get("finish_reason") and not rec.chunk_times):
                        now = time.perf_counter() - start
                        if not rec.chunk_times:
                            rec.ttft = now
                        rec.chunk_times.append(now)
                        text.append(piece or "")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = type(e).__name__
        return rec, ""
    rec.latency = time.perf_counter() - start
    if not rec.chunk_times:
        rec.error = "no output"
    elif rec.output_tokens == 0:
        rec.error = "no usage (server ignored stream_options.include_usage)"
    else:
        rec.ok = True
    return rec, "".join(text)


async def run(
    base_url: str,
    endpoint: str,
    model: str | None,
    specs: list[RequestSpec],
    *,
    max_concurrency: int | None,
    request_rate: float,
    ignore_eos: bool,
    seed: int,
    api_key: str | None = None,
    temperature: float = 0.0,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    chat = endpoint.endswith("chat/completions")
    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(max_concurrency or len(specs) or 1)
    rng = random.Random(seed)
    records: list[RequestRecord] = []
    bar = _progress(sum(1 + len(s.turns) for s in specs), progress)

    def body_for(messages: list[dict[str, str]] | None, prompt: str, n: int) -> dict[str, Any]:
        b: dict[str, Any] = {
            "max_tokens": n,
            "stream": True,
            "temperature": temperature,
            "stream_options": {"include_usage": True},
        }
        if model:
            b["model"] = model
        if ignore_eos:
            b["ignore_eos"] = True
        if chat:
            b["messages"] = messages
        else:
            b["prompt"] = prompt
        return b

    async def conversation(client: httpx.AsyncClient, spec: RequestSpec) -> None:
        async with sem:
            history: list[dict[str, str]] = []
            prompt = ""
            for turn, user in enumerate([spec.prompt, *spec.turns]):
                history.append({"role": "user", "content": user})
                prompt += user
                rec, text = await stream_request(
                    client, url, body_for(history, prompt, spec.output_len), headers
                )
                rec.turn = turn
                rec.expected_output_tokens = spec.output_len if ignore_eos else None
                records.append(rec)
                bar.update(1)
                if not rec.ok:
                    return
                history.append({"role": "assistant", "content": text})
                prompt += text

    limits = httpx.Limits(max_connections=max_concurrency or len(specs) or 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(conversation(client, spec)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return records, duration


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, desc="requests", leave=False)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True)
    p.add_argument(
        "--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions")
    )
    p.add_argument("--model", help="model name sent in requests")
    p.add_argument(
        "--tokenizer",
        help="model directory or .gguf whose tokenizer sizes the prompts, or 'default' (the "
        "default model's); when omitted: --model if it is a local path, else the model GET "
        "/v1/models lists if its id (or root) is a local path or it is the default model",
    )
    p.add_argument("--dataset", choices=("random", "shared-prefix", "multi-turn"), default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: all at once)",
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--num-turns", type=int, default=3)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--seed",
        type=int,
        help="prompt seed; default a fresh one per run (printed), so successive runs of a "
        "sweep do not resend the same prompts and hit the prefix cache",
    )
    p.add_argument("--api-key")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--slo-e2e-ms", type=float)
    p.add_argument("--json", help="write the metrics here")


class ClientError(ValueError):
    """A bad command line (reported without a traceback)."""


def tokenizer_source(args: argparse.Namespace) -> Path | None:
    """The tokenizer's model path (None: the default model's). Without --tokenizer: --model
    when it is a local path, else the model the server's GET /v1/models lists (the one named
    --model, or its first): its id or vLLM's ``root`` when that is a local path, or the default
    model by name. Anything else is a ClientError asking for --tokenizer."""
    from tandem.model_source import DEFAULT_MODEL_NAME, ModelSourceError, resolve_model

    name = args.tokenizer
    if name is None:
        if args.model and Path(args.model).expanduser().exists():
            name = args.model
        elif args.model == DEFAULT_MODEL_NAME:
            return None
        else:
            name = _served_model_path(args)
    if name == "default":
        return None
    try:
        return resolve_model(name)
    except ModelSourceError as e:
        raise ClientError(
            f"--tokenizer: {e} (give a local model directory or .gguf, or 'default' for "
            f"{DEFAULT_MODEL_NAME})"
        ) from None


def _served_model_path(args: argparse.Namespace) -> str:
    """A local path (or 'default') for the model the server says it serves."""
    from tandem.model_source import DEFAULT_MODEL_NAME

    url = args.base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        listed = httpx.get(url, headers=headers, timeout=10).raise_for_status().json()["data"]
        models = {str(m["id"]): m for m in listed}
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ClientError(
            f"could not read the served model from {url} ({type(e).__name__}: {e}): pass "
            "--tokenizer with its model directory or .gguf"
        ) from None
    if not models:
        raise ClientError(f"{url} lists no model: pass --tokenizer")
    served = args.model or next(iter(models))
    if served not in models:
        raise ClientError(
            f"the server does not list {served!r} (it serves {sorted(models)}): pass "
            "--tokenizer with its model directory or .gguf"
        )
    for candidate in (served, models[served].get("root")):
        if isinstance(candidate, str) and Path(candidate).expanduser().exists():
            return candidate
    if served == DEFAULT_MODEL_NAME:
        return "default"
    raise ClientError(
        f"the server serves {served!r}: pass --tokenizer with its model directory or .gguf "
        "(a local path; nothing is downloaded)"
    )


def build_dataset(args: argparse.Namespace) -> list[RequestSpec]:
    from tandem.frontend.tokenizer import Tokenizer
    from tandem.model_source import resolve_model

    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
        print(f"bench serve: prompt seed {args.seed} (--seed {args.seed} repeats this run)")
    maker = TextMaker(Tokenizer.load(resolve_model(tokenizer_source(args))))
    if args.dataset == "random":
        return random_dataset(maker, args.num_prompts, args.input_len, args.output_len, args.seed)
    if args.dataset == "shared-prefix":
        return shared_prefix_dataset(
            maker,
            args.num_prompts,
            args.prefix_len,
            args.num_prefixes,
            args.input_len,
            args.output_len,
            args.seed,
        )
    return multi_turn_dataset(
        maker, args.num_prompts, args.num_turns, args.input_len, args.output_len, args.seed
    )


def main(args: argparse.Namespace) -> dict[str, Any]:
    specs = build_dataset(args)
    if args.dataset == "multi-turn" and args.endpoint != "/v1/chat/completions":
        args.endpoint = "/v1/chat/completions"
    records, duration = asyncio.run(
        run(
            args.base_url,
            args.endpoint,
            args.model,
            specs,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
            api_key=args.api_key,
            temperature=args.temperature,
        )
    )
    ms = 1e-3
    slo = SLO(
        *(
            v * ms if v is not None else None
            for v in (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
        )
    )
    result = compute(records, duration, slo if any((slo.ttft, slo.tpot, slo.e2e)) else None)
    result["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return result


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"{'completed':<34}{r['completed']}",
        f"{'failed':<34}{r['failed']}" + (f"  {r['errors']}" if r["errors"] else ""),
        f"{'duration (s)':<34}{r['duration_s']:.2f}",
        f"{'request throughput (req/s)':<34}{r['request_throughput']:.2f}",
        f"{'output token throughput (tok/s)':<34}{r['output_throughput']:.1f}",
        f"{'total token throughput (tok/s)':<34}{r['total_token_throughput']:.1f}",
    ]
    if "goodput" in r:
        lines.append(f"{'goodput (req/s)':<34}{r['goodput']:.2f}")
    for key, name in (
        ("ttft_s", "TTFT"),
        ("tpot_s", "TPOT"),
        ("itl_s", "ITL"),
        ("e2e_latency_s", "E2E latency"),
    ):
        s = r[key]
        lines.append(
            f"{name + ' (ms) mean/median/p99':<34}{s['mean'] * 1e3:.2f} / "
            f"{s['median'] * 1e3:.2f} / {s['p99'] * 1e3:.2f}"
        )
    for t in r.get("per_turn", ()):
        share = t["cached_share"]
        cached = f"{100 * share:.0f}% of prompt cached" if share is not None else "no cache report"
        lines.append(
            f"{'turn ' + str(t['turn']) + ' TTFT median (ms)':<34}{t['ttft_ms_median']:.2f}  "
            f"({t['prompt_tokens_mean']:.0f} prompt tokens, {cached})"
        )
    if r["outputs_with_unexpected_length"]:
        lines.append(
            f"WARNING: {r['outputs_with_unexpected_length']} outputs differ from "
            "--output-len: the server ignored ignore_eos (or stopped early)"
        )
    return "\n".join(lines)
