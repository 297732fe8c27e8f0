"""A dead engine process is restarted by `tandem serve` (bounded), not left dead."""

from __future__ import annotations

import os
import signal
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.testing.live_server import Server, parse_metric


def wait_health(
    server: Server, status: str, restarts: int | None = None, timeout: float = 120.0
) -> dict:
    """/health's body once it reads ``status`` (after ``restarts`` restarts where given: a
    process just sent SIGKILL may still be alive, and healthy, for the first reads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = server.get("/health").json()
        if body["status"] == status and restarts in (None, body["engine_restarts"]):
            return body
        time.sleep(0.2)
    raise AssertionError(f"/health never became {status!r} after {restarts} restarts")


def complete(server: Server, prompt: str):
    return server.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0},
    )


def test_killed_engine_is_restarted_and_serves_again(served_model):
    s = Server(served_model)
    try:
        first = complete(s, "hello there")
        assert first.status_code == 200
        assert s.get("/health").json() == {"status": "ok", "engine_restarts": 0}
        old = s.engine_pid()
        os.kill(old, signal.SIGKILL)
        body = wait_health(s, "ok", restarts=1)
        assert body == {"status": "ok", "engine_restarts": 1}
        assert s.engine_pid() != old
        again = complete(s, "hello there")
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert parse_metric(s.get("/metrics").text, "tandem_engine_restarts_total") == 1
    finally:
        s.stop()


def request_counts(server: Server, endpoint: str) -> dict[str, float]:
    """tandem_requests_total of one endpoint, by status."""
    return {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(server.get("/metrics").text)
        if family.name == "tandem_requests"
        for sample in family.samples
        if sample.name == "tandem_requests_total" and sample.labels["endpoint"] == endpoint
    }


def test_a_stream_whose_choices_failed_in_stream_counts_as_an_error_not_ok(served_model):
    s = Server(served_model)
    try:
        body = {"prompt": "x", "max_tokens": 3000, "stream": True, "ignore_eos": True, "n": 2}
        with httpx.stream(
            "POST", s.url + "/v1/completions", headers=s.headers(), json=body, timeout=60
        ) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(s.engine_pid(), signal.SIGKILL)
            rest = [ln for ln in lines if ln]
        assert any(ln.startswith('data: {"error"') for ln in rest) and rest[-1] == "data: [DONE]"
        wait_health(s, "ok", restarts=1)
        assert request_counts(s, "completions") == {"error": 1.0}
        text = s.get("/metrics").text
        assert "# TYPE tandem_engine_restarts_total counter" in text
        assert parse_metric(text, "tandem_engine_restarts_total") == 1
    finally:
        s.stop()
