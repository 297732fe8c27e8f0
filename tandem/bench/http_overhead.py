"""TPOT through `tandem serve` vs the offline engine, same model, same prompts.

    python -m tandem.bench.http_overhead [--model PATH | --shape tiny] --concurrency 1,16

TPOT per request = (last token time - first token time) / (tokens - 1), median over requests;
the server side streams with the official SSE path and counts tokens from ``token_ids``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path


def offline_tpot(model: str, prompts: list[list[int]], n: int) -> float:
    from tandem import LLM, SamplingParams

    llm = LLM(model)
    engine = llm.engine
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for p in prompts:
        engine.add_request(p, sp)
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
    return statistics.median((last[r] - first[r]) / (n - 1) for r in first)


async def server_tpot(url: str, prompts: list[list[int]], n: int) -> float:
    import httpx

    async def one(ac: httpx.AsyncClient, p: list[int]) -> float:
        body = {
            "prompt": p,
            "max_tokens": n,
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
        assert len(times) == n, len(times)
        return (times[-1] - times[0]) / (n - 1)

    async with httpx.AsyncClient(timeout=600) as ac:
        await one(ac, prompts[0][:4])  # warm-up
        return statistics.median(await asyncio.gather(*(one(ac, p) for p in prompts)))


def main() -> None:
    import tandem.runner  # noqa: F401
    from tandem.bench.offline import make_model
    from tandem.testing.live_server import Server

    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--output-len", type=int, default=64)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or str(make_model(a.shape, "float32", Path(tmp)))
        server = Server(Path(model), api_key=None, debug_invariants=False)
        try:
            for c in [int(x) for x in a.concurrency.split(",")]:
                prompts = [[10 + (i * 13 + j) % 300 for j in range(16 + i)] for i in range(c)]
                off = offline_tpot(model, prompts, a.output_len)
                srv = asyncio.run(server_tpot(server.url, prompts, a.output_len))
                print(
                    f"concurrency {c:>3}: TPOT offline {off * 1e3:.2f} ms, server "
                    f"{srv * 1e3:.2f} ms, overhead {100 * (srv / off - 1):+.1f}%",
                    flush=True,
                )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
