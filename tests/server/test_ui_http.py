"""The web pages over plain HTTP: what is public (the static pages and assets), what needs
the key (the stats they show), and --no-ui. The pages' behaviour is tested in a browser
(tests/browser)."""

from __future__ import annotations

import time

import httpx
import pytest

from tandem.testing.live_server import Server


def test_pages_are_public_and_their_data_needs_the_key(server):
    for path, kind in [
        ("/", "text/html"),
        ("/dashboard", "text/html"),
        ("/ui/static/playground.js", "text/javascript"),
        ("/ui/static/style.css", "text/css"),
    ]:
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
    # Every script the pages load is served.
    for page in ("/", "/dashboard"):
        html = httpx.get(server.url + page).text
        for src in [s.split('"')[0] for s in html.split('src="')[1:]]:
            assert httpx.get(server.url + src).status_code == 200, src
    assert server.get("/ui/static/../app.py").status_code == 404  # /ui/app.py: not a page
    r = httpx.get(server.url + "/ui/static/..%2fapp.py")
    assert r.status_code == 404
    r = httpx.get(server.url + "/ui/static/secret.py")
    assert r.status_code == 404 and "no such file" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/ui/api/stats")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_stats_history_follows_a_request(server):
    body = server.get("/ui/api/stats").json()
    assert body["model"] == "tiny" and body["interval_s"] == 1.0 and body["span_s"] >= 60
    r = server.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "hello " * 20, "max_tokens": 40, "ignore_eos": True},
    )
    assert r.status_code == 200
    time.sleep(2.2)  # two samples after it
    points = server.get("/ui/api/stats").json()["points"]
    assert points and all(a["t"] < b["t"] for a, b in zip(points, points[1:], strict=False))
    assert sum(p["output_tps"] for p in points) > 0, points
    assert max(p["ttft_p50_ms"] or 0 for p in points) > 0
    assert points[-1]["kv_pages"] > 0 and points[-1]["running"] == 0
    assert points[-1]["spec_acceptance"] is None
    since = points[-2]["t"]
    newer = server.get("/ui/api/stats", params={"since": since}).json()["points"]
    assert newer and all(p["t"] > since for p in newer)
    r = server.get("/ui/api/stats", params={"since": "yesterday"})
    assert r.status_code == 400 and r.json()["error"]["param"].endswith("since")


@pytest.fixture(scope="module")
def no_ui_server(served_model):
    s = Server(served_model, "--no-ui")
    yield s
    s.stop()


def test_no_ui_serves_no_pages(no_ui_server):
    for path in ("/", "/dashboard", "/ui/static/common.js", "/ui/api/stats"):
        r = no_ui_server.get(path)
        assert r.status_code == 404 and r.json()["error"], path
    # Nothing else is public then: the key guards every path but /health.
    assert httpx.get(no_ui_server.url + "/ui/static/common.js").status_code == 401
    assert no_ui_server.get("/v1/models").status_code == 200
