"""Inter-token latency of running streams while long prompts keep arriving, Tandem and
`mlx_lm.server` side by side (both up at once, runs alternating).

Each run streams ``--streams`` short requests (``--input-len`` / ``--output-len``) at that
concurrency while a second client sends ``--num-long`` prompts of ``--long-len`` tokens (one
output token each) as a Poisson process at ``--long-rate`` per second. The streams' ITL
median and p99 (and the long prompts' TTFT) are reported, plus a baseline run without the
long prompts.

    python -m tandem.bench.itl_under_prefill --model DIR --out results.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from tandem.bench.compare import run_on
from tandem.bench.compare_servers import (
    Server,
    free_ports,
    launch,
    server_command,
    stop_all,
    wait_ready,
)
from tandem.bench.datasets import RequestSpec, TextMaker
from tandem.bench.serve_metrics import compute


async def _one_run(
    server: Server, streams: list[RequestSpec], longs: list[RequestSpec], args
) -> dict[str, Any]:
    jobs = [run_on(server, streams, len(streams), seed=1)]
    if longs:
        jobs.append(run_on(server, longs, None, args.long_rate, seed=1))
    results = await asyncio.gather(*jobs)
    m = compute(*results[0])
    out = {
        "itl_median_ms": m["itl_s"]["median"] * 1e3,
        "itl_p99_ms": m["itl_s"]["p99"] * 1e3,
        "tpot_median_ms": m["tpot_s"]["median"] * 1e3,
        "output_throughput": m["output_throughput"],
        "failed": m["failed"],
    }
    if longs:
        lm = compute(*results[1])
        out["long_ttft_median_s"] = lm["ttft_s"]["median"]
        out["long_failed"] = lm["failed"]
        if lm["failed"]:
            out["long_errors"] = lm["errors"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--servers", default="tandem,mlx_lm")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--long-len", type=int, default=4096)
    p.add_argument("--num-long", type=int, default=6)
    p.add_argument("--long-rate", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tandem-args", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from tandem.frontend.tokenizer import Tokenizer

    maker = TextMaker(Tokenizer.load(Path(args.model)))
    kinds = args.servers.split(",")
    out = Path(args.out)
    results: dict[str, Any] = {"config": vars(args), "runs": {k: [] for k in kinds}}
    servers: list[Server] = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1"}
        try:
            for kind, port in zip(kinds, free_ports(len(kinds)), strict=True):
                extra = shlex.split(args.tandem_args) if kind == "tandem" else []
                cmd = server_command(kind, args.model, port, args.streams + 8, extra, 1024)
                log = out.parent / "logs" / f"itl-{kind}.log"
                servers.append(launch(kind, cmd, port, log, env))
            wait_ready(servers, 600)
            for rep in range(args.repeats + 1):  # rep 0: warm-up
                rng = random.Random(rep)
                streams = [
                    RequestSpec(maker.make(args.input_len, rng), args.output_len, args.input_len)
                    for _ in range(args.streams)
                ]
                longs = [
                    RequestSpec(maker.make(args.long_len, rng), 1, args.long_len)
                    for _ in range(args.num_long)
                ]
                order = servers if rep % 2 == 0 else servers[::-1]
                for s in order:
                    for label, lg in (("with_long", longs), ("baseline", [])):
                        r = asyncio.run(_one_run(s, streams, lg, args))
                        r.update(kind=s.kind, label=label, rep=rep)
                        print(json.dumps(r), file=sys.stderr)
                        if rep:
                            results["runs"][s.kind].append(r)
                            out.parent.mkdir(parents=True, exist_ok=True)
                            out.write_text(json.dumps(results, indent=2))
        finally:
            stop_all(servers)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    for kind in kinds:
        for label in ("baseline", "with_long"):
            rs = [r for r in results["runs"][kind] if r["label"] == label]
            if not rs:
                continue
            med = sorted(r["itl_median_ms"] for r in rs)[len(rs) // 2]
            p99 = sorted(r["itl_p99_ms"] for r in rs)[len(rs) // 2]
            print(f"{kind:7s} {label:9s} ITL median {med:7.2f} ms  p99 {p99:8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
