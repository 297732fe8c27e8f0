"""`tandem bench compare`: Tandem and `mlx_lm.server` on the same model, the same sweep, the
same client — one server at a time on this machine — then a markdown table of medians with
ratios and PNG plots.

    tandem bench compare --model DIR --out docs/benchmarks/cpu-tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tandem.bench.datasets import TextMaker, random_dataset, shared_prefix_dataset
from tandem.bench.serve_client import run
from tandem.bench.serve_metrics import compute
from tandem.frontend.tokenizer import Tokenizer
from tandem.testing.live_server import free_port

SERVERS = ("tandem", "mlx_lm")


def start_server(
    kind: str, model: str, port: int, max_concurrency: int, cache: str
) -> subprocess.Popen:
    if kind == "tandem":
        cmd = [
            sys.executable,
            "-m",
            "tandem.cli",
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--served-model-name",
            "m",
            "--max-num-seqs",
            str(max(max_concurrency, 8)),
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "mlx_lm.server",
            "--model",
            model,
            "--port",
            str(port),
            "--decode-concurrency",
            str(max(max_concurrency, 8)),
            "--log-level",
            "WARNING",
        ]
    # mlx_lm.server answers /v1/models with a 500 unless HF_HUB_CACHE exists.
    env = {**os.environ, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{kind} server did not come up")


def sweep(
    kind: str,
    url: str,
    model_name: str | None,
    datasets: dict[str, list],
    concurrency: list[int],
    repeats: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, specs in datasets.items():
        for c in concurrency:
            points = []
            for rep in range(repeats):
                n = max(c * 2, 8)
                records, duration = asyncio.run(
                    run(
                        url,
                        "/v1/completions",
                        model_name,
                        specs[:n],
                        max_concurrency=c,
                        request_rate=float("inf"),
                        ignore_eos=True,
                        seed=rep,
                        progress=False,
                    )
                )
                points.append(compute(records, duration))
            key = f"{name}/c{c}"
            out[key] = {
                "output_throughput": statistics.median(p["output_throughput"] for p in points),
                "ttft_ms": statistics.median(p["ttft_s"]["median"] for p in points) * 1e3,
                "tpot_ms": statistics.median(p["tpot_s"]["median"] for p in points) * 1e3,
                "failed": sum(p["failed"] for p in points),
                "short_outputs": sum(p["outputs_with_unexpected_length"] for p in points),
            }
            print(
                f"{kind:>7} {key:<22} {out[key]['output_throughput']:9.1f} tok/s  "
                f"TTFT {out[key]['ttft_ms']:8.1f} ms  TPOT {out[key]['tpot_ms']:7.2f} ms",
                file=sys.stderr,
                flush=True,
            )
    return out


def markdown(results: dict[str, dict[str, Any]]) -> str:
    t, m = results["tandem"], results["mlx_lm"]
    rows = [
        "| dataset / concurrency | out tok/s Tandem | mlx-lm | ratio | TTFT ms Tandem | "
        "mlx-lm | TPOT ms Tandem | mlx-lm |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in t:
        a, b = t[key], m[key]
        rows.append(
            f"| {key} | {a['output_throughput']:.1f} | {b['output_throughput']:.1f} | "
            f"**{a['output_throughput'] / b['output_throughput']:.2f}** | "
            f"{a['ttft_ms']:.1f} | {b['ttft_ms']:.1f} | {a['tpot_ms']:.2f} | "
            f"{b['tpot_ms']:.2f} |"
        )
    return "\n".join(rows) + "\n"


def plot(results: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    keys = list(results["tandem"])
    datasets = sorted({k.split("/")[0] for k in keys})
    for metric, label in (
        ("output_throughput", "output tok/s"),
        ("ttft_ms", "TTFT median (ms)"),
        ("tpot_ms", "TPOT median (ms)"),
    ):
        fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 3.6), squeeze=False)
        for ax, ds in zip(axes[0], datasets, strict=True):
            for server in SERVERS:
                pts = [
                    (int(k.split("/c")[1]), v[metric])
                    for k, v in results[server].items()
                    if k.startswith(ds + "/")
                ]
                ax.plot(*zip(*pts, strict=True), marker="o", label=server)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.set_title(ds)
            ax.legend()
        fig.tight_layout()
        path = out / f"{metric}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a model directory both servers can load")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--datasets", default="random,shared-prefix")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--out", required=True, help="folder for results.json, table.md, PNGs")


def main(args: argparse.Namespace) -> int:
    conc = [int(x) for x in args.concurrency.split(",")]
    maker = TextMaker(Tokenizer.load(Path(args.model)))
    n = max(max(conc) * 2, 8)
    datasets: dict[str, list] = {}
    for name in args.datasets.split(","):
        if name == "random":
            datasets[name] = random_dataset(maker, n, args.input_len, args.output_len, 0)
        elif name == "shared-prefix":
            datasets[name] = shared_prefix_dataset(
                maker, n, args.prefix_len, args.num_prefixes, args.input_len, args.output_len, 0
            )
        else:
            raise ValueError(f"unknown dataset {name!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as cache:
        for kind in SERVERS:
            port = free_port()
            proc = start_server(kind, args.model, port, max(conc), cache)
            try:
                url = f"http://127.0.0.1:{port}"
                warm = random_dataset(maker, 4, 16, 8, 99)
                asyncio.run(
                    run(
                        url,
                        "/v1/completions",
                        "m" if kind == "tandem" else None,
                        warm,
                        max_concurrency=4,
                        request_rate=float("inf"),
                        ignore_eos=True,
                        seed=0,
                        progress=False,
                    )
                )
                results[kind] = sweep(
                    kind, url, "m" if kind == "tandem" else None, datasets, conc, args.repeats
                )
            finally:
                proc.terminate()
                proc.wait(60)
    meta = {"model": args.model, "config": {k: v for k, v in vars(args).items() if k != "func"}}
    (out / "results.json").write_text(json.dumps({**meta, "results": results}, indent=2))
    table = markdown(results)
    (out / "table.md").write_text(table)
    plot(results, out)
    print(table)
    return 0
