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


class EngineClient:
    def __init__(self, config_kwargs: dict[str, Any]) -> None:
        self.config_kwargs = config_kwargs
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
        to_core = f"ipc://{self._dir}/in"
        from_core = f"ipc://{self._dir}/out"
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(to_core)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(from_core)
        from tandem.engine.core_process import run_core

        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(
            target=run_core, args=(self.config_kwargs, to_core, from_core), daemon=True
        )
        self._proc.start()
        msg = await self._first_message(timeout)
        if msg[0] != "ready":
            raise RuntimeError(f"engine failed to start: {msg[1]}")
        self.info = msg[1]
        self._tasks = [
            asyncio.create_task(self._read_outputs()),
            asyncio.create_task(self._watch_process()),
        ]

    async def _first_message(self, timeout: float) -> list[Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if await self._pull.poll(200):
                return unpack(await self._pull.recv())
            assert self._proc is not None
            if not self._proc.is_alive():
                raise RuntimeError(f"engine process exited with code {self._proc.exitcode}")
        raise RuntimeError("engine did not become ready in time")

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._proc is not None and self._proc.is_alive()

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        follows: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Token deltas of one request; abandoning the iterator aborts it in the engine."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        stream = _Stream()
        self._streams[request_id] = stream
        finished = False
        try:
            await self._push.send(
                pack(["add", request_id, prompt_ids, params_to_dict(params), follows])
            )
            while True:
                delta = await stream.queue.get()
                if delta.finish_reason is not None:
                    finished = True
                yield delta
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.dead is None:
                with contextlib.suppress(zmq.ZMQError):
                    await self._push.send(pack(["abort", request_id]))

    async def abort(self, request_id: str) -> None:
        await self._push.send(pack(["abort", request_id]))

    async def pause(self) -> None:
        await self._push.send(pack(["pause"]))

    async def resume(self) -> None:
        await self._push.send(pack(["resume"]))

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
                self._die(f"engine failed: {msg[1]}")
                return
            _, outputs, stats = msg
            self.stats = stats
            for rid, new_ids, reason, error, cached, lps, plps, kind in outputs:
                stream = self._streams.get(rid)
                if stream is not None:
                    delta = Delta(new_ids, reason, error, cached, lps, plps, kind)
                    stream.queue.put_nowait(delta)

    async def _watch_process(self) -> None:
        assert self._proc is not None
        while self._proc.is_alive():
            await asyncio.sleep(0.2)
        if self.dead is None:
            self._die(f"engine process exited with code {self._proc.exitcode}")

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        log.error("%s", reason)
        for stream in self._streams.values():
            stream.queue.put_nowait(Delta([], "error", reason))
        if self.on_death is not None:
            self.on_death(reason)

    async def shutdown(self, timeout: float = 10.0) -> None:
        for t in self._tasks:
            t.cancel()
        if self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await self._push.send(pack(["shutdown"]))
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
