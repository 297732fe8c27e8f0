"""What serving over HTTP costs beside the offline engine, same model, same prompts.

    python -m tandem.bench.http_overhead [--model PATH | --shape tiny] \
        --concurrency 1,16,64,256 [--json out.json]

Per concurrency, all requests sent at once, ``--output-len`` tokens each (ignore_eos):

* TPOT per request = (last token time - first token time) / (tokens - 1), median over
  requests, offline (``Engine.step`` in this process) and through ``tandem serve`` (streamed
  with the official SSE path, tokens counted from ``token_ids``);
* the engine's mean step time, offline and in the server's engine process (its
  ``tandem_engine_step_seconds_total`` over ``tandem_engine_steps_total``): the tokenizer,
  the detokenizer and HTTP run in another process, so these should agree;
* CPU time per output token of the HTTP process (``tandem_http_cpu_seconds_total``), of
  the engine process (``tandem_engine_cpu_seconds_total``) and of this process's load
  client.

Client, server and engine share the machine's cores: on a small machine the client's own CPU
competes with both, so repeat and compare medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

COUNTERS = (
    "tandem_engine_steps_total",
    "tandem_engine_step_seconds_total",
    "tandem_engine_cpu_seconds_total",
    "tandem_http_cpu_seconds_total",
    "tandem_generation_tokens_total",
)


@dataclass
class Row:
    concurrency: int
    output_len: int
    offline_tpot_ms: float
    server_tpot_ms: float
    offline_step_ms: float
    server_step_ms: float
    offline_steps: int
    server_steps: int
    http_cpu_ms_per_token: float
    engine_cpu_ms_per_token: float
    client_cpu_ms_per_token: float
    server_tokens: int

    @property
    def step_ratio(self) -> float:
        return self.server_step_ms / self.offline_step_ms

    def line(self) -> str:
        tpot = 100 * (self.server_tpot_ms / self.offline_tpot_ms - 1)
        return (
            f"concurrency {self.concurrency:>3}: TPOT offline {self.offline_tpot_ms:.2f} ms, "
            f"server {self.server_tpot_ms:.2f} ms ({tpot:+.1f}%); step offline "
            f"{self.offline_step_ms:.2f} ms x {self.offline_steps}, server "
            f"{self.server_step_ms:.2f} ms x {self.server_steps} "
            f"({100 * (self.step_ratio - 1):+.1f}%); CPU per token: HTTP "
            f"{self.http_cpu_ms_per_token:.3f} ms, engine {self.engine_cpu_ms_per_token:.3f} ms, "
            f"this client {self.client_cpu_ms_per_token:.3f} ms"
        )


def offline_run(
    model: str, prompts: list[list[int]], n: int, kv_budget_tokens: int | None
) -> tuple[float, float, int]:
    """Median TPOT (s), mean step time (s) and steps of the offline engine on ``prompts``
    (its KV pool as large as the server's: both live on one device at once)."""
    from tandem import LLM, SamplingParams

    with LLM(model, kv_budget_tokens=kv_budget_tokens) as llm:
        engine = llm.engine
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        steps0, seconds0 = engine.steps, engine.step_seconds
        for p in prompts:
            engine.add_request(p, sp)
        while engine.has_unfinished():
            for out in engine.step():
                now = time.perf_counter()
                if out.new_token_ids:
                    first.setdefault(out.request_id, now)
                    last[out.request_id] = now
        steps = engine.steps - steps0
        tpot = statistics.median((last[r] - first[r]) / max(1, n - 1) for r in first)
        return tpot, (engine.step_seconds - seconds0) / steps, steps


def scrape(url: str) -> dict[str, float]:
    """The counters above from the server's /metrics, once its engine is idle (the engine
    sends its totals with its outputs and once more on going idle)."""
    import httpx

    from tandem.testing.live_server import parse_metric

    deadline = time.time() + 30
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        if parse_metric(text, "tandem_num_requests_running") == 0:
            break
        if time.time() > deadline:
            raise RuntimeError("the server's engine did not go idle within 30 s")
        time.sleep(0.05)
    return {name: parse_metric(text, name) or 0.0 for name in COUNTERS}


async def server_tpot(url: str, prompts: list[list[int]], n: int) -> float:
    import httpx

    async def one(ac: httpx.AsyncClient, p: list[int], k_want: int) -> float:
        body = {
            "prompt": p,
            "max_tokens": k_want,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        times: list[float] = []
        async with ac.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    k = len(json.loads(line[6:])["choices"][0].get("token_ids", []))
                    times += [time.perf_counter()] * k
        assert len(times) == k_want, len(times)
        return (times[-1] - times[0]) / max(1, k_want - 1)

    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as ac:
        return statistics.median(await asyncio.gather(*(one(ac, p, n) for p in prompts)))


def server_run(url: str, prompts: list[list[int]], n: int) -> tuple[float, dict[str, float]]:
    """Median TPOT (s) through the server, its counters' growth over the run, and this
    process's CPU seconds over it (the load client, on the same cores)."""
    asyncio.run(server_tpot(url, prompts[:1], 4))  # warm-up
    before = scrape(url)
    cpu = time.process_time()
    tpot = asyncio.run(server_tpot(url, prompts, n))
    cpu = time.process_time() - cpu
    after = scrape(url)
    return tpot, {**{k: after[k] - before[k] for k in COUNTERS}, "client_cpu": cpu}


def measure(model: str, url: str, concurrency: int, n: int, kv_budget_tokens: int | None) -> Row:
    # The server's prefix cache lives across levels, the offline engine is new for each:
    # every level's prompts start with their own token, so neither side hits.
    salt = 300 + len(str(concurrency)) * 50 + concurrency % 50
    prompts = [
        [salt, *(10 + (i * 13 + j) % 290 for j in range(15 + i % 48))] for i in range(concurrency)
    ]
    off_tpot, off_step, off_steps = offline_run(model, prompts, n, kv_budget_tokens)
    srv_tpot, d = server_run(url, prompts, n)
    steps = int(d["tandem_engine_steps_total"])
    tokens = int(d["tandem_generation_tokens_total"])
    if not steps or tokens != concurrency * n:
        raise RuntimeError(f"the server counted {steps} steps and {tokens} tokens")
    return Row(
        concurrency=concurrency,
        output_len=n,
        offline_tpot_ms=1e3 * off_tpot,
        server_tpot_ms=1e3 * srv_tpot,
        offline_step_ms=1e3 * off_step,
        server_step_ms=1e3 * d["tandem_engine_step_seconds_total"] / steps,
        offline_steps=off_steps,
        server_steps=steps,
        http_cpu_ms_per_token=1e3 * d["tandem_http_cpu_seconds_total"] / tokens,
        engine_cpu_ms_per_token=1e3 * d["tandem_engine_cpu_seconds_total"] / tokens,
        client_cpu_ms_per_token=1e3 * d["client_cpu"] / tokens,
        server_tokens=tokens,
    )


def main() -> None:
    import tandem.runner  # noqa: F401
    from tandem.bench.shapes import make_model
    from tandem.testing.live_server import Server

    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument(
        "--kv-budget-tokens",
        type=int,
        help="KV pool of the server and of the offline engine alike (default: their own on "
        "the CPU, which caps it; 131072 tokens on a GPU, where both processes share the "
        "device and each default pool is half its free memory)",
    )
    a = ap.parse_args()
    import mlx.core as mx

    if a.kv_budget_tokens is None and mx.default_device() != mx.cpu:
        a.kv_budget_tokens = 1 << 17
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or str(make_model(a.shape, "float32", Path(tmp)))
        server = Server(
            Path(model), api_key=None, debug_invariants=False, kv_budget_tokens=a.kv_budget_tokens
        )
        try:
            for c in [int(x) for x in a.concurrency.split(",")]:
                rows.append(measure(model, server.url, c, a.output_len, a.kv_budget_tokens))
                print(rows[-1].line(), flush=True)
        finally:
            server.stop()
    if a.json:
        from tandem.bench.provenance import command_line, environment

        out = {"command": command_line(), "environment": environment()}
        a.json.write_text(json.dumps({**out, "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
