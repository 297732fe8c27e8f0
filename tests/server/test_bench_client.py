"""The serving benchmark client against a scripted fake server with known timings."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tandem.bench.datasets import (
    RequestSpec,
    TextMaker,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
)
from tandem.bench.serve_client import run
from tandem.bench.serve_metrics import compute
from tandem.frontend.tokenizer import Tokenizer
from tandem.testing.live_server import free_port

TTFT, GAP, TOKENS_PER_CHUNK, CHUNKS = 0.05, 0.02, 2, 4


async def completions(request: Request):
    body = await request.json()
    if body["prompt"].startswith("FAIL"):
        return JSONResponse({"error": {"message": "boom"}}, status_code=500)
    short = body["prompt"].startswith("SHORT")

    async def events():
        await asyncio.sleep(TTFT)
        for i in range(CHUNKS):
            if i:
                await asyncio.sleep(GAP)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'ab'}]})}\n\n"
        n = TOKENS_PER_CHUNK * CHUNKS - (3 if short else 0)
        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake_server():
    port = free_port()
    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def spec(prompt: str) -> RequestSpec:
    return RequestSpec(prompt, TOKENS_PER_CHUNK * CHUNKS, 7)


def test_known_timings_give_known_metrics(fake_server):
    specs = [spec(f"p{i}") for i in range(6)]
    records, duration = asyncio.run(
        run(
            fake_server,
            "/v1/completions",
            None,
            specs,
            max_concurrency=3,
            request_rate=float("inf"),
            ignore_eos=True,
            seed=0,
            progress=False,
        )
    )
    r = compute(records, duration)
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["total_output_tokens"] == 6 * 8  # from usage, not from the 4 chunks
    assert r["ttft_s"]["median"] == pytest.approx(TTFT, abs=0.03)
    assert r["itl_s"]["median"] == pytest.approx(GAP, abs=0.015)
    # TPOT = (latency - ttft) / (tokens - 1) = 3 gaps / 7 tokens.
    assert r["tpot_s"]["median"] == pytest.approx(3 * GAP / 7, abs=0.01)
    # Two waves of three requests (max_concurrency 3).
    assert duration == pytest.approx(2 * (TTFT + 3 * GAP), abs=0.1)


def test_failures_and_short_outputs_are_counted_not_averaged(fake_server):
    specs = [spec("ok"), spec("FAIL"), spec("SHORT"), spec("FAIL")]
    records, duration = asyncio.run(
        run(
            fake_server,
            "/v1/completions",
            None,
            specs,
            max_concurrency=None,
            request_rate=float("inf"),
            ignore_eos=True,
            seed=0,
            progress=False,
        )
    )
    r = compute(records, duration)
    assert (r["completed"], r["failed"], r["errors"]) == (2, 2, {"HTTP 500": 2})
    assert r["outputs_with_unexpected_length"] == 1


def test_poisson_arrivals_spread_requests(fake_server):
    specs = [spec(f"p{i}") for i in range(8)]
    t = time.perf_counter()
    asyncio.run(
        run(
            fake_server,
            "/v1/completions",
            None,
            specs,
            max_concurrency=None,
            request_rate=20.0,
            ignore_eos=False,
            seed=1,
            progress=False,
        )
    )
    expected = sum(random.Random(1).expovariate(20.0) for _ in range(8))
    assert time.perf_counter() - t >= expected


def test_dataset_generators_have_exact_lengths_and_shared_prefixes(tiny_model_dir):
    maker = TextMaker(Tokenizer.load(tiny_model_dir("llama")))
    for s in random_dataset(maker, 10, 40, 5, seed=0):
        assert s.prompt_len == 40 and maker.length(s.prompt) == 40
    specs = shared_prefix_dataset(
        maker, 12, prefix_len=60, num_prefixes=3, suffix_len=10, output_len=5, seed=0
    )
    assert sorted({s.group for s in specs}) == [0, 1, 2]
    for g in range(3):
        members = [s.prompt for s in specs if s.group == g]
        assert len(members) == 4
        common = members[0]
        for m in members[1:]:
            while not m.startswith(common):
                common = common[:-1]
        assert maker.length(common) >= 58  # the prefix (token boundaries may shift by one)
    conv = multi_turn_dataset(maker, 3, turns=4, input_len=20, output_len=5, seed=0)
    assert [len(c.turns) for c in conv] == [3, 3, 3]


def test_bench_serve_tokenizer_and_seed_choices(tiny_model_dir, capsys):
    """A bare name is a clear error (no traceback); --model as a path names the tokenizer;
    without --seed each run draws fresh prompts (and prints the seed to repeat it)."""
    import argparse

    from tandem.bench import serve_client
    from tandem.cli import build_parser, main
    from tandem.model_source import DEFAULT_MODEL_NAME

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: /v1/models is not reachable
    assert main(["bench", "serve", "--base-url", url, "--tokenizer", "SmolLM2-135M"]) == 2
    err = capsys.readouterr().err
    assert "--tokenizer" in err and "'default'" in err and "Traceback" not in err
    assert main(["bench", "serve", "--base-url", url, "--model", "someone/else"]) == 2
    assert "pass --tokenizer" in capsys.readouterr().err

    path = tiny_model_dir("llama")

    def args(*extra: str) -> argparse.Namespace:
        return build_parser().parse_args(["bench", "serve", "--base-url", url, *extra])

    assert serve_client.tokenizer_source(args("--model", str(path))) == path
    assert serve_client.tokenizer_source(args("--tokenizer", "default")) is None
    assert serve_client.tokenizer_source(args("--model", DEFAULT_MODEL_NAME)) is None
    common = ("--tokenizer", str(path), "--num-prompts", "4", "--input-len", "8")
    first, second = args(*common), args(*common)
    prompts = [[s.prompt for s in serve_client.build_dataset(a)] for a in (first, second)]
    assert first.seed != second.seed and prompts[0] != prompts[1]
    assert f"--seed {first.seed}" in capsys.readouterr().out
    again = args(*common, "--seed", str(first.seed))
    assert [s.prompt for s in serve_client.build_dataset(again)] == prompts[0]


@pytest.fixture
def models_server():
    """A server whose GET /v1/models answers with ``listing`` (set by the test)."""
    listing: list[dict] = []

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": listing})

    port = free_port()
    app = Starlette(routes=[Route("/v1/models", models)])
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", listing
    server.should_exit = True
    thread.join(5)


def test_bench_serve_takes_the_tokenizer_from_the_servers_model_list(
    tiny_model_dir, models_server, capsys
):
    """Without --tokenizer (and no --model path): the listed model's id or root when it is a
    local path, the default model by name, else a clear error; also when nothing answers."""
    from tandem.bench import serve_client
    from tandem.cli import build_parser, main
    from tandem.model_source import DEFAULT_MODEL_NAME

    url, listing = models_server
    path = tiny_model_dir("llama")

    def source(*extra: str):
        args = build_parser().parse_args(["bench", "serve", "--base-url", url, *extra])
        return serve_client.tokenizer_source(args)

    listing[:] = [{"id": str(path)}]
    assert source() == path
    listing[:] = [{"id": "other", "root": "/no/such/dir"}, {"id": "tiny", "root": str(path)}]
    assert source("--model", "tiny") == path
    listing[:] = [{"id": DEFAULT_MODEL_NAME}]
    assert source() is None
    listing[:] = [{"id": "tiny"}]
    with pytest.raises(serve_client.ClientError, match="serves 'tiny': pass --tokenizer"):
        source()
    with pytest.raises(serve_client.ClientError, match="does not list 'other'"):
        source("--model", "other")
    listing[:] = []
    with pytest.raises(serve_client.ClientError, match="lists no model"):
        source()
    nobody = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "serve", "--base-url", nobody, "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert f"could not read the served model from {nobody}/v1/models" in err
    assert "pass --tokenizer" in err and "Traceback" not in err
