"""Soak: keep a `tandem serve` busy at a fixed concurrency for a long time and record what
a leak or a wedge would show — resident memory of the server's processes, errors, KV usage,
queue depth and throughput — every ``--sample-s`` seconds.

Each of ``--concurrency`` workers sends requests back to back until ``--duration-s`` has
passed: random prompt and output lengths, completions and chat, streamed and not, a share
that hang up mid-stream (``--disconnect-share``, exercising aborts) and a share that are
invalid on purpose (``--invalid-share``, each must be a 4xx). Any other failure counts as an
error. The result is JSON (every sample), a CSV and a PNG; the RSS slope is fitted over the
samples after the first quarter (warm-up).

    python -m tandem.bench.soak --model DIR --concurrency 256 --duration-s 1800 \
        --out docs/benchmarks/soak-cpu-tiny

``--long-share`` mixes in prompts of ``--long-words`` words (3,000 words are about 4k
tokens), so long prefills keep arriving among the short streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tandem.bench.provenance import _git
from tandem.testing.live_server import Server, parse_metric, process_tree_rss


def tree_rss_mb(pid: int) -> dict[str, float]:
    """RSS (MiB) of a process and each of its descendants, by pid."""
    return {str(p): b / 2**20 for p, b in process_tree_rss(pid).items()}


@dataclass
class Tally:
    ok: int = 0
    disconnected: int = 0
    invalid_rejected: int = 0
    output_tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def _body(rng: random.Random, words: list[str], args) -> tuple[str, dict[str, Any]]:
    n_words = rng.randint(4, args.max_prompt_words)
    if rng.random() < args.long_share:
        n_words = args.long_words
    prompt = " ".join(rng.choice(words) for _ in range(n_words))
    body: dict[str, Any] = {
        "max_tokens": rng.randint(1, args.max_tokens),
        "temperature": rng.choice([0.0, 0.0, 0.7]),
        "seed": rng.randint(0, 1 << 30),
    }
    if rng.random() < 0.5:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    if rng.random() < 0.8:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return path, body


async def _worker(
    client: httpx.AsyncClient, url: str, wid: int, deadline: float, tally: Tally, args
) -> None:
    rng = random.Random(args.seed * 100_003 + wid)
    words = ["alpha", "beta", "gamma", "delta", "soak", "test", "tandem", "token", "the", "of"]
    while time.monotonic() < deadline:
        path, body = _body(rng, words, args)
        roll = rng.random()
        try:
            if roll < args.invalid_share:
                body["max_tokens"] = -rng.randint(1, 5)
                r = await client.post(url + path, json=body)
                if 400 <= r.status_code < 500:
                    tally.invalid_rejected += 1
                else:
                    tally.error(f"invalid request got HTTP {r.status_code}")
            elif body.get("stream"):
                hang_up = roll < args.invalid_share + args.disconnect_share
                async with client.stream("POST", url + path, json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        tally.error(f"HTTP {r.status_code}")
                        continue
                    done = False
                    async for line in r.aiter_lines():
                        if hang_up:
                            break
                        if line.startswith("data:") and '"error"' in line:
                            tally.error("stream error")
                            break
                        if line.startswith("data:") and '"usage"' in line:
                            usage = json.loads(line[5:])["usage"]
                            if usage:
                                tally.output_tokens += usage["completion_tokens"]
                        if line.strip() == "data: [DONE]":
                            done = True
                    if hang_up:
                        tally.disconnected += 1
                    elif done:
                        tally.ok += 1
                    else:
                        tally.error("stream ended without [DONE]")
            else:
                r = await client.post(url + path, json=body)
                if r.status_code == 200:
                    tally.ok += 1
                    tally.output_tokens += r.json()["usage"]["completion_tokens"]
                else:
                    tally.error(f"HTTP {r.status_code}")
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
            kind = "stream" if body.get("stream") else "plain"
            tally.error(f"{type(e).__name__} ({kind} {path}): {e}"[:200])


async def _sampler(
    client: httpx.AsyncClient, server: Server, t0: float, deadline: float, tally: Tally, args
) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    while True:
        rss = tree_rss_mb(server.proc.pid)
        s: dict[str, Any] = {
            "t_s": round(time.monotonic() - t0, 1),
            "rss_mb_total": round(sum(rss.values()), 1),
            "rss_mb_by_pid": {k: round(v, 1) for k, v in rss.items()},
            "ok": tally.ok,
            "disconnected": tally.disconnected,
            "invalid_rejected": tally.invalid_rejected,
            "errors": sum(tally.errors.values()),
            "output_tokens": tally.output_tokens,
        }
        try:
            text = (await client.get(server.url + "/metrics", timeout=30)).text
            for key, name in (
                ("kv_usage", "tandem_kv_cache_usage_ratio"),
                ("running", "tandem_num_requests_running"),
                ("waiting", "tandem_num_requests_waiting"),
                ("retractions", "tandem_num_retractions_total"),
            ):
                s[key] = parse_metric(text, name)
        except httpx.HTTPError as e:
            s["metrics_error"] = type(e).__name__
        samples.append(s)
        print(json.dumps({k: v for k, v in s.items() if k != "rss_mb_by_pid"}), flush=True)
        if time.monotonic() >= deadline:
            return samples
        await asyncio.sleep(min(args.sample_s, max(0.0, deadline - time.monotonic())))


def slope_mb_per_min(samples: list[dict[str, Any]]) -> float:
    """Least-squares slope of total RSS after the first quarter of the run."""
    pts = [(s["t_s"], s["rss_mb_total"]) for s in samples]
    pts = pts[len(pts) // 4 :]
    if len(pts) < 2:
        return 0.0
    n = len(pts)
    mx = sum(t for t, _ in pts) / n
    my = sum(r for _, r in pts) / n
    den = sum((t - mx) ** 2 for t, _ in pts)
    return 60 * sum((t - mx) * (r - my) for t, r in pts) / den if den else 0.0


async def soak(args) -> dict[str, Any]:
    commit = (
        _git("rev-parse", "--short", "HEAD") or "unknown"
    )  # what the server runs (the tree may move on during a long soak)
    server = Server(Path(args.model), *args.serve_args, api_key=None, debug_invariants=False)
    tally = Tally()
    try:
        limits = httpx.Limits(max_connections=args.concurrency + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
            t0 = time.monotonic()
            deadline = t0 + args.duration_s
            workers = [
                asyncio.create_task(_worker(client, server.url, i, deadline, tally, args))
                for i in range(args.concurrency)
            ]
            samples = await _sampler(client, server, t0, deadline, tally, args)
            await asyncio.gather(*workers)
            # Drained: nothing may stay running or queued once every client is done.
            await asyncio.sleep(2)
            final = await _sampler(client, server, t0, 0, tally, args)
            healthy = (await client.get(server.url + "/health")).status_code == 200
    finally:
        rc = server.stop()
    return {
        "command": " ".join(sys.argv),
        "commit": commit,
        "concurrency": args.concurrency,
        "duration_s": args.duration_s,
        "serve_args": args.serve_args,
        "ok": tally.ok,
        "disconnected": tally.disconnected,
        "invalid_rejected": tally.invalid_rejected,
        "errors": tally.errors,
        "output_tokens": tally.output_tokens,
        "rss_mb_first": samples[0]["rss_mb_total"],
        "rss_mb_after_warmup": samples[len(samples) // 4]["rss_mb_total"],
        "rss_mb_last": samples[-1]["rss_mb_total"],
        "rss_mb_max": max(s["rss_mb_total"] for s in samples),
        "rss_slope_mb_per_min_after_warmup": round(slope_mb_per_min(samples), 3),
        "after_drain": {k: final[0].get(k) for k in ("running", "waiting", "kv_usage")},
        "healthy_after": healthy,
        "server_exit_code": rc,
        "samples": samples,
    }


def _write(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    cols = ["t_s", "rss_mb_total", "ok", "errors", "kv_usage", "running", "waiting"]
    lines = [",".join(cols)] + [
        ",".join(str(s.get(c, "")) for c in cols) for s in result["samples"]
    ]
    (out / "soak.csv").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    t = [s["t_s"] / 60 for s in result["samples"]]
    fig, ax = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    ax[0].plot(t, [s["rss_mb_total"] for s in result["samples"]])
    ax[0].set_ylabel("RSS MiB (all)")
    ax[1].plot(t, [s.get("kv_usage") or 0 for s in result["samples"]])
    ax[1].set_ylabel("KV usage")
    ax[2].plot(t, [s["ok"] for s in result["samples"]], label="ok")
    ax[2].plot(t, [s["errors"] for s in result["samples"]], label="errors")
    ax[2].set_ylabel("requests")
    ax[2].legend()
    ax[2].set_xlabel("minutes")
    fig.suptitle(f"soak c{result['concurrency']} ({result['commit']})")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--duration-s", type=float, default=1800)
    p.add_argument("--sample-s", type=float, default=15)
    p.add_argument("--max-prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--long-share",
        type=float,
        default=0.0,
        help="share of requests whose prompt is --long-words words (long prefills mixed in)",
    )
    p.add_argument("--long-words", type=int, default=3000, help="about 4k tokens by default")
    p.add_argument("--disconnect-share", type=float, default=0.05)
    p.add_argument("--invalid-share", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument("serve_args", nargs="*", help="extra `tandem serve` arguments (after --)")
    args = p.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    result = asyncio.run(soak(args))
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    if args.out:
        _write(result, args.out)
    bad = result["errors"] or not result["healthy_after"] or result["after_drain"]["running"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
