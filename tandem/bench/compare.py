"""`tandem bench compare`: Tandem and `mlx_lm.server` on the same model, the same sweep, the
same client, then a markdown table of medians with ratios and PNG plots.

Both servers are started up front (on two ports) and warmed up; for every (dataset,
concurrency) point the repeats alternate between them (repeat i: Tandem first for even i,
mlx_lm first for odd i), so a drift of the machine over the sweep hits both sides alike.

Every run sends fresh prompts, the same ones to both servers, so no server answers a prompt it
has already cached. ``random`` prompts are distinct random text. ``shared-prefix`` draws its
prefixes from one fixed pool of ``--num-prefixes`` (the warm-up touches each of them on both
servers) plus a fresh suffix per request: it measures serving with hot shared prefixes.
``multi-turn`` conversations of ``--num-turns`` user messages each resend the whole history
(prompt text plus the answers so far): per turn, the TTFT and the prompt share the server
reports as cached.

    tandem bench compare --model DIR --out docs/benchmarks/cpu-tiny
    tandem bench compare --replot docs/benchmarks/cpu-tiny   # table.md + PNGs from results.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tandem.bench.compare_report import SERVERS, markdown, plot, ratios, replot, write_results
from tandem.bench.compare_servers import (
    Server,
    ServerError,
    free_ports,
    launch,
    server_command,
    stop_all,
    wait_ready,
)
from tandem.bench.datasets import RequestSpec, TextMaker
from tandem.bench.provenance import command_line, environment
from tandem.bench.serve_client import run
from tandem.bench.serve_metrics import compute

DATASETS = ("random", "shared-prefix", "multi-turn")
MIN_PROMPTS_PER_CONCURRENCY = 2.0


# --- prompts ---------------------------------------------------------------------------------


def run_seed(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def num_prompts(concurrency: int, per_concurrency: float, minimum: int) -> int:
    return max(minimum, math.ceil(per_concurrency * concurrency))


class Prompts:
    """Fresh request sets per run; shared-prefix requests draw from one fixed prefix pool."""

    def __init__(self, maker: TextMaker, args: argparse.Namespace) -> None:
        self.maker = maker
        self.input_len = args.input_len
        self.output_len = args.output_len
        self.num_turns = args.num_turns
        rng = random.Random(run_seed("prefixes", args.prefix_len))
        self.prefixes = [maker.make(args.prefix_len, rng) for _ in range(args.num_prefixes)]

    def specs(self, dataset: str, n: int, seed: int, output_len: int | None = None) -> list:
        rng = random.Random(seed)
        out_len = self.output_len if output_len is None else output_len
        specs: list[RequestSpec] = []
        for i in range(n):
            text = self.maker.make(self.input_len, rng)
            group = -1
            if dataset == "shared-prefix":
                group = (i + seed) % len(self.prefixes)
                text = self.prefixes[group] + text
            turns = []
            if dataset == "multi-turn":
                turns = [self.maker.make(self.input_len, rng) for _ in range(self.num_turns - 1)]
            specs.append(
                RequestSpec(text, out_len, self.maker.length(text), group=group, turns=turns)
            )
        rng.shuffle(specs)
        return specs


# --- driving ---------------------------------------------------------------------------------


async def run_on(
    server: Server,
    specs: list[RequestSpec],
    concurrency: int | None,
    request_rate: float = float("inf"),
    seed: int = 0,
) -> tuple[list, float]:
    """Stream ``specs`` to ``server``'s /v1/completions (EOS ignored, no progress bar)."""
    return await run(
        server.url,
        "/v1/completions",
        server.model_name,
        specs,
        max_concurrency=concurrency,
        request_rate=request_rate,
        ignore_eos=True,
        seed=seed,
        progress=False,
    )


def drive(server: Server, specs: list[RequestSpec], concurrency: int, timeout: float) -> dict:
    """One run of ``specs`` at ``concurrency`` against one server; the metric dict."""
    server.check_alive()
    coro = run_on(server, specs, concurrency)
    try:
        records, duration = asyncio.run(asyncio.wait_for(coro, timeout))
    except TimeoutError:
        raise ServerError(server, f"did not finish a run within {timeout:.0f} s") from None
    server.check_alive()
    return compute(records, duration)


