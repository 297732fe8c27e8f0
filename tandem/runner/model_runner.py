"""The model runner: turns frozen step plans into lazy MLX graphs (launch) and plain tokens
(finalize). The only engine code that touches MLX; it never sees request objects.
"""

from __future__ import annotations

import gc
import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tandem.engine.grammar import words_for
from tandem.engine.plan import StepPlan, StepResult
from tandem.runner import (
    adapters,
    attention,
    fused_proj,
    gated_delta,
    kernel_check,
    kv_owners,
    kv_write,
    layers,
    recurrent_step,
    verify,
    weight_views,
)
from tandem.runner.draft import DraftModel
from tandem.runner.handle import Handle
from tandem.runner.kv_quant import KVQuant
from tandem.runner.paged import PagePool, bytes_per_token, cache_class, quantizable
from tandem.runner.positions import install as install_positions
from tandem.runner.row_select import install_row_selection
from tandem.runner.sampler import (
    SamplingArrays,
    advance,
    count_lazy_outputs,
    logprobs_of,
    make_sampling_arrays,
    sample,
    token_logprobs,
)
from tandem.runner.state import StatePool
from tandem.runner.static_decode import StaticDecode, default_rows
from tandem.runner.step_context import StepContext

log = logging.getLogger("tandem")


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        *,
        model_type: str = "",
        overlap: bool = True,
        double_buffer: bool | None = None,
        decode_kernel: bool | None = None,
        verify_layers: bool = True,
        kv_quant: KVQuant | None = None,
        inplace_writes: bool | None = None,
        compile_decode: int | None = 0,
        fuse_projections: int = 0,
        head_major: bool | None = None,
    ) -> None:
        """``double_buffer``: two KV buffer sets so a step never writes what the step still in
        flight reads (runner/paged.py); None: with overlap on the CPU backend (measured).
        ``kv_quant``: KV pages quantized to that many bits (runner/kv_quant.py).
        ``inplace_writes``: KV writes by a kernel into the one buffer set (runner/kv_write.py;
        None: where the kernels exist and pass their check: CUDA, one set). ``compile_decode``:
        decode steps of at most that many rows through ``mx.compile`` where the model allows
        (runner/static_decode.py; None: ``static_decode.default_rows``).
        ``fuse_projections``: rows up to which q/k/v and gate/up are one matmul (fused_proj).
        ``head_major``: float pages head by head (runner/paged.py; None: on the CPU)."""
        layout = layers.declared_layout(model, model_type)  # (raises for kinds not served)
        self.model = model
        self.model_type = model_type
        self.verify = verify_layers
        self.stream = mx.new_stream(mx.default_device())
        self.fused = fused_proj.fuse(model, fuse_projections) if fuse_projections else []
        attention.install(model)
        adapters.install(model)  # model code that takes the cache offset as a number
        self.own_recurrence = gated_delta.install(model)
        weight_views.install(model)  # (fused projections above hold their own weights)
        self.batch_sequences = True  # False: the load check found (B, n) calls wrong
        with mx.stream(self.stream):
            self.layout, self.specs, self.state_specs, self.vocab_size = layers.probe_layers(
                model, model_type, layout
            )
            self.selector = install_row_selection(model)
        # A verify keeps its states per position (else a rejected proposal replays).
        self.state_positions = install_positions(model, len(self.state_specs))
        self.mask_rank = 4
        self.state_pool: StatePool | None = None
        if double_buffer is None:
            double_buffer = overlap and mx.default_device() == mx.cpu
        self.double_buffer = double_buffer and not self.state_specs  # (replays 1 write/layer)
        # The automatic host thread (engine/loop.py) only with a device apart from the host.
        self.host_thread_auto = mx.default_device() != mx.cpu
        self.cuda = self.host_thread_auto and mx.cuda.is_available()  # (build.py's defaults)
        self.decode_kernel = decode_kernel  # None: decided with the pool (the CPU gathers)
        self.inplace_writes = inplace_writes
        self.head_major = head_major
        rows = 1 << 30 if compile_decode is True else compile_decode  # (None: allocate_kv)
        self.compile_decode = None if rows is None else int(rows)
        self.static: StaticDecode | None = None
        self.kv_quant = kv_quant
        self.pool: PagePool | None = None
        self.words = words_for(self.vocab_size)
        # The draft model of draft-model speculation (runner/draft.py), set by build.py.
        self.draft: DraftModel | None = None

    @property
    def num_heads(self) -> int | None:
        args = getattr(self.model, "args", None)
        return getattr(args, "num_attention_heads", None)

    @property
    def bytes_per_token(self) -> int:
        per_set = sum(bytes_per_token(s, self.kv_quant) for s in self.specs)
        return (2 if self.double_buffer else 1) * per_set

    @property
    def max_window(self) -> int:
        """The widest sliding window of a layer that stores KV (0: none has one)."""
        return max((s.window for s in self.specs if s.window and not s.unused), default=0)

    def window_bytes_per_token(self) -> int:
        """Of ``bytes_per_token``, what the sliding-window layers take."""
        per_set = sum(bytes_per_token(s, self.kv_quant) for s in self.specs if s.window)
        return (2 if self.double_buffer else 1) * per_set

    @property
    def kv_description(self) -> str:
        """The KV entries' storage, for the start-up report."""
        used = [s for s in self.specs if not s.unused]
        dtype = str(used[0].dtype).removeprefix("mlx.core.") if used else "none"
        if self.kv_quant is None:
            return dtype
        n = sum(quantizable(s, self.kv_quant) for s in used)
        return f"int{self.kv_quant.bits} in {n} of {len(used)} layers, else {dtype}"

    @property
    def dense_bytes_per_token(self) -> int:
        """Bytes one gathered history position costs in the widest dense layer."""
        return max((s.bytes_per_token for s in self.specs if s.dense), default=0)

    @property
    def dense(self) -> bool:
        """Whether some layer attends over gathered per-token history (``runner.layers``)."""
        return any(s.dense for s in self.specs)

    @property
    def state_bytes_per_seq(self) -> int:
        return sum(s.bytes_per_seq for s in self.state_specs)

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state (``runner.state``)."""
        return bool(self.state_specs)

    def allocate_kv(
        self, num_pages: int, page_size: int, state_slots: int = 0, window_pages: int = 0
    ) -> None:
        """Create the pools once, before serving: their sizes never change. ``state_slots``:
        recurrent states for that many sequences (the scheduler's ``max_num_seqs``);
        ``window_pages``: the sliding-window layers' own page group (0: none)."""
        with mx.stream(self.stream):
            if self.decode_kernel is not False:
                self.decode_kernel = kernel_check.usable(self.specs, self.num_heads, self.kv_quant)
            self.pool = PagePool(
                self.specs,
                num_pages,
                page_size,
                double_buffer=self.double_buffer,
                quant=self.kv_quant,
                inplace=self._inplace(),
                window_pages=window_pages,
                # (never under the kernel; None: on the CPU, measured there; not in place)
                head_major=self.head_major is not False
                and not self.decode_kernel
                and (self.head_major or mx.default_device() == mx.cpu),
            )
            if self.state_specs:
                self.state_pool = StatePool(self.state_specs, state_slots, self.inplace_writes)
            if self.dense:
                self.mask_rank = verify.dense_mask_rank(self)
            if self.verify:  # uncompiled: a trace would keep its scratch pool
                verify.against_mlx_lm(self, self.model_type)
            eligible = StaticDecode.eligible(self)  # (the CPU's probe only where it is)
            if self.compile_decode is None:
                rows = default_rows(self.pool.inplace, kv=bool(self.specs))
                self.compile_decode = rows if eligible else 0
            if self.compile_decode and eligible:
                self.static = StaticDecode(self)
                log.info("compiled decode steps of up to %d rows", self.compile_decode)

    def _inplace(self) -> bool:
        if self.inplace_writes is False or self.double_buffer:
            return False
        dtypes = {s.dtype for s in self.specs if not s.unused}
        if self.kv_quant is not None:
            dtypes.add(mx.uint32)
        return bool(dtypes) and all(kv_write.available(t) for t in dtypes)

    def reset(self) -> None:
        """After a failure: drop every in-flight step's arrays and recreate the pool."""
        assert self.pool is not None
        with mx.stream(self.stream):
            # Both pools' old buffers (and the failed steps' graphs that reference them) go
            # before either is allocated again, so the new ones fit where the old were.
            self.pool.sets = []
            if self.state_pool is not None:
                self.state_pool.release()
            if self.static is not None:  # (a failure at evaluation would recur each replay)
                log.warning("compiled decode steps off after a failed step")
                self.static = None
            self.pool.reset()
            if self.state_pool is not None:
                self.state_pool.reset()
        if self.draft is not None:
            self.draft.runner.reset()

    def close(self) -> None:
        """The engine is closed: let go of the pools, the compiled steps and the model now, so
        their memory is free for what comes next (not when the collector finds the engine)."""
        if self.pool is not None:
            self.pool.release()
        if self.state_pool is not None:
            self.state_pool.release()
        if self.draft is not None:
            self.draft.runner.close()
        self.pool = self.state_pool = self.static = self.draft = None
        self.model, self.fused, self.selector = None, [], None
        gc.collect()
        mx.clear_cache()

    def _buffers(self) -> list[mx.array]:
        """Every pool buffer a step writes: evaluated with the step's outputs."""
        assert self.pool is not None
        extra = self.state_pool.arrays() if self.state_pool is not None else []
        return self.pool.arrays() + extra

    @property
    def shapes(self) -> int:
        """Compiled step shapes met so far, the draft model's included: a launch that meets
        a new one traces it (the model's Python, then MLX compiling its kernels), a cost
        paid once (engine/loop.py). A shape traced again after ``MAX_SHAPES`` dropped it
        is not new: that is a recurring cost."""
        own = len(self.static.shapes) if self.static is not None else 0
        return own + (self.draft.runner.shapes if self.draft is not None else 0)

    def launch(
        self,
        plan: StepPlan,
        parent: Handle | None,
        masks: np.ndarray | None = None,
        *,
        submit: bool = True,
    ) -> Handle:
        """Build the step's graph and submit it; ``submit=False``: hold it back for
        ``submit`` (not a step with constrained rows still waiting for masks)."""
        pool = self.pool
        assert pool is not None, "allocate_kv() first"
        with mx.stream(self.stream):
            inputs = self._inputs(plan, parent)
            drafted, draft_failed = None, False
            if plan.drafts:
                assert self.draft is not None, "a plan with draft queries, and no draft model"
                inputs, drafted, draft_failed = self.draft.feed(plan, inputs)
            sample_idx, prompt_rows = [], []
            t = 0
            for seg in plan.segments:
                if seg.sample_row >= 0:
                    assert seg.sample_row == len(sample_idx)
                    first = t + seg.num_tokens - seg.num_samples
                    sample_idx += range(first, t + seg.num_tokens)
                if seg.logprobs >= 0:
                    prompt_rows.append((seg, t))
                t += seg.num_tokens
            head = sample_idx + [
                t0 + i for seg, t0 in prompt_rows for i in range(len(seg.next_tokens))
            ]
            logits = self.forward(plan, inputs, head)
            prompt_lps = []
            off = len(sample_idx)
            for seg, _ in prompt_rows:
                n = len(seg.next_tokens)
                nxt = mx.array(seg.next_tokens, dtype=mx.int32)
                prompt_lps.append(
                    (
                        seg.request_id,
                        seg.logprobs,
                        logprobs_of(logits[off : off + n], nxt, seg.logprobs),
                    )
                )
                off += n
            sampled = logits[: len(sample_idx)]
            sampling = self._sampling(plan, parent, inputs)
            positions = (
                mx.array(plan.sample_positions, dtype=mx.int32)
                if sampling.needs_positions
                else None
            )
            handle = Handle(plan, None, sampling, None, prompt_lps or None)
            handle.drafted, handle.draft_failed = drafted, draft_failed
            extra = [a for _, _, arrs in prompt_lps for a in arrs]
            if drafted is not None:  # and the draft's KV writes
                assert self.draft is not None
                extra += [drafted[0], *self.draft.runner._buffers()]
            if plan.sampling.constrained and masks is None:
                # Keep the device busy with the forward; the sampling follows the masks.
                handle.pending = (sampled, sampling, positions)
                mx.async_eval(sampled, *extra, *self._buffers())
                return handle
            arrays = [*self._sample(handle, sampled, sampling, positions, masks), *extra]
            if submit:
                mx.async_eval(*arrays, *self._buffers())
            else:
                handle.unsubmitted = [*arrays, *self._buffers()]
        return handle

    def submit(self, handle: Handle) -> None:
        """Submit a step launched with ``submit=False``."""
        arrays, handle.unsubmitted = handle.unsubmitted, None
        assert arrays is not None, "submit() of a step already submitted"
        with mx.stream(self.stream):
            mx.async_eval(*arrays)

    def forward(self, plan: StepPlan, inputs: mx.array, head: list[int]) -> mx.array:
        """The step's forward: the logits of token indices ``head``, (len(head), vocab)."""
        assert self.pool is not None
        if self.state_pool is not None:
            self.state_pool.forget(plan.released_states)
        if self.static is not None and self.static.applies(plan.segments, head):
            try:
                return self.static.forward(plan.segments, inputs, head)
            except Exception as e:  # noqa: BLE001 - e.g. model code a trace cannot run
                log.warning("compiled decode steps off (%s: %s)", type(e).__name__, e)
                self.static = None
        if self.state_pool is None:
            ctx = self.context(plan.segments)
            self.pool.begin_step(ctx.group_slots)
            return self.call(ctx, inputs[:, None], head)
        return recurrent_step.forward(self, plan, inputs, head)

    def context(self, segments, *, sequence: bool = False) -> StepContext:
        assert self.pool is not None
        ctx = StepContext(
            segments,
            self.pool.page_size,
            kernel=bool(self.decode_kernel),
            sequence=sequence,
            windowed=self.pool.window_pages > 0,
        )
        ctx.mask_rank = self.mask_rank
        return ctx

    def call(
        self, ctx: StepContext, inputs: mx.array, rows: list[int], states: list | None = None
    ) -> mx.array:
        """The model on ``inputs`` ((T, 1) rows, or (B, n) in the sequence layout: tokens
        counted sequence by sequence); the logits of token ``rows`` (in that order),
        (len(rows), vocab). ``states``: the step's recurrent caches, written back after."""
        assert self.pool is not None
        pool = self.pool

        cache_cls = cache_class(self.model_type)

        def attn(i, node):
            return cache_cls(ctx, pool, i)

        def state(j, node):
            assert states is not None
            return states[j]

        caches, _, _ = layers.build_caches(self.layout, attn, state)
        head_rows = mx.array(rows, dtype=mx.int32)
        with gated_delta.active(), kv_owners.forward(), fused_proj.releasing(self.fused):
            if self.selector is not None:
                self.selector.select(head_rows, sequence=ctx.sequence)
                try:
                    logits = self.model(inputs, cache=caches)[:, 0, :]
                finally:
                    self.selector.select(None)
            elif ctx.sequence:
                logits = self.model(inputs, cache=caches).flatten(0, 1)[head_rows]
            else:
                logits = self.model(inputs, cache=caches)[head_rows, 0, :]
        for c in states or ():
            c.write_back()
        return logits

    def _inputs(self, plan: StepPlan, parent: Handle | None) -> mx.array:
        """(T,) input tokens: the lazy segments (first in the plan) take the parent's sampled
        tokens on the device; the rest come from the host."""
        lazy = [seg.parent_row for seg in plan.segments if seg.lazy]
        host = [t for seg in plan.segments if not seg.lazy for t in seg.token_ids]
        parts = []
        if lazy:
            assert parent is not None and parent.tokens is not None
            assert all(seg.lazy for seg in plan.segments[: len(lazy)]), "lazy segments first"
            n = parent.tokens.shape[0]
            parts.append(parent.tokens if lazy == list(range(n)) else parent.tokens[mx.array(lazy)])
        if host:
            parts.append(mx.array(host, dtype=mx.uint32))
        out = parts[0] if len(parts) == 1 else mx.concatenate([p.astype(mx.uint32) for p in parts])
        return out.astype(mx.int32)

    def _sampling(self, plan: StepPlan, parent: Handle | None, inputs: mx.array) -> SamplingArrays:
        if plan.reuse_sampling:
            assert parent is not None
            return parent.sampling
        s = make_sampling_arrays(plan.sampling, self.vocab_size)
        # A lazily fed row's newest output is on the device only: count it there.
        lazy_rows = {seg.sample_row: i for i, seg in enumerate(plan.segments) if seg.lazy}
        return count_lazy_outputs(s, plan.sampling, lazy_rows, inputs, self.vocab_size)

    def complete(self, handle: Handle, masks: np.ndarray) -> None:
        """Attach the sampling of a forward launched without its grammar masks."""
        assert handle.pending is not None, "complete() of a step that is not waiting"
        logits, sampling, positions = handle.pending
        handle.pending = None
        with mx.stream(self.stream):
            mx.async_eval(*self._sample(handle, logits, sampling, positions, masks))

    def _sample(
        self,
        handle: Handle,
        logits: mx.array,
        sampling: SamplingArrays,
        positions: mx.array | None,
        masks: np.ndarray | None,
    ) -> list[mx.array]:
        """Attach the sampling graph to ``handle``; returns the arrays to evaluate."""
        if logits.shape[0] == 0:  # only prefill chunks that sample nothing
            handle.tokens = mx.zeros((0,), dtype=mx.uint32)
            return [handle.tokens]
        grammar = None
        if masks is not None:
            rows = mx.array(handle.plan.sampling.constrained, dtype=mx.int32)
            grammar = (rows, mx.array(masks))
        tokens = sample(logits, sampling, positions, grammar)
        lps = token_logprobs(logits, sampling, tokens)
        handle.tokens, handle.sampling, handle.logprobs = tokens, advance(sampling, tokens), lps
        return [tokens, *(lps or ())]

    def finalize(self, handle: Handle) -> StepResult:
        return handle.result()
