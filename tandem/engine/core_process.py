"""The engine core as its own process: owns MLX, never waits on HTTP.

It reads commands from a ZeroMQ PULL socket between steps (without blocking while there is
work) and pushes each step's token outputs, with scheduler stats, on a PUSH socket.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

from tandem.protocol import pack, params_from_dict, unpack


def run_core(config_kwargs: dict[str, Any], in_addr: str, out_addr: str) -> None:
    """Process entry point (spawned)."""
    import zmq

    # The HTTP process owns shutdown; a terminal's Ctrl-C must not kill the core mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never block the engine on a slow HTTP process
    outbox.connect(out_addr)
    try:
        from tandem.build import build_engine
        from tandem.config import EngineConfig

        built = build_engine(EngineConfig(**config_kwargs))
    except Exception as e:  # report the load failure, then exit non-zero
        _die(ctx, inbox, outbox, f"{type(e).__name__}: {e}")
    engine = built.engine
    outbox.send(
        pack(
            [
                "ready",
                {
                    "max_model_len": built.max_model_len,
                    "model_type": built.model_type,
                    "pid": os.getpid(),
                    "vocab_size": engine.vocab_size,
                    "kv_pages": engine.scheduler.kv.num_pages,
                },
            ]
        )
    )
    paused = False
    idle = True
    parent = os.getppid()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        busy = engine.has_unfinished() and not paused
        events = dict(poller.poll(0 if busy else 50))
        if not busy and os.getppid() != parent:
            os._exit(0)  # the HTTP process is gone; nobody will read our outputs
        outputs: list[list[Any]] = []
        while inbox in events:
            msg = unpack(inbox.recv())
            kind = msg[0]
            if kind == "add":
                _, rid, prompt, params, follows = msg
                try:
                    engine.add_request(prompt, params_from_dict(params), rid, follows=follows)
                except ValueError as e:
                    outputs.append([rid, [], "error", str(e), None, None, None, "request"])
            elif kind == "abort":
                engine.abort(msg[1])
            elif kind == "pause":
                paused = True
                outputs += _encode(engine.loop.drain())
            elif kind == "resume":
                paused = False
            elif kind == "shutdown":
                outputs += _encode(engine.loop.drain())
                outbox.send(pack(["outputs", outputs, _stats(engine)]))
                outbox.close(linger=2000)
                return
            events = dict(poller.poll(0))
        if engine.has_unfinished() and not paused:
            try:
                outputs += _encode(engine.step())
            except Exception as e:
                sys.stderr.write(traceback.format_exc())  # the whole story goes to the log
                sys.stderr.flush()
                _die(ctx, inbox, outbox, f"engine step failed: {type(e).__name__}: {e}")
        idle_now = not engine.has_unfinished()
        if outputs or (idle_now and not idle):
            # Also once on going idle: the last release may come a step after the last output.
            outbox.send(pack(["outputs", outputs, _stats(engine)]))
        idle = idle_now


def _die(ctx, inbox, outbox, message: str) -> None:
    """Send the HTTP process the reason, then exit non-zero. The context is terminated first:
    it waits (up to the linger) until the message is out, which ``os._exit`` alone drops."""
    outbox.send(pack(["fatal", message]))
    inbox.close(linger=0)
    outbox.close(linger=2000)
    ctx.term()
    os._exit(1)


def _encode(outs) -> list[list[Any]]:
    return [
        [
            o.request_id,
            list(o.new_token_ids),
            o.finish_reason,
            o.error,
            o.cached_tokens,
            o.logprobs,
            o.prompt_logprobs,
            o.error_kind,
        ]
        for o in outs
    ]


def _stats(engine) -> dict[str, Any]:
    sched = engine.scheduler
    return {
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "kv_usage": sched.kv_usage(),
        "prefix_cache_queried_tokens": sched.stats.queried_tokens,
        "prefix_cache_hit_tokens": sched.stats.hit_tokens,
        "retractions": sched.stats.retractions,
        "step_failures": sched.stats.step_failures,
        "oom_recoveries": sched.stats.oom_recoveries,
        "kv_pages": sched.kv.num_pages,
        "kv_cached_pages": sched.kv.num_cached,
        "kv_held_pages": sched.kv.num_held,
        "kv_window_pages": sched.kv.walloc.num_pages if sched.kv.walloc is not None else 0,
        "kv_window_held_pages": sched.kv.window_held,
        "engine_steps": engine.steps,
        "engine_step_seconds": engine.step_seconds,
        "engine_cpu_seconds": time.process_time(),
        **(
            {
                "spec_proposed_tokens": sched.stats.spec_proposed,
                "spec_accepted_tokens": sched.stats.spec_accepted,
                "spec_verify_steps": sched.stats.spec_verifies,
                "spec_backoffs": sched.gain.backoffs,
                "spec_resumes": sched.gain.resumes,
            }
            if sched.config.speculation.enabled
            else {}
        ),
    }
