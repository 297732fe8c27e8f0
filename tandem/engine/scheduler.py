"""The scheduler: owns request state, admission, step plans and their accounting.

Pure Python; the runner only ever sees frozen ``StepPlan``s. Accounting (``num_computed``,
``num_inflight``) advances when a plan is *built*, so a chained step is accounted exactly like
a fresh one (DESIGN §2, SGLang #30093).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.engine.plan import PrefillChunk, RowSampling, StepPlan, StepResult
from tandem.engine.request import Request, RequestStatus
from tandem.engine.rows import RowAllocator
from tandem.outputs import EngineOutput


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    # Bound on (rows in use) x (row capacity): the KV the runner may have to hold.
    kv_budget_tokens: int = 1 << 20
    capacity_chunk: int = 256


def round_up(n: int, chunk: int) -> int:
    return -(-n // chunk) * chunk


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.rows = RowAllocator(config.max_num_seqs)
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # owns a row (PREFILL, DECODE or FINISHED)
        self._step_id = 0
        self._pending: list[EngineOutput] = []  # outputs not tied to a step (aborts)

    # ---- intake -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError("prompt must contain at least one token")
        if request.max_len > self.config.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({request.params.max_tokens}) = "
                f"{request.max_len} exceeds the context length {self.config.max_model_len}"
            )
        if round_up(request.max_len, self.config.capacity_chunk) > self.config.kv_budget_tokens:
            raise ValueError(
                f"request needs {request.max_len} KV tokens, more than the KV budget "
                f"({self.config.kv_budget_tokens} tokens)"
            )
        if request.request_id in self.running or any(
            r.request_id == request.request_id for r in self.waiting
        ):
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its row is freed once no in-flight step references it."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._finish(req, "abort")
                return True
        req = self.running.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, "abort")
        self._maybe_release(req)
        return True

    # ---- queries ------------------------------------------------------------------------
    def needs_prefill(self) -> bool:
        return bool(self.waiting) or any(
            r.status is RequestStatus.PREFILL for r in self.running.values()
        )

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    def kv_usage(self) -> float:
        """Share of the KV budget the live requests can reach (rows x longest reservation)."""
        return min(1.0, self._reach(self.rows.high_water) / self.config.kv_budget_tokens)

    def _reach(self, num_rows: int, extra: Request | None = None) -> int:
        """KV tokens the row layout can grow to: rows x longest reservation, rounded up."""
        lens = [r.max_len for r in self.running.values()] + ([extra.max_len] if extra else [])
        return num_rows * round_up(max(lens, default=0), self.config.capacity_chunk)

    def take_pending_outputs(self) -> list[EngineOutput]:
        out, self._pending = self._pending, []
        return out

    # ---- planning -----------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """A fresh step: admissions, prefill chunks under the token budget, all decodes."""
        self._admit()
        budget = self.config.max_num_batched_tokens
        chunks: list[PrefillChunk] = []
        for req in self.running.values():
            if req.status is not RequestStatus.PREFILL:
                continue
            target = req.num_prompt_tokens - 1
            if req.num_computed < target and budget > 0:
                end = min(target, req.num_computed + budget)
                chunk = tuple(req.prompt_token_ids[req.num_computed : end])
                chunks.append(PrefillChunk(req.request_id, req.row, req.num_computed, chunk))
                budget -= len(chunk)
                req.num_computed = end
            if req.num_computed == target and budget > 0:
                # Route by state: the last prompt token is an ordinary decode row.
                req.status = RequestStatus.DECODE
                budget -= 1
        num_rows = self.rows.high_water
        if num_rows == 0 and not chunks:
            return None
        ids: list[str | None] = [None] * num_rows
        positions = [0] * num_rows
        tokens = [0] * num_rows
        reqs: list[Request | None] = [None] * num_rows
        for req in self.running.values():
            assert req.row is not None and not req.finished
            if req.status is RequestStatus.DECODE:
                ids[req.row] = req.request_id
                tokens[req.row] = req.last_token
                reqs[req.row] = req
            # Prefilling rows are holes placed at their next unwritten position.
            positions[req.row] = req.num_computed
        return self._launch(ids, positions, tuple(tokens), reqs, tuple(chunks), chained=False)

    def chain(self, parent: StepPlan) -> StepPlan | None:
        """A decode step on the parent's lazy tokens, or None when the chain must break."""
        if not parent.is_decode or self.needs_prefill():
            return None
        reqs: list[Request | None] = []
        for rid in parent.row_request_ids:
            req = self.running.get(rid) if rid is not None else None
            if rid is not None:
                if req is None or req.finished:
                    return None  # a row would have to be dropped
                # The parent's token is certainly this request's last one: don't waste a step.
                if len(req.output_token_ids) + req.num_inflight >= req.params.max_tokens:
                    return None
            reqs.append(req)
        positions = [p + 1 for p in parent.positions]
        return self._launch(
            list(parent.row_request_ids),
            positions,
            None,
            reqs,
            (),
            chained=True,
            sampling=parent.sampling,
        )

    def _launch(
        self,
        ids: list[str | None],
        positions: list[int],
        tokens: tuple[int, ...] | None,
        reqs: list[Request | None],
        chunks: tuple[PrefillChunk, ...],
        *,
        chained: bool,
        sampling: RowSampling | None = None,
    ) -> StepPlan:
        """Freeze a plan and advance accounting for every request it touches."""
        for req in reqs:
            if req is not None:
                req.num_computed += 1
        touched = {r.request_id for r in reqs if r is not None}
        touched.update(c.request_id for c in chunks)
        for rid in touched:
            self.running[rid].num_inflight += 1
        ends = [p + 1 for p in positions] + [c.start + len(c.token_ids) for c in chunks]
        capacity = round_up(max(ends), self.config.capacity_chunk)
        self._step_id += 1
        return StepPlan(
            step_id=self._step_id,
            row_request_ids=tuple(ids),
            positions=tuple(positions),
            input_tokens=tokens,
            sampling=sampling or _row_sampling(reqs),
            chunks=chunks,
            capacity=capacity,
            chained=chained,
        )

    def _admit(self) -> None:
        cfg = self.config
        while self.waiting and self.rows.num_free:
            req = self.waiting[0]
            row = self.rows.peek()
            assert row is not None
            if self._reach(max(self.rows.high_water, row + 1), req) > cfg.kv_budget_tokens:
                break
            self.waiting.popleft()
            req.row = self.rows.allocate(req.request_id)
            req.status = RequestStatus.PREFILL
            req.num_computed = 0
            self.running[req.request_id] = req

    # ---- results ------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[EngineOutput]:
        """Apply a finalized step (strictly in launch order): append tokens, detect stops."""
        assert result.step_id == plan.step_id
        outputs = self.take_pending_outputs()
        for rid, token in zip(plan.row_request_ids, result.tokens, strict=True):
            if rid is None:
                continue
            req = self.running[rid]
            if req.finished:
                continue  # finished earlier in the chain; this token is past its end
            req.output_token_ids.append(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason, emit=False)
            outputs.append(EngineOutput(rid, (token,), reason))
        for rid in plan.request_ids:
            req = self.running[rid]
            req.num_inflight -= 1
            self._maybe_release(req)
        return outputs

    def _stop_reason(self, req: Request, token: int) -> str | None:
        if token in req.stop_ids:
            return "stop"
        if len(req.output_token_ids) >= req.params.max_tokens:
            return "length"
        return None

    def _finish(self, req: Request, reason: str, *, emit: bool = True) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if emit:
            self._pending.append(EngineOutput(req.request_id, (), reason))

    def _maybe_release(self, req: Request) -> None:
        """Late release: a finished request keeps its row until no launched step uses it."""
        if req.finished and req.num_inflight == 0 and req.row is not None:
            self.rows.release(req.row, req.request_id)
            req.row = None
            del self.running[req.request_id]

    # ---- invariants ---------------------------------------------------------------------
    def check_invariants(self, inflight: Iterable[StepPlan] = ()) -> None:
        """Raise AssertionError if request or row accounting is inconsistent."""
        self.rows.check()
        waiting_ids = [r.request_id for r in self.waiting]
        assert len(set(waiting_ids)) == len(waiting_ids), "a request waits twice"
        assert not set(waiting_ids) & self.running.keys(), "a request is in two states"
        refs: dict[str, int] = {}
        for plan in inflight:
            for rid in plan.request_ids:
                refs[rid] = refs.get(rid, 0) + 1
        for req in self.waiting:
            assert req.status is RequestStatus.WAITING and req.row is None
        for rid, req in self.running.items():
            assert req.row is not None and self.rows.owner(req.row) == rid, "row owner mismatch"
            assert req.num_inflight == refs.get(rid, 0), f"{rid}: in-flight count is off"
            assert req.num_inflight >= 0
            if req.finished:
                assert req.num_inflight > 0, f"{rid} finished but was not released"
            elif req.status is RequestStatus.DECODE:
                expected = req.num_prompt_tokens - 1 + len(req.output_token_ids) + req.num_inflight
                assert req.num_computed == expected, f"{rid}: KV accounting is off"
            else:
                assert req.num_computed < req.num_prompt_tokens, f"{rid}: prefill overran"
        for rid in refs:
            assert rid in self.running, f"in-flight step references released {rid}"


def _row_sampling(reqs: list[Request | None]) -> RowSampling:
    temps, ks, ps, seeds = [], [], [], []
    for req in reqs:
        p = req.params if req is not None else None
        temps.append(p.temperature if p else 0.0)
        ks.append(p.top_k if p else 0)
        ps.append(p.top_p if p else 1.0)
        seeds.append(req.seed if req is not None else 0)
    return RowSampling(tuple(temps), tuple(ks), tuple(ps), tuple(seeds))
