"""The built-in web pages: a playground at ``/`` and a live dashboard at ``/dashboard``.

Both are static files shipped in the package (``server/static``: plain HTML, CSS and
JavaScript, nothing fetched from elsewhere, nothing built). The pages themselves hold no data,
so they load without the API key; everything they show comes from API routes that need it
(the playground talks to ``/v1/chat/completions`` and ``/v1/models``, the dashboard polls
``/ui/api/stats``), and the pages ask for the key when one is set. ``--no-ui`` installs none
of this."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel, Field

from tandem.server.errors import RequestError
from tandem.server.live_stats import LiveStats

log = logging.getLogger("tandem")
STATIC = Path(__file__).parent / "static"
PAGES = {"/": "playground.html", "/dashboard": "dashboard.html"}
ASSET_PREFIX = "/ui/static/"
SAMPLE_PERIOD_S = 1.0
_MEDIA = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


def is_public(path: str) -> bool:
    """The pages and their assets: static code, served without the API key."""
    return path in PAGES or path.startswith(ASSET_PREFIX)


class StatsPoint(BaseModel):
    t: float = Field(description="Unix time at the end of the second this point covers.")
    output_tps: float = Field(description="Output tokens per second over that second.")
    finished_per_s: float = Field(description="Requests ended per second.")
    running: int = Field(description="Requests owning KV.")
    waiting: int = Field(description="Queued requests.")
    kv_pages: int = Field(description="Pages in the KV pool.")
    kv_pages_used: int = Field(description="Pages live requests hold.")
    kv_pages_cached: int = Field(description="Pages only the prefix cache holds.")
    prefix_hit_rate: float | None = Field(
        description="Share of the prompt tokens looked up in that second the cache served."
    )
    prefix_hit_rate_total: float | None = Field(description="The same since start.")
    ttft_p50_ms: float | None = Field(description="TTFT median over the last 10 s.")
    ttft_p99_ms: float | None = Field(description="TTFT p99 over the last 10 s.")
    itl_p50_ms: float | None = Field(description="Inter-token latency median, last 10 s.")
    itl_p99_ms: float | None = Field(description="Inter-token latency p99, last 10 s.")
    spec_acceptance: float | None = Field(
        None, description="Accepted share of speculated tokens (only when speculation is on)."
    )


class LiveStatsResponse(BaseModel):
    model: str
    max_model_len: int
    interval_s: float = Field(description="Seconds between points.")
    span_s: int = Field(description="Seconds of history the server keeps.")
    points: list[StatsPoint]


def _sampler(live: LiveStats, stats: Callable[[], dict[str, Any]]):
    """A lifespan that samples the engine's stats into ``live`` every second."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def run() -> None:
            while True:
                await asyncio.sleep(SAMPLE_PERIOD_S)
                try:
                    live.sample(stats())
                except Exception:  # a bad sample must not stop the history for good
                    log.exception("dashboard stats sample failed")

        task = asyncio.create_task(run())
        try:
            yield
        finally:
            task.cancel()

    return lifespan


def install_ui(
    app: FastAPI, live: LiveStats, stats: Callable[[], dict[str, Any]], model: str, max_len: int
) -> None:
    # The app has no other startup or shutdown work (this replaces the default lifespan).
    app.router.lifespan_context = _sampler(live, stats)

    def page(name: str) -> Callable[[], Any]:
        async def serve_page() -> HTMLResponse:
            text = (STATIC / name).read_text(encoding="utf-8")
            return HTMLResponse(text, headers={"Cache-Control": "no-cache"})

        return serve_page

    for path, name in PAGES.items():
        app.add_api_route(path, page(name), methods=["GET"], include_in_schema=False)

    assets = {p.name for p in STATIC.iterdir() if p.suffix in _MEDIA}

    @app.get(ASSET_PREFIX + "{name}", include_in_schema=False)
    async def asset(name: str):
        if name not in assets:
            raise RequestError(f"no such file: {name}", status=404)
        path = STATIC / name
        headers = {"Cache-Control": "no-cache"}
        return FileResponse(path, media_type=_MEDIA[path.suffix], headers=headers)

    @app.get("/ui/api/stats", response_model=LiveStatsResponse, tags=["Dashboard"])
    async def live_stats(
        since: float | None = Query(None, description="Only points after this Unix time."),
    ):
        """The dashboard's per-second history (output tok/s, requests, KV pages, prefix-cache
        hit rate, latency percentiles) over the last minutes."""
        return {
            "model": model,
            "max_model_len": max_len,
            "interval_s": SAMPLE_PERIOD_S,
            "span_s": live.points.maxlen,
            "points": live.since(since),
        }
