"""The in-process engine: request intake, the overlap loop, outputs. Owns no model code."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable

from tandem.engine.drafting import Proposer
from tandem.engine.grammar import GrammarCompiler
from tandem.engine.loop import OverlapLoop, Runner
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler, SchedulerConfig
from tandem.outputs import EngineOutput
from tandem.sampling_params import SamplingParams, check_vocab, stop_token_set

log = logging.getLogger("tandem")


class Engine:
    """Drive from one thread: ``add_request`` / ``abort`` / ``step`` until ``has_unfinished``
    is False. MLX is only touched inside ``step`` (through the runner)."""

    def __init__(
        self,
        runner: Runner,
        scheduler_config: SchedulerConfig,
        *,
        eos_token_ids: Iterable[int] = (),
        overlap: bool = True,
        host_thread: bool | None = False,
        check_invariants: bool = False,
        seed: int | None = None,
        vocab_size: int | None = None,
        grammar: Callable[[], GrammarCompiler] | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """``grammar``: builds the compiler for guided requests (None, or if it fails: guided
        requests are rejected with the reason). ``proposer``: the draft model of draft-model
        speculation (engine/drafting.py)."""
        self.scheduler = Scheduler(scheduler_config)
        if scheduler_config.speculation.draft:
            if proposer is None:
                raise ValueError("draft-model speculation needs the draft model (proposer)")
            self.scheduler.proposer = proposer
        self.loop = OverlapLoop(
            self.scheduler,
            runner,
            overlap=overlap,
            check_invariants=check_invariants,
            host_thread=host_thread,
        )
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self._ids = itertools.count()
        self.closed = False
        # Steps run and the wall time spent inside them (metrics: the mean step time of a
        # serving engine against the offline API's at the same batch).
        self.steps = 0
        self.step_seconds = 0.0
        self._rng = random.Random(seed)
        # Built now, not on the first guided request: wrapping a large vocabulary takes
        # seconds, which would stall every running stream.
        self._grammar: GrammarCompiler | None = None
        self._grammar_error = "no tokenizer for grammars"
        if grammar is not None:
            try:
                self._grammar = grammar()
                if self._grammar.words != getattr(runner, "words", None):
                    raise ValueError("grammar masks and the model's vocabulary differ in size")
            except Exception as e:  # the engine still serves unconstrained requests
                self._grammar = None
                self._grammar_error = f"{type(e).__name__}: {e}"
                log.warning("guided decoding disabled: %s", self._grammar_error)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        follows: str | None = None,
    ) -> str:
        """Queue a request; raises ValueError if it can never be served. ``follows``: the id
        of a request with the same prompt whose prefill this one should reuse (n > 1)."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"prompt token ids must be non-negative integers, got {t!r}")
            if self.vocab_size is not None and t >= self.vocab_size:
                raise ValueError(f"prompt token id {t} is out of range [0, {self.vocab_size})")
        if self.vocab_size is not None:
            check_vocab(params, self.vocab_size)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        stop = stop_token_set(params, self.eos_token_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        req = Request(rid, list(prompt_token_ids), params, seed, stop, follows=follows)
        if params.guided is not None:
            req.grammar = self._compiler().matcher(*params.guided)
        self.scheduler.add(req)
        return rid

    def _compiler(self) -> GrammarCompiler:
        if self._grammar is None:
            raise ValueError(f"guided decoding is not available ({self._grammar_error})")
        return self._grammar

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.loop.inflight)

    def step(self) -> list[EngineOutput]:
        if self.closed:
            raise RuntimeError("the engine is closed")
        start = time.perf_counter()
        try:
            return self.loop.step()
        finally:
            self.steps += 1
            self.step_seconds += time.perf_counter() - start

    def close(self) -> list[EngineOutput]:
        """Abort what is unfinished and let go of the device memory (KV pools, model) now;
        the engine takes no request after this. Returns the last outputs (the aborts)."""
        sched = self.scheduler
        for rid in [r.request_id for r in sched.waiting] + list(sched.running):
            sched.abort(rid)
        out = self.loop.close()
        self.closed = True
        return out + sched.take_pending_outputs()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants(self.loop.inflight)
