"""A dead engine process is restarted by `tandem serve` (bounded), not left dead."""

from __future__ import annotations

import os
import signal
import time

from tandem.testing.live_server import Server, parse_metric


def wait_health(server: Server, status: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = server.get("/health").json()
        if body["status"] == status:
            return body
        time.sleep(0.2)
    raise AssertionError(f"/health never became {status!r}")


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
        body = wait_health(s, "ok")
        assert body["engine_restarts"] == 1
        assert s.engine_pid() != old
        again = complete(s, "hello there")
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert parse_metric(s.get("/metrics").text, "tandem_engine_restarts") == 1
    finally:
        s.stop()
