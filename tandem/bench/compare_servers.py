"""The servers `tandem bench compare` (and `itl_under_prefill`) drive: command lines,
launching in their own process group (killed with the benchmark), readiness, shutdown."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tandem.runner.blas import CANDIDATES as BLAS_CANDIDATES
from tandem.testing.live_server import free_port

LOG_TAIL_LINES = 40


class ServerError(RuntimeError):
    """A server that failed to start, died, or stopped answering; carries its log tail."""

    def __init__(self, server: Server, what: str) -> None:
        super().__init__(f"{server.kind} server {what}")
        self.server = server


@dataclass
class Server:
    kind: str
    cmd: list[str]
    port: int
    proc: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_name(self) -> str | None:
        return "m" if self.kind == "tandem" else None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise ServerError(self, f"exited with {self.proc.returncode}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the whole process group: also any child the server left behind
        (Tandem's engine process)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def stop_all(servers: list[Server], grace: float = 20.0) -> None:
    """SIGTERM to every server at once (they drain and exit), SIGKILL after ``grace``."""
    for s in servers:
        s.terminate()
    deadline = time.time() + grace
    for s in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(max(0.1, deadline - time.time()))
        s.kill()


def server_command(
    kind: str, model: str, port: int, max_concurrency: int, extra: list[str], backlog: int = 0
) -> list[str]:
    """The server's command line. ``backlog`` > 0 raises mlx_lm.server's listen backlog (that
    of Python's socketserver: 5), past which simultaneous connections wait ~1 s for a SYN
    retransmit or get reset; uvicorn's (Tandem's) is 2048."""
    slots = str(max(max_concurrency, 8))
    if kind == "tandem":
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", model]
        cmd += ["--port", str(port), "--served-model-name", "m", "--max-num-seqs", slots]
    elif backlog > 0:
        boot = (
            f"import socketserver; socketserver.TCPServer.request_queue_size = {backlog}; "
            "from mlx_lm.cli import main; main()"
        )
        cmd = [sys.executable, "-c", boot, "server", "--model", model, "--port", str(port)]
    else:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port)]
    if kind == "mlx_lm":
        cmd += ["--decode-concurrency", slots, "--log-level", "WARNING"]
    return cmd + extra


def _die_with_parent() -> None:
    """In the child before exec (Linux): get SIGTERM if the benchmark process dies, so a
    killed benchmark leaves no server behind."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def peer_env(kind: str, env: dict[str, str]) -> dict[str, str]:
    """mlx_lm.server gets the optimized BLAS Tandem preloads for itself (Linux CPU backend),
    so a CPU comparison measures serving, not BLAS builds."""
    if kind != "mlx_lm" or not sys.platform.startswith("linux") or "LD_PRELOAD" in env:
        return env
    for path in BLAS_CANDIDATES:
        if os.path.exists(path):
            return {**env, "LD_PRELOAD": path}
    return env


def launch(kind: str, cmd: list[str], port: int, log: Path, env: dict[str, str]) -> Server:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = peer_env(kind, env)
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C reaches only us; we stop the servers
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
    return Server(kind, cmd, port, proc, log)


def wait_ready(servers: list[Server], timeout: float) -> None:
    """Until every server answers /v1/models with 200 (they load at the same time)."""
    pending = list(servers)
    deadline = time.time() + timeout
    while pending:
        for s in list(pending):
            s.check_alive()
            try:
                if httpx.get(f"{s.url}/v1/models", timeout=2).status_code == 200:
                    pending.remove(s)
                    print(f"compare: {s.kind} is up on port {s.port}", file=sys.stderr)
            except httpx.HTTPError:
                pass
        if pending and time.time() > deadline:
            raise ServerError(pending[0], f"did not come up within {timeout:.0f} s")
        if pending:
            time.sleep(0.5)


def free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports
