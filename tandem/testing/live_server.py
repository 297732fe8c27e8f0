"""Run `tandem serve` as a subprocess for tests and benchmarks (loopback only)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

API_KEY = "test-key"
# KV pool of every Server started without its own (the test suite sets a small one, so a
# dozen servers do not each zero-fill gigabytes).
DEFAULT_KV_BUDGET_TOKENS: int | None = None


def process_tree_rss(pid: int) -> dict[int, int]:
    """Resident bytes of ``pid`` and each of its descendants, by pid (from /proc)."""
    out: dict[int, int] = {}
    stack = [pid]
    while stack:
        p = stack.pop()
        if p in out:
            continue
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[p] = int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
    return out


def parse_metric(text: str, name: str) -> float | None:
    """One unlabelled value of a Prometheus text exposition (None if absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self,
        model: Path,
        *extra: str,
        api_key: str | None = API_KEY,
        debug_invariants: bool = True,
        name: str = "tiny",
        kv_budget_tokens: int | None = None,
    ) -> None:
        cmd = [
            sys.executable,
            "-m",
            "tandem.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            "0",  # the server binds a free port itself and names it (no race with others)
            "--served-model-name",
            name,
            *(["--debug-invariants"] if debug_invariants else []),
            *extra,
        ]
        budget = kv_budget_tokens or DEFAULT_KV_BUDGET_TOKENS
        if budget and "--kv-budget-tokens" not in extra:
            cmd += ["--kv-budget-tokens", str(budget)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.log: list[str] = []
        deadline = time.time() + 120
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(self.log))
            self.log.append(line)
            if "tandem: serving" in line:
                self.port = int(line.rsplit(":", 1)[1])  # (the server binds 127.0.0.1)
                self.url = f"http://127.0.0.1:{self.port}"
                # Keep draining its output so a chatty server never blocks on a full pipe.
                threading.Thread(target=self._drain, daemon=True).start()
                return
        raise RuntimeError("server did not start:\n" + "".join(self.log))

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=30, **kw)

    def metric(self, name: str, default: float | None = None) -> float:
        """One value from /metrics (``name`` with its labels, as exposed); ``default`` for
        one not exposed yet (else KeyError)."""
        value = parse_metric(self.get("/metrics").text, name)
        if value is None:
            if default is None:
                raise KeyError(name)
            return default
        return value

    def named_events(
        self, path: str, body: dict, headers: dict[str, str] | None = None
    ) -> list[tuple[str, dict]]:
        """(event name, data) of a streamed request whose events are named (Anthropic's,
        the Responses API's), in order; each data's ``type`` is checked against its name."""
        out = []
        with httpx.stream(
            "POST", self.url + path, json=body, headers=headers or self.headers(), timeout=60
        ) as r:
            assert r.status_code == 200, r.read()
            name = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    assert data["type"] == name
                    out.append((name, data))
        return out

    def wait_idle(self, timeout: float) -> None:
        """Poll /metrics until no request is running (or ``timeout`` passes); callers assert
        what they expect afterwards."""
        deadline = time.time() + timeout
        while time.time() < deadline and self.metric("tandem_num_requests_running") > 0:
            time.sleep(0.1)

    def post(self, path: str, **kw) -> httpx.Response:
        kw.setdefault("headers", self.headers())
        return httpx.post(self.url + path, timeout=60, **kw)

    def engine_pid(self) -> int:
        """The engine-core child (not multiprocessing's resource tracker)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        for pid in children.split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"multiprocessing.spawn" in cmdline:
                return int(pid)
        raise RuntimeError("no engine process found")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.returncode
