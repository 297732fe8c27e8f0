"""The HTTP process's handle on the engine-core process (asyncio, ZeroMQ, msgpack)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from tandem.protocol import pack, params_to_dict, unpack
from tandem.sampling_params import SamplingParams

log = logging.getLogger("tandem")


class EngineDeadError(RuntimeError):
    pass


@dataclass
class Delta:
    new_token_ids: list[int]
    finish_reason: str | None
    error: str | None = None
    cached_tokens: int | None = None  # set on a request's first delta
    # Per new token: [log-probability, [[token, log-probability], ...]] when asked for.
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None  # on the first delta, when asked for
    error_kind: str = "request"  # outputs.EngineOutput.error_kind


@dataclass
class _Stream:
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)


MAX_RESTARTS = 3  # engine processes started after the first dies, before giving up
SEND_TIMEOUT = 10.0  # seconds a command may wait for the engine's socket


class EngineClient:
    """Starts the engine core process and, when it dies, restarts it (up to
    ``max_restarts`` times): requests in flight then end with an error, later ones are
    served by the new process."""

    def __init__(self, config_kwargs: dict[str, Any], max_restarts: int = MAX_RESTARTS) -> None:
        self.config_kwargs = config_kwargs
        self.max_restarts = max_restarts
        self.restarts = 0
        self._fatal: str | None = None  # the reason a dying core sent
        self._ready = asyncio.Event()
        self._closing = False
        self._paused = False
        # Requests failed while their engine died: their "add" may still sit in the socket
        # and reach the next engine, which is told to abort them as soon as it is ready.
        self._orphans: set[str] = set()
        self._start_timeout = 600.0
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {"running": 0, "waiting": 0, "kv_usage": 0.0}
        self.dead: str | None = None
        self.on_death: Callable[[str], None] | None = None
        self._streams: dict[str, _Stream] = {}
        self._ctx = zmq.asyncio.Context()
        self._dir = tempfile.mkdtemp(prefix="tandem-ipc-")
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, timeout: float = 600.0) -> None:
        self._start_timeout = timeout
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(self._to_core)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._from_core)
        self._spawn()
        msg = await self._first_message(timeout)
        if msg[0] != "ready":
            raise RuntimeError(f"engine failed to start: {msg[1]}")
        self.info = msg[1]
        self._ready.set()
        self._tasks = [
            asyncio.create_task(self._read_outputs()),
            asyncio.create_task(self._watch_process()),
        ]

    @property
    def _to_core(self) -> str:
        return f"ipc://{self._dir}/in"

    @property
    def _from_core(self) -> str:
        return f"ipc://{self._dir}/out"

    def _spawn(self) -> None:
        from tandem.engine.core_process import run_core

        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(
            target=run_core, args=(self.config_kwargs, self._to_core, self._from_core), daemon=True
        )
        self._proc.start()

    async def _first_message(self, timeout: float) -> list[Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if await self._pull.poll(200):
                return unpack(await self._pull.recv())
            assert self._proc is not None
            if not self._proc.is_alive():
                # Its last words may still be in flight (a load failure's reason is sent
                # just before the process exits).
                if await self._pull.poll(1000):
                    return unpack(await self._pull.recv())
                raise RuntimeError(f"engine process exited with code {self._proc.exitcode}")
        raise RuntimeError("engine did not become ready in time")

    @property
    def healthy(self) -> bool:
        return (
            self.dead is None
            and self._ready.is_set()
            and self._proc is not None
            and self._proc.is_alive()
        )

    @property
    def restarting(self) -> bool:
        return self.dead is None and not self._ready.is_set()

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        follows: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Token deltas of one request; abandoning the iterator aborts it in the engine."""
        if not self._ready.is_set() and self.dead is None:
            await self._ready.wait()  # a restarting engine: wait for the new process
        if self.dead is not None or self._closing:
            raise EngineDeadError(self.dead or "the server is shutting down")
        stream = _Stream()
        self._streams[request_id] = stream
        finished = False
        try:
            await self._send(["add", request_id, prompt_ids, params_to_dict(params), follows])
            while True:
                delta = await stream.queue.get()
                if delta.finish_reason is not None:
                    finished = True
                yield delta
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.dead is None and self._ready.is_set():
                with contextlib.suppress(zmq.ZMQError, EngineDeadError):
                    await self._send(["abort", request_id])

    async def _send(self, msg: list[Any]) -> None:
        """Send a command; a socket with no engine behind it (dead, or restarting and not
        connected yet) must not hang the caller."""
        try:
            await asyncio.wait_for(self._push.send(pack(msg)), SEND_TIMEOUT)
        except TimeoutError:
            raise EngineDeadError("the engine is not accepting commands") from None

    async def abort(self, request_id: str) -> None:
        await self._send(["abort", request_id])

    async def pause(self) -> None:
        self._paused = True
        await self._send(["pause"])

    async def resume(self) -> None:
        self._paused = False
        await self._send(["resume"])

    async def _read_outputs(self) -> None:
        try:
            await self._read_loop()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a reader that dies silently would hang every request
            self._die(f"engine output could not be read: {e!r}")

    async def _read_loop(self) -> None:
        while True:
            msg = unpack(await self._pull.recv())
            if msg[0] == "fatal":
                self._fatal = f"engine failed: {msg[1]}"  # it exits now; the watcher acts
                continue
            if msg[0] == "ready":  # a restarted engine
                self.info = msg[1]
                orphans, self._orphans = self._orphans, set()
                for rid in orphans:
                    await self._send(["abort", rid])
                if self._paused:
                    await self._send(["pause"])
                self._ready.set()
                log.warning("engine restarted (%d of %d)", self.restarts, self.max_restarts)
                continue
            _, outputs, stats = msg
            self.stats = stats
            for rid, new_ids, reason, error, cached, lps, plps, kind in outputs:
                stream = self._streams.get(rid)
                if stream is not None:
                    delta = Delta(new_ids, reason, error, cached, lps, plps, kind)
                    stream.queue.put_nowait(delta)

    async def _watch_process(self) -> None:
        """A dead engine process is restarted (bounded); its requests in flight fail."""
        while True:
            proc = self._proc
            assert proc is not None
            while proc.is_alive():
                await asyncio.sleep(0.2)
            await asyncio.sleep(0.1)  # let the reader take the core's last words
            if self._closing or self.dead is not None:
                return
            reason = self._fatal or f"engine process exited with code {proc.exitcode}"
            self._fatal = None
            self._ready.clear()
            self._fail_streams(reason)
            if self.restarts >= self.max_restarts:
                self._die(f"{reason} (after {self.restarts} restarts)")
                return
            self.restarts += 1
            log.error("%s; restarting it (%d of %d)", reason, self.restarts, self.max_restarts)
            self._spawn()
            asyncio.get_running_loop().call_later(self._start_timeout, self._kill_if_not_ready)

    def _kill_if_not_ready(self) -> None:
        """A restarted engine that never becomes ready counts as another death."""
        if not self._ready.is_set() and self._proc is not None and self._proc.is_alive():
            self._fatal = "engine did not become ready in time"
            self._proc.kill()

    def _fail_streams(self, reason: str) -> None:
        for rid, stream in self._streams.items():
            self._orphans.add(rid)
            stream.queue.put_nowait(Delta([], "error", reason, error_kind="internal"))

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        self._ready.set()  # wake waiters: they see the engine is gone
        log.error("%s", reason)
        self._fail_streams(reason)
        if self.on_death is not None:
            self.on_death(reason)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        self._ready.set()  # wake requests waiting for a restart: they see the engine is gone
        for t in self._tasks:
            t.cancel()
        if self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(zmq.ZMQError, EngineDeadError):
                await self._send(["shutdown"])
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, timeout)
            if self._proc.is_alive():
                self._proc.kill()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        with contextlib.suppress(OSError):
            for name in ("in", "out"):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)