def warm_up(servers: list[Server], prompts: Prompts, dataset: str, conc: list[int]) -> None:
    """Before a dataset's sweep: short requests of its shape at every concurrency, all servers
    at once (first-use compilation of each batch shape), which for shared-prefix also touches
    every prefix of the pool on every server."""

    async def one(server: Server, specs: list[RequestSpec], c: int) -> None:
        m = compute(*await run_on(server, specs, c))
        if m["failed"]:
            raise ServerError(
                server, f"failed {m['failed']} of {len(specs)} warm-up requests: {m['errors']}"
            )

    async def all_servers() -> None:
        for c in conc:
            n = max(c, len(prompts.prefixes)) if dataset == "shared-prefix" else c
            specs = prompts.specs(dataset, n, run_seed("warmup", dataset, c), out_len)
            await asyncio.gather(*(one(s, specs, c) for s in servers))

    out_len = min(prompts.output_len, 8)
    t = time.perf_counter()
    asyncio.run(all_servers())
    for s in servers:
        s.check_alive()
    print(f"compare: {dataset} warm-up done in {time.perf_counter() - t:.1f} s", file=sys.stderr)


def run_summary(m: dict[str, Any], rep: int, position: int) -> dict[str, Any]:
    return {
        "repeat": rep,
        "position": position,  # 0: this server ran first in the pair
        "output_throughput": m["output_throughput"],
        "ttft_ms": m["ttft_s"]["median"] * 1e3,
        "tpot_ms": m["tpot_s"]["median"] * 1e3,
        "itl_ms": m["itl_s"]["median"] * 1e3,
        "e2e_ms": m["e2e_latency_s"]["median"] * 1e3,
        "ttft_p99_ms": m["ttft_s"]["p99"] * 1e3,
        "tpot_p99_ms": m["tpot_s"]["p99"] * 1e3,
        "duration_s": m["duration_s"],
        "completed": m["completed"],
        "failed": m["failed"],
        "errors": m["errors"],
        "short_outputs": m["outputs_with_unexpected_length"],
        "per_turn": m.get("per_turn"),
    }


def point_summary(runs: list[dict[str, Any]], n: int) -> dict[str, Any]:
    med = statistics.median
    out = {
        "output_throughput": med(r["output_throughput"] for r in runs),
        "ttft_ms": med(r["ttft_ms"] for r in runs),
        "tpot_ms": med(r["tpot_ms"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "short_outputs": sum(r["short_outputs"] for r in runs),
        "num_prompts": n,
        "runs": runs,
    }
    turns = [r["per_turn"] for r in runs if r.get("per_turn")]
    if turns:  # per turn: medians over the repeats
        out["per_turn"] = [
            {
                "turn": ts[0]["turn"],
                "ttft_ms": med(t["ttft_ms_median"] for t in ts),
                "prompt_tokens": med(t["prompt_tokens_mean"] for t in ts),
                "cached_share": med(s)
                if (s := [t["cached_share"] for t in ts if t["cached_share"] is not None])
                else None,
            }
            for ts in zip(*turns, strict=False)
        ]
    return out


def ordered(servers: list[Server], rep: int) -> list[Server]:
    return servers if rep % 2 == 0 else servers[::-1]


# --- command ---------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a model directory both servers can load")
    p.add_argument("--out", help="folder for results.json, table.md, PNGs and server logs")
    p.add_argument("--servers", default=",".join(SERVERS), help="tandem,mlx_lm or a subset")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--datasets", default="random,shared-prefix", help=",".join(DATASETS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128, help="prompt (or suffix) tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument(
        "--prompts-per-concurrency",
        type=float,
        default=MIN_PROMPTS_PER_CONCURRENCY,
        help="requests per run = max(--min-prompts, ceil(this x concurrency)); at least 2",
    )
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument(
        "--tandem-args",
        default="",
        help="appended to `tandem serve`, shlex-split (one flag alone: --tandem-args=--flag)",
    )
    p.add_argument("--mlx-lm-args", default="", help="appended to `mlx_lm server`, shlex-split")
    p.add_argument(
        "--mlx-lm-backlog",
        type=int,
        default=1024,
        help="listen backlog for mlx_lm.server (0: its own, 5; too few for high concurrency)",
    )
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument(
        "--replot",
        metavar="DIR",
        help="only rewrite DIR/table.md and the PNGs from DIR/results.json",
    )


def _validate(args: argparse.Namespace) -> tuple[list[str], list[int], list[str]]:
    if not args.model or not args.out:
        raise ValueError("--model and --out are required (unless --replot)")
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or any(s not in SERVERS for s in servers) or len(set(servers)) < len(servers):
        raise ValueError(f"--servers: a subset of {','.join(SERVERS)}, got {args.servers!r}")
    servers = [s for s in SERVERS if s in servers]  # tandem first in even repeats
    conc = [int(x) for x in args.concurrency.split(",")]
    if any(c < 1 for c in conc):
        raise ValueError("--concurrency: positive integers")
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    for d in datasets:
        if d not in DATASETS:
            raise ValueError(f"unknown dataset {d!r}; expected some of {','.join(DATASETS)}")
    if args.prompts_per_concurrency < MIN_PROMPTS_PER_CONCURRENCY:
        raise ValueError("--prompts-per-concurrency must be at least 2")
    if args.repeats < 1 or args.num_prefixes < 1:
        raise ValueError("--repeats and --num-prefixes must be at least 1")
    return servers, conc, datasets


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM (e.g. from `timeout`) raise KeyboardInterrupt wherever we are, so
    the servers get stopped. (Left to asyncio.run, Ctrl-C only cancels the client's task,
    and a cancelled stream can come back as an ordinary failed request.)"""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {}
    with contextlib.suppress(ValueError):  # not the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    previous = {}
    with contextlib.suppress(ValueError):  # not the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def main(args: argparse.Namespace) -> int:
    if args.replot:
        return replot(Path(args.replot))
    try:
        kinds, conc, datasets = _validate(args)
    except ValueError as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    from tandem.frontend.tokenizer import Tokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = Prompts(TextMaker(Tokenizer.load(Path(args.model))), args)
    extra = {"tandem": shlex.split(args.tandem_args), "mlx_lm": shlex.split(args.mlx_lm_args)}
    per_sweep = sum(num_prompts(c, args.prompts_per_concurrency, args.min_prompts) for c in conc)
    print(
        f"compare: {','.join(kinds)} x {len(datasets)} dataset(s) x {len(conc)} "
        f"concurrencies x {args.repeats} repeats: {per_sweep * len(datasets) * args.repeats} "
        "requests per server",
        file=sys.stderr,
    )
    doc: dict[str, Any] = {
        "model": args.model,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "command": command_line(),
        "argv": sys.argv,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "complete": False,
        **environment(),
        "servers": {},
        "results": {k: {} for k in kinds},
    }
    servers: list[Server] = []
    with tempfile.TemporaryDirectory() as cache, _signals_interrupt():
        # mlx_lm.server answers /v1/models with a 500 unless HF_HUB_CACHE exists.
        env = {**os.environ, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        try:
            for kind, port in zip(kinds, free_ports(len(kinds)), strict=True):
                cmd = server_command(
                    kind, args.model, port, max(conc), extra[kind], args.mlx_lm_backlog
                )
                servers.append(launch(kind, cmd, port, out / "logs" / f"{kind}.log", env))
                doc["servers"][kind] = {"command": shlex.join(cmd), "log": f"logs/{kind}.log"}
            wait_ready(servers, args.startup_timeout)
            for name in datasets:
                if not args.no_warmup:
                    warm_up(servers, prompts, name, conc)
                for c in conc:
                    sweep_point(servers, prompts, name, c, args, doc)
                    write_results(out, doc)
        except ServerError as e:
            print(f"compare: error: {e}; last lines of {e.server.log}:", file=sys.stderr)
            print(e.server.log_tail(), file=sys.stderr)
            write_results(out, doc)
            return 1
        except KeyboardInterrupt:
            print("compare: interrupted; stopping the servers", file=sys.stderr)
            write_results(out, doc)
            return 130
        finally:
            with _signals_ignored():  # a second Ctrl-C must not leave a server running
                stop_all(servers)
    doc["complete"] = True
    doc["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    write_results(out, doc)
    plot(doc["results"], out)
    print(markdown(doc["results"]))
    return 0


def sweep_point(
    servers: list[Server],
    prompts: Prompts,
    name: str,
    c: int,
    args: argparse.Namespace,
    doc: dict[str, Any],
) -> None:
    """All repeats of one (dataset, concurrency) point, alternating the server order."""
    key = f"{name}/c{c}"
    n = num_prompts(c, args.prompts_per_concurrency, args.min_prompts)
    runs: dict[str, list[dict[str, Any]]] = {s.kind: [] for s in servers}
    for rep in range(args.repeats):
        specs = prompts.specs(name, n, run_seed(name, c, rep))
        for position, server in enumerate(ordered(servers, rep)):
            r = run_summary(drive(server, specs, c, args.run_timeout), rep, position)
            runs[server.kind].append(r)
            print(
                f"{server.kind:>7} {key:<22} rep {rep} {r['output_throughput']:9.1f} tok/s  "
                f"TTFT {r['ttft_ms']:8.1f} ms  TPOT {r['tpot_ms']:7.2f} ms"
                + (f"  FAILED {r['failed']}" if r["failed"] else ""),
                file=sys.stderr,
                flush=True,
            )
    for kind, rs in runs.items():
        doc["results"][kind][key] = point_summary(rs, n)
    line = "  ".join(
        f"{kind} {doc['results'][kind][key]['output_throughput']:.1f}" for kind in runs
    )
    r = ratios(doc["results"]).get(key)
    tail = f"  ratio {r['of_medians']:.2f} (paired {r['median_paired']:.2f})" if r else ""
    print(f" median {key:<22} {line} tok/s{tail}", file=sys.stderr, flush=True)
